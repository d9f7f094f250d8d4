"""The worker fork server: imports a worker's libraries (torch, transformers, the engine) once,
then starts each replica's worker as a fork of itself, so a worker begins loading its model at
once instead of after seconds of imports (docs/architecture.md, "Worker processes").

A node agent starts it (``python -m shoal.services.worker.forkserver``) with the environment
it gives its workers and talks to it over stdin/stdout (`forkserver_messages`). It never
initialises CUDA nor runs a torch operation, so a fork copies no CUDA context and no started
thread pool. Each child:

- has its own process group (the agent stops it with ``killpg``; the server's session has no
  terminal) and dies with the server, which dies with its agent (parent-death signals);
- holds none of the server's pipes: stdin is /dev/null, stdout and stderr its log file;
- reseeds torch's random generator (each would otherwise continue the server's state: every
  worker the same "random" samples);
- runs its launch (`run_launch`) and exits with its status.

The server reaps its children and reports each exit status; it exits when its stdin closes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import selectors
import signal
import sys
import time
import traceback

import msgspec
import setproctitle

from shoal.services.worker.forkserver_messages import (
    Fork,
    Forked,
    ForkFailed,
    ServerReady,
    WorkerExited,
    encode_line,
    request_decoder,
)
from shoal.services.worker.launch import WorkerLaunch, decode_launch
from shoal.shared.child_process import die_with_parent

# torch, transformers and the worker are imported by `main`, once its replies have their own fd.


class ForkServer:
    def __init__(self, requests_fd: int, replies_fd: int) -> None:
        self._requests_fd = requests_fd
        self._replies_fd = replies_fd
        self._wake_r, self._wake_w = os.pipe()
        self._pid = os.getpid()
        self._selector = selectors.DefaultSelector()

    def serve(self) -> int:
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd is what wakes the loop
        gc.collect()
        gc.freeze()  # the imported modules' objects stay shared with every child (no GC writes to them)
        self._send(ServerReady(self._pid))
        self._selector.register(self._requests_fd, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        pending = b""
        while True:
            for key, _ in self._selector.select():
                if key.fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    self._reap()
                    continue
                chunk = os.read(self._requests_fd, 65536)
                if not chunk:
                    return 0  # the agent is gone or done: our children die with us
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._on_request(line)

    def _on_request(self, line: bytes) -> None:
        try:
            request = request_decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            print(f"forkserver: a request that is not a Fork was ignored: {exc}", file=sys.stderr, flush=True)
            return
        import torch

        try:
            launch = decode_launch(request.launch)
            if torch.cuda.is_initialized():
                raise RuntimeError("CUDA is initialised in the fork server: no fork of it could use CUDA")
            pid = os.fork()
        except (ValueError, RuntimeError, OSError) as exc:
            self._send(ForkFailed(request.request_id, str(exc)))
            return
        if pid == 0:
            code = 1
            try:
                code = self._run_child(request, launch)
            finally:
                os._exit(code)  # whatever happened, the child never returns into the server's loop
        with contextlib.suppress(OSError):  # the child may have done it (or exited) already
            os.setpgid(pid, pid)  # set on both sides: a killpg right after `Forked` reaches it
        self._send(Forked(request.request_id, pid))

    def _run_child(self, request: Fork, launch: WorkerLaunch) -> int:
        from shoal.services.worker.main import run_launch

        try:
            os.setpgid(0, 0)
            die_with_parent()
            if os.getppid() != self._pid:
                return 1  # the server died before the parent-death signal was set
            signal.set_wakeup_fd(-1)
            self._selector.close()
            for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
                signal.signal(number, signal.SIG_DFL)
            self._take_own_files(request.log_path)
            setproctitle.setproctitle(request.title)
            reseed_after_fork()
            return run_launch(launch)
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                return exc.code or 0
            print(exc.code, file=sys.stderr)
            return 1
        except BaseException:  # the child's last word goes to its log
            traceback.print_exc()
            return 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()

    def _take_own_files(self, log_path: str) -> None:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        for fd in {log_fd, null_fd, self._wake_r, self._wake_w, self._requests_fd, self._replies_fd} - {0, 1, 2}:
            os.close(fd)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._send(WorkerExited(pid, os.waitstatus_to_exitcode(status)))

    def _send(self, message: msgspec.Struct) -> None:
        line = memoryview(encode_line(message))
        while line:
            line = line[os.write(self._replies_fd, line):]


def reseed_after_fork() -> None:
    """A fresh seed for torch's generator, which a fork continues from its parent's state
    (Python's `random` reseeds itself in a forked child)."""
    import torch

    torch.seed()


def main() -> int:
    sys.stdout.flush()
    replies_fd = os.dup(sys.stdout.fileno())  # the replies' own fd: a stray print on stdout cannot corrupt them
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    started = time.monotonic()
    import shoal.services.worker.main  # noqa: F401 - what every fork inherits imported
    print(f"forkserver: ready, pid {os.getpid()}, imports took {time.monotonic() - started:.1f}s",
          file=sys.stderr, flush=True)
    return ForkServer(sys.stdin.fileno(), replies_fd).serve()


if __name__ == "__main__":
    sys.exit(main())
