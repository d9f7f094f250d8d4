"""A forward pass's attention metadata on the kernels' path (CUDA; on the CPU when the engine
is told to take it): decode rows on the paged kernel, prefill rows on SDPA, index tensors on
every device that holds a layer, uploaded through pinned staging buffers.

* **Decode on the paged kernel, prefill on SDPA.** The runner lays decode rows out first;
  they go to `ops.paged_attention` with index tensors of the decode sequences only. Each
  prefill sequence (several query rows: a fresh prompt, a chunk of one, a prompt over a
  cached prefix) runs PyTorch's `scaled_dot_product_attention` (FlashAttention or the
  memory-efficient kernel on CUDA: tensor cores, K/V read once per sequence instead of once
  per row), over the pass's own K/V rows for a fresh prompt or over its blocks gathered
  once (prefix plus new rows, causal aligned bottom-right) otherwise.
* **Per-device indexes.** A replica spread over several GPUs has each layer's KV pool on its
  layer's device (`kv_placement`); the kernels refuse tensors of two devices, so every
  device gets its own copy of the pass's index tensors, uploaded once per pass, not per layer.
* **Pinned staging.** On CUDA the pass's index lists are written into pinned host buffers
  and copied with ``non_blocking=True`` (no synchronizing upload per tensor); two buffer
  sets alternate, and a set is rewritten only once the copies that last read it are done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from shoal.kernels import ops


@dataclass(frozen=True)
class DeviceIndexes:
    """One device's copy of a pass's index tensors."""

    slot_mapping: torch.Tensor
    """int64 [num_tokens]: every row's slot."""
    block_tables: torch.Tensor
    """int32 [num_decode_seqs, max_blocks]: the decode sequences' blocks."""
    seq_lens: torch.Tensor
    """int32 [num_decode_seqs]."""
    query_start_loc: torch.Tensor
    """int32 [num_decode_seqs + 1]: 0, 1, ..., num_decode_seqs."""
    prefill_block_ids: tuple[torch.Tensor | None, ...]
    """int64 blocks of each prefill sequence whose K/V is gathered (None: a fresh prompt)."""


@dataclass(frozen=True)
class PrefillSpan:
    """A sequence with several query rows: the last `num_queries` of its `seq_len` positions."""

    start: int
    num_queries: int
    seq_len: int


@dataclass(frozen=True)
class DeviceBatch:
    """The kernels' path of one pass (see the module doc)."""

    num_decode_rows: int
    """Rows 0 .. num_decode_rows - 1 decode; the prefill spans follow."""
    prefills: tuple[PrefillSpan, ...]
    indexes: dict[torch.device, DeviceIndexes]
    layer_devices: tuple[torch.device, ...]
    """Each layer's KV device (the key of its indexes)."""

    def on(self, device: torch.device) -> DeviceIndexes:
        return self.indexes[device]

    def for_layer(self, layer: int) -> DeviceIndexes:
        return self.indexes[self.layer_devices[layer]]


