"""A step's copies back from the host pool, split by layer (docs/sessions.md, "Layer by layer").

A returning turn's CPU chunks must be in the KV pool before its attention reads them, but
only layer l's blocks before layer l's attention. `LayeredSwapIn` copies the step's
(host block, pool block) pairs one layer at a time and is told, just before each layer's
attention, which layer is about to read (`wait`); only the copies that have not finished by
then are exposed, and `get_exposed_seconds` says how long the pass waited for them.

How the layers' copies run (`Mode`):

* ``"inline"``: on the pass's own thread, layer l's copy when layer l asks for it. No
  overlap: the split and its accounting only (the CPU twin's baseline).
* ``"thread"``: on the CPU, one helper thread copies the layers in order from the start of
  the pass while the layers before compute; on CUDA, a side stream copies them, one event
  per layer, and layer l's attention makes the compute stream wait on its event (the host
  never blocks). Only the layers' copies still running when their attention comes are
  exposed: on a GPU, where a layer's compute outlasts its copy, about the first layer's
  (reasoned, not measured: no GPU was at hand when this was written).

What the copies may and may not overlap: the new tokens' K/V writes go to other blocks (a
copied-back block is a full block of past tokens), so a layer's writes may run before its
copy is done; its attention may not. The step's KV pool -> host copies run before (a block
freed by a demotion may be a copy's destination), and nothing of the next step starts
before `finish`.

On the CPU the layers are copied by the native single-pass copy on one thread
(`CpuKernels.copy_blocks_between` with ``num_threads=1``): from inside the native forward
pass the library's threads are the pass's until it ends, and a layer's copy is a small move.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import torch

from shoal.kernels import contract, cpu_kernels, ops, reference
from shoal.services.worker.engine.kv_placement import KVPools

Mode = Literal["inline", "thread"]


class LayeredSwapIn:
    """One step's host -> KV pool copies, layer by layer (see the module doc).

    Args:
        pools: the KV pool of every layer.
        host_cache: the host pool, [num_layers, 2, num_host_blocks, ...].
        pairs: int64 [n, 2] (host block, pool block), on the CPU.
        mode: how the layers' copies run.
        helper: the CPU helper thread (``"thread"`` on CPU pools); on CUDA unused.
    """

    def __init__(
        self,
        pools: KVPools,
        host_cache: torch.Tensor,
        pairs: torch.Tensor,
        mode: Mode,
        helper: ThreadPoolExecutor | None = None,
    ) -> None:
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(host slice, pool slice) of each layer: one-layer pools of the op's layout."""
        for run in pools.runs:
            contract.check_swap_blocks(host_cache[run.first_layer : run.first_layer + 1], run.pool[:1], pairs)
            for index in range(run.num_layers):
                layer = run.first_layer + index
                self._layers.append((host_cache[layer : layer + 1], run.pool[index : index + 1]))
        self._pairs = pairs
        self._mode = mode
        self._on_cuda = any(device.type == "cuda" for device in pools.devices)
        assert mode == "inline" or self._on_cuda or helper is not None, "a CPU thread mode needs its helper"
        self._helper = helper
        self._num_done = 0
        """Layers known to be in (inline: copied; thread: waited for)."""
        self._exposed_seconds = 0.0
        self._futures: list[Future[None]] = []
        self._cuda: _CudaLayers | None = None
        if mode == "thread":
            if self._on_cuda:
                self._cuda = _CudaLayers(self._layers, pairs)
            else:
                assert helper is not None
                self._futures = [helper.submit(self._copy_layer, layer) for layer in range(len(self._layers))]

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def wait(self, layer: int) -> None:
        """Layer `layer`'s blocks (and every layer's before it) are in before anything the
        caller runs next reads them (on CUDA: anything the current stream runs next)."""
        if layer < self._num_done:
            return
        if self._cuda is not None:
            for pending in range(self._num_done, layer + 1):
                self._cuda.wait(pending)
        elif self._futures:
            started = time.perf_counter()
            for future in self._futures[self._num_done : layer + 1]:
                future.result()
            self._exposed_seconds += time.perf_counter() - started
        else:
            started = time.perf_counter()
            for pending in range(self._num_done, layer + 1):
                self._copy_layer(pending)
            self._exposed_seconds += time.perf_counter() - started
        self._num_done = layer + 1

    def finish(self) -> None:
        """Every layer is in (a pass that did not ask for some, or failed, waits here), and
        nothing of the next step can start before the copies end. Raises the first error of
        a helper thread's copies, after waiting for all of them."""
        if self._futures:
            first_error: BaseException | None = None
            started = time.perf_counter()
            for future in self._futures[self._num_done :]:
                error = future.exception()
                first_error = first_error or error
            self._exposed_seconds += time.perf_counter() - started
            self._num_done = len(self._layers)
            if first_error is not None:
                raise first_error
        if self._num_done < len(self._layers):
            self.wait(len(self._layers) - 1)
        if self._cuda is not None:
            self._cuda.finish()

    def get_exposed_seconds(self) -> float:
        """How long the pass waited for the copies (after `finish`; on CUDA, read from the
        compute stream's events, which waits for the pass to get past its last layer)."""
        if self._cuda is not None:
            return self._cuda.get_exposed_seconds()
        return self._exposed_seconds

    def _copy_layer(self, layer: int) -> None:
        host, pool = self._layers[layer]
        if self._on_cuda:
            ops.swap_blocks(host, pool, self._pairs)  # queued on the current stream
            return
        native = cpu_kernels.try_load()
        if native is None or not native.copy_blocks_between(host, pool, self._pairs, num_threads=1):
            reference.swap_blocks_torch(host, pool, self._pairs)


class _CudaLayers:
    """The CUDA side of ``"thread"``: every layer's copy queued at once on a side stream of
    each pool's device, after what its current stream has queued (the step's demotions), an
    event after each; `wait` makes the current stream wait on the layer's event and brackets
    the wait with two timing events on the compute stream, whose gap is the exposed time.
    Nothing here blocks the host."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor) -> None:
        self._ready: list[torch.cuda.Event] = []
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        device_pairs: dict[torch.device, torch.Tensor] = {}
        for host, pool in layers:
            device = pool.device
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    device_pairs[device] = pairs.to(device)
            with torch.cuda.stream(stream):
                ops.swap_blocks(host, pool, device_pairs[device])
                event = torch.cuda.Event(enable_timing=False)
                event.record(stream)
            self._ready.append(event)
        self._devices = [pool.device for _, pool in layers]

    def wait(self, layer: int) -> None:
        stream = torch.cuda.current_stream(self._devices[layer])
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(self._ready[layer])
        after.record(stream)
        self._timings.append((before, after))

    def finish(self) -> None:
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)

    def get_exposed_seconds(self) -> float:
        seconds = 0.0
        for before, after in self._timings:
            after.synchronize()
            seconds += float(before.elapsed_time(after)) / 1000.0
        return seconds

