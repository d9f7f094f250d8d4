"""Child processes that never outlive their parent (Linux parent-death signal), and whether one runs."""

from __future__ import annotations

import ctypes
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` for a child: SIGTERM it when its parent dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def is_running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (exited, not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