class StagingBuffers:
    """Uploads of a pass's int lists to its devices: through pinned host buffers and
    non-blocking copies on CUDA, plain tensors on the CPU. Buffers grow to the largest pass
    seen; two sets alternate, each waited on (an event after its copies) before reuse."""

    NUM_SETS = 2

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._host: list[dict[str, torch.Tensor]] = [{} for _ in range(self.NUM_SETS)]
        self._done: list[list[torch.cuda.Event]] = [[] for _ in range(self.NUM_SETS)]
        self._devices: dict[torch.device, None] = {}
        """The CUDA devices the current set was copied to."""
        self._current = 0

    def begin_pass(self) -> None:
        """Switch to the next buffer set; wait until the copies that last read it are done."""
        self._current = (self._current + 1) % self.NUM_SETS
        for event in self._done[self._current]:
            event.synchronize()
        self._done[self._current] = []
        self._devices = {}

    def end_pass(self) -> None:
        """Mark the current set busy until the copies issued so far are done: an event on the
        current stream of every device it was copied to."""
        events = []
        for device in self._devices:
            with torch.cuda.device(device):
                event = torch.cuda.Event()
                event.record()
                events.append(event)
        self._done[self._current] = events

    def stage(self, name: str, values: Sequence[int] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`values` as a host tensor (a view of the current set's pinned buffer on CUDA)."""
        source = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if not self.pinned:
            return source
        buffers = self._host[self._current]
        buffer = buffers.get(name)
        num_elements = source.numel()
        if buffer is None or buffer.numel() < num_elements or buffer.dtype != dtype:
            buffer = torch.empty(max(num_elements, 2 * (0 if buffer is None else buffer.numel()), 64),
                                 dtype=dtype, pin_memory=True)
            buffers[name] = buffer
        staged = buffer[:num_elements].view(source.shape)
        staged.copy_(source)
        return staged

    def upload(self, staged: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A device copy of a staged tensor (the tensor itself on the CPU)."""
        if device.type == "cpu":
            return staged
        if self.pinned and device.type == "cuda":
            self._devices[device] = None
        return staged.to(device, non_blocking=self.pinned)


def build_device_batch(
    staging: StagingBuffers,
    layer_devices: Sequence[torch.device],
    slot_mapping: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_start_loc: Sequence[int],
) -> DeviceBatch:
    """The kernels' path of a pass whose sequences come decode rows first.

    Args:
        staging: where the lists go before the devices (its pass must have begun).
        layer_devices: each layer's KV device: every distinct one gets its index tensors.
        slot_mapping, block_tables, seq_lens, query_start_loc: the pass as `ModelRunner`
            lays it out: every sequence with one query row before any with more.
    """
    num_seqs = len(seq_lens)
    num_decode = 0
    while num_decode < num_seqs and query_start_loc[num_decode + 1] - query_start_loc[num_decode] == 1:
        num_decode += 1
    width = max((len(table) for table in block_tables[:num_decode]), default=0)
    padded = [list(table) + [0] * (width - len(table)) for table in block_tables[:num_decode]]
    staged_slots = staging.stage("slot_mapping", slot_mapping, torch.int64)
    staged_tables = staging.stage("block_tables", torch.tensor(padded, dtype=torch.int32).view(num_decode, width),
                                  torch.int32)
    staged_lens = staging.stage("seq_lens", seq_lens[:num_decode], torch.int32)
    staged_starts = staging.stage("query_start_loc", range(num_decode + 1), torch.int32)
    prefills: list[PrefillSpan] = []
    staged_blocks: list[torch.Tensor | None] = []
    for seq in range(num_decode, num_seqs):
        num_queries = query_start_loc[seq + 1] - query_start_loc[seq]
        assert num_queries != 1, "decode rows come first"
        if not num_queries:
            continue
        prefills.append(PrefillSpan(query_start_loc[seq], num_queries, seq_lens[seq]))
        if num_queries == seq_lens[seq]:
            staged_blocks.append(None)  # a fresh prompt: its own K/V rows, nothing to gather
        else:
            staged_blocks.append(staging.stage(f"prefill_blocks_{len(prefills)}", block_tables[seq], torch.int64))
    indexes = {}
    for device in dict.fromkeys(layer_devices):
        indexes[device] = DeviceIndexes(
            slot_mapping=staging.upload(staged_slots, device),
            block_tables=staging.upload(staged_tables, device),
            seq_lens=staging.upload(staged_lens, device),
            query_start_loc=staging.upload(staged_starts, device),
            prefill_block_ids=tuple(None if ids is None else staging.upload(ids, device) for ids in staged_blocks),
        )
    return DeviceBatch(num_decode, tuple(prefills), indexes, tuple(layer_devices))


def run_device_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: DeviceBatch,
    scale: float,
    layer: int,
) -> None:
    """Layer `layer`'s attention of a pass on the kernels' path: K/V written, decode rows on
    the paged kernel, prefill rows on SDPA (all [tokens, heads, head_dim]; see the module doc)."""
    indexes = batch.for_layer(layer)
    ops.write_kv(key, value, key_cache, value_cache, indexes.slot_mapping)
    num_decode = batch.num_decode_rows
    if num_decode:
        ops.paged_attention(
            out[:num_decode],
            query[:num_decode],
            key_cache,
            value_cache,
            indexes.block_tables,
            indexes.seq_lens,
            indexes.query_start_loc,
            scale,
        )
    shape = (-1, *key_cache.shape[2:])
    for span, block_ids in zip(batch.prefills, indexes.prefill_block_ids, strict=True):
        rows = slice(span.start, span.start + span.num_queries)
        if block_ids is None:
            keys, values = key[rows], value[rows]
            mask = None
        else:  # the prefix (and this chunk) from the blocks, gathered once for every head
            keys = key_cache.index_select(0, block_ids).view(shape)[: span.seq_len]
            values = value_cache.index_select(0, block_ids).view(shape)[: span.seq_len]
            mask = causal_lower_right(span.num_queries, span.seq_len)
        attended = F.scaled_dot_product_attention(
            query[rows].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=query.shape[1] != key_cache.shape[2],
        )
        out[rows] = attended[0].transpose(0, 1)
