"""A node's worker logs stay bounded (services/node_agent/worker_logs.py)."""

from __future__ import annotations

import os
from pathlib import Path

from shoal.services.node_agent.worker_logs import tidy_worker_logs


def _log(directory: Path, name: str, size: int, mtime: float) -> Path:
    path = directory / name
    path.write_bytes(b"x" * size)
    os.utime(path, (mtime, mtime))
    return path


def test_a_running_workers_large_log_is_copied_aside_and_truncated_and_appends_go_on(tmp_path: Path) -> None:
    big = _log(tmp_path, "r1.log", 300, 1.0)
    small = _log(tmp_path, "r2.log", 50, 1.0)
    with open(big, "ab") as appending:  # as the worker holds it
        result = tidy_worker_logs(tmp_path, {"r1", "r2"}, max_log_bytes=100)
        appending.write(b"next line\n")
    assert result.rotated == ("r1",) and result.deleted == ()
    assert (tmp_path / "r1.log.1").read_bytes() == b"x" * 300
    assert big.read_bytes() == b"next line\n", "the append lands at the new end, no hole before it"
    assert small.stat().st_size == 50


def test_only_the_newest_logs_of_stopped_replicas_are_kept(tmp_path: Path) -> None:
    for index in range(5):
        _log(tmp_path, f"old{index}.log", 10, 100.0 + index)
    _log(tmp_path, "old0.log.1", 10, 1.0)
    _log(tmp_path, "running.log", 10, 1.0)
    _log(tmp_path, "forkserver.log", 10, 1.0)
    result = tidy_worker_logs(tmp_path, {"running"}, keep_stopped=2)
    assert result.deleted == ("old0", "old1", "old2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forkserver.log", "old3.log", "old4.log", "running.log"]
