"""Builds and loads Shoal's CUDA kernels (kernels/csrc) on first use.

The extension is compiled with `torch.utils.cpp_extension.load` (ninja, the
machine's nvcc, the arch of the visible GPUs or ``TORCH_CUDA_ARCH_LIST``) the
first time a KV op sees a CUDA tensor, and cached by torch under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``). Nothing is
attempted where CUDA is unavailable.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import ModuleType

import torch

from shoal.shared.errors import ShoalError

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bindings.cpp", "cache_ops.cu", "paged_attention.cu", "layer_ops.cu")
EXTENSION_NAME = "shoal_kv_ops"


class KernelBuildError(ShoalError, RuntimeError):
    """Shoal's CUDA kernels could not be built or loaded on this machine."""


_lock = threading.Lock()
_extension: ModuleType | None = None
_failure: KernelBuildError | None = None


def load_extension() -> ModuleType:
    """Returns the compiled extension, building it on the first call.

    A failed build is remembered: later calls raise the same error at once
    instead of recompiling.

    Returns:
        The module with ``write_kv``, ``paged_attention``, ``copy_blocks``,
        ``swap_blocks``, ``rms_norm``, ``rotary_embedding`` and ``silu_mul`` (see
        kernels/csrc/bindings.cpp).

    Raises:
        KernelBuildError: CUDA is unavailable, or compiling or loading failed.
    """
    global _extension, _failure
    with _lock:
        if _extension is not None:
            return _extension
        if _failure is not None:
            raise _failure
        if not torch.cuda.is_available():
            raise KernelBuildError("CUDA is not available: Shoal's KV kernels need a CUDA device")
        from torch.utils import cpp_extension

        try:
            _extension = cpp_extension.load(
                name=EXTENSION_NAME,
                sources=[str(CSRC_DIR / source) for source in SOURCES],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo"],
                verbose=False,
            )
        except Exception as error:  # compiler, linker and import failures all mean "no kernels"
            _failure = KernelBuildError(
                f"building Shoal's CUDA kernels from {CSRC_DIR} failed: {error}. "
                "Check nvcc (CUDA_HOME) matches torch's CUDA version; run scripts/check_kernels.sh for the "
                'compiler output, or set cuda = "reference" under [worker.kernels] '
                "(SHOAL_WORKER_KERNELS_CUDA=reference) to use the torch implementation."
            )
            raise _failure from error
        return _extension
