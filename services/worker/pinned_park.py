"""A CUDA model's weights parked in one page-locked host buffer, and brought back in one copy.

Parking (`park_to_pinned_host`) copies every CUDA parameter and buffer into its slice of one
pinned host allocation (each slice 256-byte aligned) and points the tensor at it. A wake onto
one GPU (`restore_to_device`) allocates one device buffer of the same size, copies the whole
host buffer into it by DMA at the link's speed, and points each tensor at its slice there:
one allocation and one transfer, where ``Module.to`` makes one allocation and one
synchronous copy per tensor. The pinned memory is given back a few seconds after the wake
(`release_pinned_host_cache_later`), not during it. A model spread over several GPUs is moved tensor by tensor by
accelerate's dispatch instead (from the same pinned slices).

Where the host refuses to lock that much memory (RLIMIT_MEMLOCK, a sandbox) the weights go
to ordinary pages, as ``Module.to("cpu")`` does, and `park_to_pinned_host` returns None.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import structlog
import torch

log = structlog.get_logger(__name__)

_ALIGN_BYTES = 256


@dataclass
class _Slot:
    tensor: torch.Tensor
    """The parameter or buffer (its ``.data`` is repointed)."""
    offset: int
    num_bytes: int
    shape: torch.Size
    dtype: torch.dtype

    def view_of(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset : self.offset + self.num_bytes].view(self.dtype).view(self.shape)


@dataclass
class PinnedWeights:
    """What `restore_to_device` needs: the pinned buffer and where each tensor lies in it."""

    host: torch.Tensor
    """uint8, page-locked."""
    slots: list[_Slot]


def park_to_pinned_host(model: torch.nn.Module) -> PinnedWeights | None:
    """Every CUDA parameter and buffer of `model` to host memory: one pinned buffer (returned),
    or ordinary pages where pinning is refused (None)."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cuda"]
    slots, offset = [], 0
    for tensor in tensors:
        num_bytes = tensor.numel() * tensor.element_size()
        slots.append(_Slot(tensor, offset, num_bytes, tensor.shape, tensor.dtype))
        offset += -(-num_bytes // _ALIGN_BYTES) * _ALIGN_BYTES
    try:
        host = torch.empty(offset, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        log.warning("park_not_pinned", error=str(exc), num_bytes=offset)
        with torch.no_grad():
            for tensor in tensors:
                tensor.data = tensor.data.to("cpu")
        return None
    with torch.no_grad():
        for slot in slots:
            view = slot.view_of(host)
            view.copy_(slot.tensor, non_blocking=True)
            slot.tensor.data = view
    torch.cuda.synchronize()
    return PinnedWeights(host, slots)


def restore_to_device(parked: PinnedWeights, device: torch.device) -> None:
    """The parked tensors onto `device` in one transfer (see the module doc). Tensors that are
    no longer on the host buffer (a cold sleep reloaded them from the file) are left alone."""
    target = torch.empty(parked.host.numel(), dtype=torch.uint8, device=device)
    # Not waited for: the engine is built while the transfer runs, and every kernel that reads
    # the weights is queued after it on this stream. Torch's pinned allocator keeps the host
    # buffer until the copy's event has completed, whatever happens to `parked`.
    target.copy_(parked.host, non_blocking=True)
    with torch.no_grad():
        for slot in parked.slots:
            if slot.tensor.data_ptr() == slot.view_of(parked.host).data_ptr():
                slot.tensor.data = slot.view_of(target)


def release_pinned_host_cache() -> None:
    """Gives back the page-locked host memory torch keeps cached once the weights are on the
    GPU again (its caching host allocator would hold a parked model's size of RAM for ever)."""
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        empty_host_cache()


UNPIN_DELAY_S = 5.0
"""How long after a wake the pinned host memory is given back. Unpinning a few hundred MiB
takes ~50 ms and holds up the process's other CUDA calls meanwhile (measured on an H200:
docs/benchmarks.md): done during the wake it doubles the wake; done a few seconds later it
is one short stall while serving, and a park within that time reuses the cached buffer."""


def release_pinned_host_cache_later(delay_s: float = UNPIN_DELAY_S) -> threading.Timer:
    """`release_pinned_host_cache` on a timer thread, `delay_s` from now (see `UNPIN_DELAY_S`)."""
    timer = threading.Timer(delay_s, release_pinned_host_cache)
    timer.name, timer.daemon = "shoal-unpin", True
    timer.start()
    return timer
