"""Worker processes: one OS process per replica, never outliving its node agent.

Each worker is started in its own process group with a parent-death signal
(Linux), so a node agent that dies without cleaning up still takes its workers
with it. Output goes to one log file per replica under the state directory.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from shoal.shared.child_process import die_with_parent
from shoal.shared.messages import ModelSpec, ReplicaRecord, encode_json

log = structlog.get_logger(__name__)

@dataclass
class WorkerProcess:
    replica_id: str
    model: str
    process: asyncio.subprocess.Process
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


async def spawn_worker(argv: list[str], replica_id: str, model: str, log_dir: Path) -> WorkerProcess:
    """Start a worker process whose stdout/stderr go to ``<log_dir>/<replica_id>.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{replica_id}.log"
    with open(log_path, "ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
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


def worker_command(nats_url: str, node_id: str, models_root: str, replica: ReplicaRecord, model: ModelSpec,
                   **options: Any) -> list[str]:
    """The argv of `shoal worker` for one replica."""
    argv = [sys.executable, "-m", "shoal.services.worker", "--nats-url", nats_url, "--node-id", node_id,
            "--models-root", models_root, "--replica", encode_json(replica).decode(),
            "--model", encode_json(model).decode()]
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv
