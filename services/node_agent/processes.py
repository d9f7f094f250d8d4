"""Worker processes: one OS process per replica, never outliving its node agent.

Each worker is started in its own process group with a parent-death signal
(Linux), so a node agent that dies without cleaning up still takes its workers
with it. It gets its `WorkerLaunch` on stdin, or from the fork server it is forked
from (nothing it is told shows on a command line); its environment is the agent's
less Shoal's NATS secrets (`is_secret_env_var`), which it gets in the launch
instead. Output goes to one log file per replica under the state directory.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog

from shoal.services.node_agent.forkserver import ForkServerClient, ForkServerUnavailable
from shoal.services.worker.launch import WorkerLaunch, encode_launch
from shoal.shared.child_process import die_with_parent
from shoal.shared.subjects import validate_replica_id

log = structlog.get_logger(__name__)


class ChildProcess(Protocol):
    """What the agent needs of a worker's process: an `asyncio.subprocess.Process` it spawned,
    or a `ForkedWorker` its fork server started."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    async def wait(self) -> int: ...


@dataclass
class WorkerProcess:
    replica_id: str
    model: str
    process: ChildProcess
    log_path: Path
    stopping: bool = False
    """Set when the agent asked it to stop: its exit is not a failure."""
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the worker drains), then SIGKILL after `timeout_s`; returns the exit code."""
        self.stopping = True
        if self.process.returncode is None:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout_s)
            except TimeoutError:
                log.warning("worker_kill", replica=self.replica_id, pid=self.pid)
                self._signal(signal.SIGKILL)
                await self.process.wait()
        return self.process.returncode

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


WORKER_ARGV = (sys.executable, "-m", "shoal.services.worker")
SECRET_ENV_MARKERS = ("PASSWORD", "TOKEN", "API_KEYS")
"""A ``SHOAL_*`` variable whose name holds one of these is a secret (``SHOAL_NATS_PASSWORD``,
``SHOAL_GATEWAY_API_KEYS``...): a worker gets what it needs in its launch instead, and
nothing else (`ps e` shows a process's environment)."""


def is_secret_env_var(name: str) -> bool:
    return name.startswith("SHOAL_") and any(marker in name for marker in SECRET_ENV_MARKERS)


def worker_env() -> dict[str, str]:
    """A worker's environment: the agent's without Shoal's secrets, with unbuffered output."""
    return {**{k: v for k, v in os.environ.items() if not is_secret_env_var(k)}, "PYTHONUNBUFFERED": "1"}


async def spawn_worker(launch: WorkerLaunch, log_dir: Path, fork_server: ForkServerClient | None = None
                       ) -> WorkerProcess:
    """Start a worker process for `launch.replica`: a fork of `fork_server` when it can fork,
    else a new process handed `launch` on stdin. Its stdout and stderr go to
    ``<log_dir>/<replica_id>.log``."""
    replica_id, model = validate_replica_id(launch.replica.replica_id), launch.replica.model  # a file name
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{replica_id}.log"
    if fork_server is not None:
        try:
            forked = await fork_server.fork(encode_launch(launch), log_path, title=f"shoal worker {model} {replica_id}")
        except ForkServerUnavailable as exc:
            log.warning("worker_fork_unavailable", replica=replica_id, model=model, error=str(exc))
        else:
            log.info("worker_forked", replica=replica_id, model=model, pid=forked.pid, log=str(log_path))
            return WorkerProcess(replica_id=replica_id, model=model, process=forked, log_path=log_path)
    with open(log_path, "ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            *WORKER_ARGV,
            stdin=asyncio.subprocess.PIPE,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
            env=worker_env(),
        )
    assert process.stdin is not None, "the worker's stdin is a pipe"
    process.stdin.write(encode_launch(launch))
    try:
        await process.stdin.drain()
    except ConnectionError:  # it died at once: its exit is reported by the agent's watcher
        log.warning("worker_launch_not_sent", replica=replica_id, pid=process.pid)
    process.stdin.close()
    log.info("worker_spawned", replica=replica_id, model=model, pid=process.pid, log=str(log_path))
    return WorkerProcess(replica_id=replica_id, model=model, process=process, log_path=log_path)


def tail_log(path: Path, num_bytes: int = 2000) -> str:
    """The end of a worker's log, for failure reports."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - num_bytes))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def describe_exit(code: int | None, log_tail: str) -> str:
    """Why a worker ended, for its replica's ``last_error``: the signal that killed it (an
    operator's kill, the kernel's OOM killer: its log's last line is whatever it was doing, left
    out) or its exit code and its log's last line (a crash's own words)."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = f"worker killed by {name}"
        if name in ("SIGKILL", "SIGTERM"):
            return how
    else:
        how = f"worker exited with code {code}"
    last_line = next((line for line in reversed(log_tail.strip().splitlines()) if line.strip()), "")
    return f"{how}: {last_line[-300:]}" if last_line else how
