"""Where each layer's KV lives: on its layer's device.

A replica spread over several GPUs (placement gives it ``ceil(size / gpu) + 1`` of them,
accelerate dispatches its layers over them) must keep each layer's K/V on the device that
runs the layer: the kernels take tensors of one device only. The pool is therefore one
tensor per run of consecutive layers on one device, ``[run_layers, 2, num_blocks, ...]``
(the layout of `shoal.kernels.ops`), with the same block ids in every run: a block is a
slot range in every layer, as with one tensor. Block copies and swaps run once per run;
the host pool of the session cache stays one tensor, whose layer slice for a run is a
contiguous pool of the same layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.kernels import ops
from shoal.services.worker.page_advice import release_pages

Allocate = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def get_layer_devices(model: Any) -> list[torch.device]:
    """The device of each decoder layer's attention weights, in layer order (modules with a
    ``layer_idx``, as transformers' attention modules have); the model's first parameter's
    device for a layer where none is found."""
    num_layers = model.config.num_hidden_layers
    found: list[torch.device | None] = [None] * num_layers
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and 0 <= index < num_layers and found[index] is None:
            parameter = next(module.parameters(), None)
            if parameter is not None:
                found[index] = parameter.device
    fallback = next(model.parameters()).device
    return [device or fallback for device in found]


@dataclass(frozen=True)
class LayerRun:
    """Consecutive layers on one device and their pool."""

    first_layer: int
    num_layers: int
    device: torch.device
    pool: torch.Tensor
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; empty while released
    (`KVPools.release`) on CUDA."""


class KVPools:
    """The KV pool of every layer, on the layers' devices (see the module doc).

    Args:
        layer_devices: each layer's device (`get_layer_devices`, or injected by tests: the
            runs are split wherever the device changes, by its label, so ``cpu:0`` and
            ``cpu:1`` are two runs of CPU tensors).
        block_shape: (num_blocks, block_size, num_kv_heads, head_dim).
        allocate: makes a zeroed tensor of a shape and dtype on a device.
    """

    def __init__(
        self,
        layer_devices: Sequence[torch.device],
        block_shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        allocate: Allocate,
    ) -> None:
        self._block_shape = block_shape
        self._dtype = dtype
        self._allocate = allocate
        runs: list[LayerRun] = []
        first = 0
        for layer in range(1, len(layer_devices) + 1):
            if layer == len(layer_devices) or layer_devices[layer] != layer_devices[first]:
                runs.append(self._make_run(first, layer - first, layer_devices[first]))
                first = layer
        self.runs = tuple(runs)
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(key_cache, value_cache) of each layer, views into its run's pool (one list for
        the pools' life: `release` and `restore` refill it in place)."""
        self._set_layer_caches()
        self.devices = tuple(dict.fromkeys(run.device for run in runs))
        self.layer_devices = tuple(layer_devices)
        """Each layer's device, as given (labels included)."""
        self.nbytes = sum(run.pool.numel() * run.pool.element_size() for run in self.runs)
        """Bytes of every run's pool (held again after `restore`)."""

    def _make_run(self, first_layer: int, num_layers: int, device: torch.device) -> LayerRun:
        pool = self._allocate((num_layers, 2, *self._block_shape), self._dtype, device)
        return LayerRun(first_layer, num_layers, device, pool)

    def _set_layer_caches(self) -> None:
        self.layer_caches[:] = [(run.pool[i, 0], run.pool[i, 1]) for run in self.runs for i in range(run.num_layers)]

    def release(self) -> None:
        """Gives the pools' memory back (a park; nothing may run on them until `restore`).
        A CPU pool keeps its address and its views (the native forward holds them) and gives
        its pages back: they read as zeros again. A CUDA pool is dropped, and with it every
        layer's views until `restore`."""
        for run in self.runs:
            if run.device.type == "cpu":
                release_pages(run.pool)
        if any(run.device.type != "cpu" for run in self.runs):
            self.layer_caches.clear()
            self.runs = tuple(
                run if run.device.type == "cpu" else dataclasses.replace(run, pool=torch.empty(0, dtype=self._dtype))
                for run in self.runs
            )

    def restore(self) -> None:
        """Zeroed pools again after `release`, of the same shapes, on the same devices."""
        if self.layer_caches:
            return  # CPU pools only: their pages come back as they are written
        self.runs = tuple(
            run if run.device.type == "cpu" else self._make_run(run.first_layer, run.num_layers, run.device)
            for run in self.runs
        )
        self._set_layer_caches()

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """`ops.copy_blocks` on every run (every layer, K and V)."""
        for run in self.runs:
            ops.copy_blocks(run.pool, pairs)

    def swap_out(self, host_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        """(pool block, host block) pairs: pool -> host, every run into its layers' slice."""
        for run in self.runs:
            ops.swap_blocks(run.pool, host_cache[run.first_layer : run.first_layer + run.num_layers], pairs)

    def swap_in(self, host_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        """(host block, pool block) pairs: host -> pool, every run from its layers' slice."""
        for run in self.runs:
            ops.swap_blocks(host_cache[run.first_layer : run.first_layer + run.num_layers], run.pool, pairs)

    def zero_blocks(self, block_ids: torch.Tensor) -> None:
        """Zero `block_ids` (int64) in every layer, K and V (a pool handed back as fresh)."""
        for run in self.runs:
            run.pool.index_fill_(2, block_ids.to(run.pool.device), 0)
