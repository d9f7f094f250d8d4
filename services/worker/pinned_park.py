"""A CUDA model's weights parked in one page-locked host buffer, and brought back in one copy.

Parking (`park_to_pinned_host`) copies every CUDA parameter and buffer into its slice of one
pinned host allocation (each slice 256-byte aligned) and points the tensor at it. A wake onto
one GPU (`restore_to_device`) allocates one device buffer of the same size, starts one copy
of the whole host buffer into it on a side stream (DMA at the link's speed), and points each
tensor at its slice there: one allocation and one transfer, where ``Module.to`` makes one
allocation and one synchronous copy per tensor. The caller builds the engine while the copy
runs and then joins it (`WeightsTransfer.join`): the device's stream waits for the copy, the
host does not. The pinned memory is given back a few seconds after the wake
(`release_pinned_host_cache_later`), not during it. A model spread over several GPUs is moved
tensor by tensor by accelerate's dispatch instead (from the same pinned slices).

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
    strides: tuple[int, ...]
    """Contiguous, in elements."""


class SlotViews:
    """Each slot's tensor view of one uint8 buffer laid out by `lay_out` (pinned host memory, or
    its copy on a device): one ``as_strided`` per slot (a slice and two views cost three:
    0.25 ms against 1.1 ms for llama-100m's 113 tensors on the development CPU)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer seen as each dtype

    def __call__(self, slot: _Slot) -> torch.Tensor:
        flat = self._typed.get(slot.dtype)
        if flat is None:
            flat = self._typed[slot.dtype] = self._buffer.view(slot.dtype)
        return flat.as_strided(slot.shape, slot.strides, slot.offset // slot.dtype.itemsize)


@dataclass
class PinnedWeights:
    """What `restore_to_device` needs: the pinned buffer and where each tensor lies in it."""

    host: torch.Tensor
    """uint8, page-locked."""
    slots: list[_Slot]
    holds_every_tensor: bool
    """Every parameter and buffer of the model was on CUDA when parked and is in `slots` (not
    so after a cold sleep dropped the parameters)."""


def lay_out(tensors: list[torch.Tensor]) -> tuple[list[_Slot], int]:
    """Each tensor's slice of one buffer (256-byte aligned), and the buffer's size in bytes."""
    slots, offset = [], 0
    for tensor in tensors:
        num_bytes = tensor.numel() * tensor.element_size()
        slots.append(_Slot(tensor, offset, num_bytes, tensor.shape, tensor.dtype, _contiguous_strides(tensor.shape)))
        offset += -(-num_bytes // _ALIGN_BYTES) * _ALIGN_BYTES
    return slots, offset


def park_to_pinned_host(model: torch.nn.Module) -> PinnedWeights | None:
    """Every CUDA parameter and buffer of `model` to host memory: one pinned buffer (returned),
    or ordinary pages where pinning is refused (None)."""
    every_tensor = [*model.parameters(), *model.buffers()]
    tensors = [t for t in every_tensor if t.device.type == "cuda"]
    slots, offset = lay_out(tensors)
    try:
        host = torch.empty(offset, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        log.warning("park_not_pinned", error=str(exc), num_bytes=offset)
        with torch.no_grad():
            for tensor in tensors:
                tensor.data = tensor.data.to("cpu")
        return None
    views = SlotViews(host)
    with torch.no_grad():
        for slot in slots:
            view = views(slot)
            view.copy_(slot.tensor, non_blocking=True)
            slot.tensor.data = view
    torch.cuda.synchronize()
    return PinnedWeights(host, slots, holds_every_tensor=len(tensors) == len(every_tensor))


@dataclass
class WeightsTransfer:
    """A restore's copy onto the GPU, running on a side stream (`restore_to_device`)."""

    done: torch.cuda.Event
    """Recorded on the side stream after the copy."""
    device: torch.device
    complete: bool
    """Every tensor of the model is now on the device; False when some were not parked on the
    host buffer or are no longer there (a cold sleep dropped and reloaded the parameters):
    those still have to be moved."""

    def join(self) -> None:
        """Queues whatever the device's current stream runs from now on after the copy (the
        host does not wait). Call it before anything reads the weights; calling it again is
        harmless."""
        torch.cuda.current_stream(self.device).wait_event(self.done)


def point_at(parked: PinnedWeights, buffer: torch.Tensor) -> bool:
    """Points every parked tensor still on the host buffer at its slice of `buffer` (uint8,
    laid out as the host buffer, on any device). Returns whether every tensor of the model
    now lies in `buffer` (see `WeightsTransfer.complete`)."""
    host_address = parked.host.data_ptr()
    views = SlotViews(buffer)
    complete = parked.holds_every_tensor
    with torch.no_grad():
        for slot in parked.slots:
            if slot.tensor.data_ptr() != host_address + slot.offset:
                complete = False
                continue
            slot.tensor.data = views(slot)
    return complete


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def restore_to_device(parked: PinnedWeights, device: torch.device) -> WeightsTransfer:
    """Starts the copy of the parked tensors onto `device` and points them at their slices
    there (see the module doc); the copy is not waited for: `WeightsTransfer.join` it. Tensors
    no longer on the host buffer (a cold sleep reloaded them from the file) are left alone."""
    target = torch.empty(parked.host.numel(), dtype=torch.uint8, device=device)
    # On a side stream: a synchronizing call on the device's own stream while the engine is
    # built (a copy from pageable memory, say) does not wait for the weights. The side stream
    # first waits for the current one, which last used `target`'s memory. Torch's pinned
    # allocator keeps the host buffer until the copy's event has completed, whatever
    # happens to `parked`.
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        target.copy_(parked.host, non_blocking=True)
        target.record_stream(side)  # never reused before the copy ends, joined or not
        done = torch.cuda.Event()
        done.record(side)
    complete = point_at(parked, target)
    return WeightsTransfer(done, device, complete)


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
