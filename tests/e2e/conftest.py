"""`shoal up` as a real subprocess, as a new user runs it."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

READY_LINE = "Shoal is up"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def context_length(client: openai.OpenAI, model: str) -> int:
    """`model`'s context, known once a node agent has inspected it (just after startup)."""
    deadline = time.monotonic() + 60
    while (length := (client.models.retrieve(model).model_extra or {}).get("max_model_len")) is None:
        assert time.monotonic() < deadline, "the model was never inspected"
        time.sleep(0.2)
    return int(length)


def http_json(base_url: str, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float = 300
              ) -> tuple[int, Any]:
    """(status, decoded JSON body) of one request, errors included."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def processes_mentioning(*needles: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of every live process whose command line, or a file it holds open (a
    worker's log, whose launch comes on stdin), contains one of `needles`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
            open_files = " ".join(os.readlink(fd) for fd in (entry / "fd").iterdir())
        except OSError:
            continue
        if state != "Z" and any(n in cmdline or n in open_files for n in needles):
            found.append((int(entry.name), cmdline[:200]))
    return found


@dataclass
class ShoalUp:
    process: subprocess.Popen[str]
    base_url: str
    nats_url: str
    state_dir: Path
    log_lines: list[str]

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def leftovers(self) -> list[tuple[int, str]]:
        return processes_mentioning(str(self.state_dir), self.nats_url)


PORT_TAKEN = "address already in use"
LAUNCH_ATTEMPTS = 3


def start_shoal_up(models_root: Path, state_dir: Path, *extra: str, timeout_s: float = 120.0,
                   env: dict[str, str] | None = None) -> ShoalUp:
    """`shoal up` on a free port with virtual GPUs; `env` adds environment variables (settings
    such as ``SHOAL_WORKER_STATS_INTERVAL_S``). The port is free when picked, not reserved:
    the embedded NATS server, which binds first, may take it; then it starts again on another."""
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        port = free_port()
        argv = [sys.executable, "-m", "shoal.cli.main", "up", "--port", str(port), "--models-root", str(models_root),
                "--state-dir", str(state_dir), "--gpus", "virtual:2x16GiB", "--log-format", "json", *extra]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                   env={**os.environ, **(env or {})})
        lines: list[str] = []
        line = _ready_line(process, lines, timeout_s)
        if line is not None:
            nats_url = line.split("NATS ", 1)[1].split(";", 1)[0]
            return ShoalUp(process, f"http://127.0.0.1:{port}", nats_url, state_dir, lines)
        if attempt == LAUNCH_ATTEMPTS or not any(PORT_TAKEN in output for output in lines):
            raise AssertionError("shoal up did not come up:\n" + "".join(lines[-40:]))
    raise AssertionError("unreachable: the last attempt returns or raises")


def _ready_line(process: subprocess.Popen[str], lines: list[str], timeout_s: float) -> str | None:
    """The line saying `process` is up; None if it exits first or `timeout_s` passes (it is
    then killed). `lines` collects its output, drained for the life of the process."""
    ready_lines: queue.Queue[str] = queue.Queue()

    def read_output() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if READY_LINE in line:
                ready_lines.put(line)

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return ready_lines.get(timeout=0.2)
        except queue.Empty:
            if process.poll() is not None:
                reader.join(timeout=5)  # the rest of its output
                return None
    process.kill()
    process.wait()
    return None


def module_shoal_up(models_root: Path, tmp_path_factory: pytest.TempPathFactory,
                    env: dict[str, str] | None = None) -> Iterator[ShoalUp]:
    """The body of a module's `shoal` fixture: one `shoal up` (with `env`), stopped with
    SIGTERM afterwards, its errors printed (pytest shows them when a test failed)."""
    instance = start_shoal_up(models_root, tmp_path_factory.mktemp("state"), env=env)
    try:
        yield instance
    finally:
        instance.stop()
        problems = [line for line in instance.log_lines if '"level": "error"' in line or "Traceback" in line]
        print("".join(problems[-20:]))


@pytest.fixture(scope="module")
def shoal(demo_models_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShoalUp]:
    """One `shoal up` for a test module."""
    yield from module_shoal_up(demo_models_root, tmp_path_factory)


@pytest.fixture(scope="module")
def client(shoal: ShoalUp) -> openai.OpenAI:
    """The `openai` client on the module's `shoal up`."""
    return openai.OpenAI(base_url=shoal.v1, api_key="unused", max_retries=0, timeout=240)
