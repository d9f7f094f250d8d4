"""Keeping a node's worker logs from filling its disk.

Each worker writes ``<log_dir>/<replica_id>.log`` (opened for appending by the agent or the fork
server), and a worker logs a line per request. A running worker's log past `MAX_LOG_BYTES` is
copied to ``<replica_id>.log.1`` (replacing the copy before) and truncated in place: the worker's
appends land at the new end, as logrotate's ``copytruncate`` does. The logs of replicas that run
here no more are kept for the newest `KEEP_STOPPED` of them (a failure's tail is read from its
log; `shoal status` names it), the rest deleted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

MAX_LOG_BYTES = 64 << 20
KEEP_STOPPED = 100
NOT_WORKER_LOGS = frozenset({"forkserver.log"})


@dataclass(frozen=True)
class TidyResult:
    rotated: tuple[str, ...] = ()
    """Replica ids whose log was copied aside and truncated."""
    deleted: tuple[str, ...] = ()
    """Replica ids whose logs were deleted."""


def tidy_worker_logs(log_dir: Path, running: Collection[str], *, max_log_bytes: int = MAX_LOG_BYTES,
                     keep_stopped: int = KEEP_STOPPED) -> TidyResult:
    """Rotate the large logs of `running` replicas and delete the logs of stopped ones beyond the
    newest `keep_stopped` (see the module doc). Files that vanish meanwhile are skipped."""
    rotated: list[str] = []
    stopped: list[tuple[float, str]] = []
    for path in log_dir.glob("*.log"):
        if path.name in NOT_WORKER_LOGS:
            continue
        replica_id = path.name.removesuffix(".log")
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        if replica_id not in running:
            stopped.append((stat.st_mtime, replica_id))
        elif stat.st_size > max_log_bytes:
            with contextlib.suppress(FileNotFoundError):
                shutil.copyfile(path, log_dir / f"{replica_id}.log.1")
                os.truncate(path, 0)
                rotated.append(replica_id)
    stopped.sort(reverse=True)
    deleted = [replica_id for _, replica_id in stopped[keep_stopped:]]
    for replica_id in deleted:
        for name in (f"{replica_id}.log", f"{replica_id}.log.1"):
            with contextlib.suppress(FileNotFoundError):
                (log_dir / name).unlink()
    return TidyResult(tuple(sorted(rotated)), tuple(sorted(deleted)))
