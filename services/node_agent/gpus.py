"""Finding a node's GPUs (NVML, or virtual) and measuring a worker's real GPU memory."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import structlog

from shoal.shared.config import parse_gpu_spec
from shoal.shared.errors import ShoalError
from shoal.shared.messages import GpuInfo

log = structlog.get_logger(__name__)


class GpuDiscoveryError(ShoalError, RuntimeError):
    """NVML was asked for but is not usable on this machine."""


@dataclass(frozen=True)
class NodeGpus:
    gpus: list[GpuInfo]
    virtual: bool

    @property
    def device(self) -> str:
        """The torch device workers use: ``cpu`` for virtual GPUs."""
        return "cpu" if self.virtual else "cuda"


def discover_gpus(spec: str) -> NodeGpus:
    """``virtual:2x16GiB`` -> two 16 GiB virtual GPUs; ``nvml`` -> the machine's NVIDIA GPUs."""
    kind, count, size_bytes = parse_gpu_spec(spec)
    if kind == "virtual":
        gpus = [GpuInfo(index=i, total_bytes=size_bytes, name="virtual", virtual=True) for i in range(count)]
        return NodeGpus(gpus, virtual=True)
    return NodeGpus(_nvml_gpus(), virtual=False)


def _nvml_gpus() -> list[GpuInfo]:
    try:
        import pynvml
    except ImportError as exc:
        raise GpuDiscoveryError("nvidia-ml-py is not installed") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise GpuDiscoveryError(
            f"NVML is not available ({exc}); on a machine without NVIDIA GPUs use --gpus virtual:<count>x<size>"
        ) from exc
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        gpus.append(GpuInfo(index=index, total_bytes=int(total), name=str(name), virtual=False))
    if not gpus:
        raise GpuDiscoveryError("NVML found no GPUs")
    return gpus


def nvml_process_bytes(pid: int, gpu_indices: Iterable[int] | None = None) -> int | None:
    """GPU memory `pid` holds, summed over `gpu_indices` (default: every GPU), per NVML;
    None when NVML cannot tell.

    Counting only the replica's own GPUs leaves out the CUDA context a restored worker may
    still keep on the GPU it ran on before it was parked."""
    try:
        import pynvml

        pynvml.nvmlInit()
        total = 0
        indices = range(pynvml.nvmlDeviceGetCount()) if gpu_indices is None else sorted(gpu_indices)
        for index in indices:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory:
                    total += int(proc.usedGpuMemory)
        return total
    except Exception as exc:  # NVML raises its own error types per call; any of them means "unknown"
        log.warning("nvml_measure_failed", pid=pid, error=str(exc))
        return None


def host_ram_bytes() -> int:
    """Total physical memory of this machine."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
