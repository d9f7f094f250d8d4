"""A node agent's worker fork server (services/worker/forkserver.py), as the agent sees it.

Started with the agent, the server imports the worker's libraries once; each worker is then a
fork of it that starts loading its model at once (a new Python process first spends seconds
importing torch and transformers). The server, not the agent, is the workers' parent, so their
exit statuses come back as its messages: a `ForkedWorker` stands for the process the way an
`asyncio.subprocess.Process` does for one the agent spawned itself.

The agent spawns workers itself while the server is off (``node.worker_fork_server = false``),
still importing past `READY_TIMEOUT_S`, or dead. A server that dies takes its workers with it
(they are killed, and reported exited) and is started again at once, at most `MAX_RESTARTS`
times.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import structlog

from shoal.services.worker.forkserver_messages import (
    Fork,
    Forked,
    ForkFailed,
    ServerReady,
    WorkerExited,
    encode_line,
    server_message_decoder,
)
from shoal.shared.child_process import die_with_parent, is_running

log = structlog.get_logger(__name__)

SERVER_ARGV = (sys.executable, "-m", "shoal.services.worker.forkserver")
READY_TIMEOUT_S = 20.0
"""How long a fork waits for the server's imports before the agent spawns the worker itself (well
within the scheduler's 30 s for a `create`'s answer)."""
FORK_TIMEOUT_S = 10.0
MAX_RESTARTS = 3
ORPHAN_EXIT_TIMEOUT_S = 5.0
"""After the server died, how long the agent waits for each of its killed workers to be gone."""


class ForkServerUnavailable(Exception):
    """The server cannot fork now (off, dead, or not ready in time): spawn the worker directly."""


class ForkedWorker:
    """A worker forked by the server: its pid, and its exit status once the server reports it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.Event()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def set_exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()


class ForkServerClient:
    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self._log_path = log_dir / "forkserver.log"
        self._env = env
        self._process: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future[int] | None = None
        self._pending: dict[int, asyncio.Future[ForkedWorker]] = {}
        self._workers: dict[int, ForkedWorker] = {}
        self._request_ids = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None
        self._abandoned: set[int] = set()
        self._restarts = 0
        self._closing = False

    async def start(self) -> None:
        """Start the server; it takes forks once its imports are done (`fork` waits for them).
        A server that cannot be started is logged: workers are then spawned directly."""
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self._ready = asyncio.get_running_loop().create_future()
        try:
            with open(self._log_path, "ab") as log_file:
                self._process = await asyncio.create_subprocess_exec(
                    *SERVER_ARGV, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log_file,
                    start_new_session=True, preexec_fn=die_with_parent, env=self._env,
                )
        except (OSError, subprocess.SubprocessError) as exc:
            log.error("fork_server_not_started", error=str(exc), detail="workers are spawned directly")
            self._process = None
            return
        self._reader = asyncio.create_task(self._read(self._process))
        log.info("fork_server_started", pid=self._process.pid, log=str(self._log_path))

    async def fork(self, launch: bytes, log_path: Path, title: str) -> ForkedWorker:
        """A new worker running `launch`, its output appended to `log_path`."""
        process, ready = self._process, self._ready
        if process is None or ready is None or process.stdin is None:
            raise ForkServerUnavailable("the fork server is not running")
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await asyncio.shield(ready)
        except TimeoutError as exc:
            raise ForkServerUnavailable(f"the fork server was not ready within {READY_TIMEOUT_S:.0f}s") from exc
        request_id = next(self._request_ids)
        forked = asyncio.get_running_loop().create_future()
        self._pending[request_id] = forked
        try:
            async with asyncio.timeout(FORK_TIMEOUT_S):
                process.stdin.write(encode_line(Fork(request_id, launch, str(log_path), title)))
                await process.stdin.drain()
                return await forked
        except (ConnectionError, TimeoutError) as exc:
            raise ForkServerUnavailable(f"the fork server did not fork: {exc!r}") from exc
        finally:
            if self._pending.pop(request_id, None) is not None and not forked.done():
                self._abandoned.add(request_id)  # given up on (timeout, cancel): a late fork is killed

    async def close(self) -> None:
        """Stop the server (its stdin closes); workers still running die with it."""
        self._closing = True
        process = self._process
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            async with asyncio.timeout(5.0):
                await process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        if self._reader is not None:
            await self._reader

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        try:
            while line := await process.stdout.readline():
                try:
                    message = server_message_decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    log.warning("fork_server_said_nonsense", line=line[:200])
                    continue
                self._on_message(message)
        except asyncio.CancelledError:  # the agent's loop is going away without `close`
            self._closing = True
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            raise
        await self._on_server_gone(process)

    def _on_message(self, message: ServerReady | Forked | ForkFailed | WorkerExited) -> None:
        match message:
            case ServerReady(pid=pid):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(pid)
                log.info("fork_server_ready", pid=pid)
            case Forked(request_id=request_id, pid=pid):
                worker = self._workers[pid] = ForkedWorker(pid)
                if request_id in self._abandoned:  # its replica was spawned directly meanwhile
                    self._abandoned.discard(request_id)
                    log.warning("late_fork_killed", pid=pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                elif (waiting := self._pending.get(request_id)) is not None and not waiting.done():
                    waiting.set_result(worker)
            case ForkFailed(request_id=request_id, error=error):
                if (waiting := self._pending.get(request_id)) is not None and not waiting.done():
                    waiting.set_exception(ForkServerUnavailable(error))
            case WorkerExited(pid=pid, exit_code=code):
                if (exited := self._workers.pop(pid, None)) is not None:
                    exited.set_exited(code)

    async def _on_server_gone(self, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        gone = ForkServerUnavailable(f"the fork server exited with code {code}")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(gone)
            self._ready.exception()  # retrieved: nobody may be waiting for it
        for waiting in self._pending.values():
            if not waiting.done():
                waiting.set_exception(gone)
        orphans, self._workers = self._workers, {}
        if not self._closing:
            await self._restart_or_give_up(code)
        if orphans:
            log.error("fork_server_died_with_workers", exit_code=code, workers=sorted(orphans))
            await asyncio.gather(*(_kill_orphan(worker) for worker in orphans.values()))

    async def _restart_or_give_up(self, code: int) -> None:
        if self._restarts >= MAX_RESTARTS:
            log.error("fork_server_gone", exit_code=code, detail="workers are spawned directly from now on")
            self._process = None
            return
        self._restarts += 1  # restarted before the orphans' replicas fail: their replacements wait for it
        log.warning("fork_server_restarting", exit_code=code, restart=self._restarts)
        await self.start()
        if self._closing and self._process is not None and self._process.stdin is not None:
            self._process.stdin.close()  # `close` ran meanwhile, on the server that had died


async def _kill_orphan(worker: ForkedWorker) -> None:
    """Kill a worker whose server died (it got SIGTERM from its parent-death signal and may be
    draining), and report it exited once its pid is gone: no agent can hear its status now."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + ORPHAN_EXIT_TIMEOUT_S
    while time.monotonic() < deadline and is_running(worker.pid):
        await asyncio.sleep(0.05)
    worker.set_exited(-signal.SIGKILL)

