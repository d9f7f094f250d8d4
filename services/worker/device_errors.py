"""Which errors of a forward pass leave the GPU unusable to the process that got them.

A CUDA error of the "sticky" kind (a device-side assert, an illegal memory access, a
failed launch) poisons the process's CUDA context: every later CUDA call fails with the
same error, so an engine that caught it and kept serving would fail every request after
it. Such an error ends the worker (`generation.EngineFailed`, `service.WorkerService`):
its requests go back to the queue for their next attempt, and its node agent starts a
new worker (`WORKER_EXIT_DEVICE_ERROR`). Other errors (out of memory, a bad argument,
a bug in Python) fail only the pass's requests, and the engine serves on.
"""

from __future__ import annotations

import torch

STICKY_CUDA_ERRORS = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction was encountered",
    "uncorrectable ECC error",
    "hardware stack error",
    "the launch timed out and was terminated",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUDA error: unknown error",
)
"""Fragments of the messages of the CUDA errors that poison a context (cudaErrorAssert,
cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorMisalignedAddress,
cudaErrorIllegalInstruction, cudaErrorECCUncorrectable, cudaErrorHardwareStackError,
cudaErrorLaunchTimeout; cuBLAS's report of a kernel that failed; an unknown error),
as torch formats them."""


def is_fatal_device_error(exc: BaseException) -> bool:
    """Whether `exc` (or an error it was raised from) is a CUDA error that poisons the context.

    Out-of-memory errors are not: the allocator recovers once the pass's tensors are freed.
    """
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.OutOfMemoryError):
            return False
        message = str(error)
        if any(fragment in message for fragment in STICKY_CUDA_ERRORS):
            return True
        error = error.__cause__ or error.__context__
    return False
