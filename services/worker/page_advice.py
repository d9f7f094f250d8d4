"""``madvise`` on a tensor's memory, through libc (Linux): huge pages for packed weights
(`engine.packed_load.allocate_weights`), pages given back for a cold sleep (`weight_drop`)."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import torch

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
PAGE_BYTES = 4096

_libc: Any = None


def _get_libc() -> Any:
    """libc with ``madvise`` bound, or False where there is none (loaded once)."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name, use_errno=True) if name else False
        if _libc:
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
    return _libc


def can_advise() -> bool:
    """Whether ``madvise`` can be called here."""
    return bool(_get_libc())


def advise(address: int, num_bytes: int, advice: int) -> None:
    """``madvise(address, num_bytes, advice)``; nothing where there is no libc. A refusal by
    the kernel is not raised: huge pages are a hint, and dropped pages are re-read anyway."""
    libc = _get_libc()
    if libc and num_bytes > 0:
        libc.madvise(address, num_bytes, advice)


def release_pages(tensor: torch.Tensor) -> None:
    """Gives the whole pages inside `tensor`'s bytes back to the kernel (they read as zeros)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // PAGE_BYTES) * PAGE_BYTES
    last = end // PAGE_BYTES * PAGE_BYTES
    advise(first, last - first, MADV_DONTNEED)
