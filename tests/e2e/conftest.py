"""`shoal up` as a real subprocess, as a new user runs it."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

READY_LINE = "Shoal is up"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def processes_mentioning(*needles: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of every live process whose command line contains one of `needles`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if state != "Z" and any(n in cmdline for n in needles):
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


def start_shoal_up(models_root: Path, state_dir: Path, *extra: str, timeout_s: float = 120.0) -> ShoalUp:
    port = free_port()
    argv = [sys.executable, "-m", "shoal.services.cli", "up", "--port", str(port), "--models-root", str(models_root),
            "--state-dir", str(state_dir), "--gpus", "virtual:2x16GiB", "--log-format", "json", *extra]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 1.0)
        if not ready:
            if process.poll() is not None:
                break
            continue
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        lines.append(line)
        if READY_LINE in line:
            nats_url = line.split("NATS ", 1)[1].split(";", 1)[0]
            return ShoalUp(process, f"http://127.0.0.1:{port}", nats_url, state_dir, lines)
    process.kill()
    raise AssertionError("shoal up did not come up:\n" + "".join(lines[-40:]))


@pytest.fixture(scope="module")
def shoal(demo_models_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShoalUp]:
    """One `shoal up` for a test module; stopped with SIGTERM afterwards."""
    instance = start_shoal_up(demo_models_root, tmp_path_factory.mktemp("state"))
    try:
        yield instance
    finally:
        instance.stop()
