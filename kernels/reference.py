"""The torch implementation of the KV-cache ops: the reference for the CUDA kernels.

It serves on machines without CUDA, so it is vectorized: no Python loop per
token (paged_attention loops over prefill sequences and over groups of decode
sequences of similar length, planned by `shoal.kernels.attention_plan`). It is
plain torch and device-agnostic, so it also runs on CUDA tensors (the setting
``cuda = "reference"``). Two exceptions, on CPU tensors where the native library
(`shoal.kernels.cpu_kernels`, built on first use) is available: `write_kv` runs a
small C loop with streaming stores for large writes (`write_kv_torch` serves
otherwise, and is its reference in tests), and the decode rows of
`paged_attention` run a C kernel that reads K/V straight from the blocks (the
torch decode groups serve otherwise, and are its reference). The contract and
the block layout are documented in `shoal.kernels.ops`; docs/kernels.md says how
each op is done and why.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from shoal.kernels import cpu_kernels
from shoal.kernels.attention_plan import AttentionPlan, DecodeGroup, PrefillPlan, plan_attention
from shoal.kernels.contract import KVContractError

# index_copy_ (and index_select along a dim other than the first) moves one
# element per step of its inner loop, so a row of 2-byte bf16 values moves at a
# fraction of memcpy speed. Reinterpreting the row as 16-byte elements (bits
# only: nothing is computed on them) brings it to the speed of a row-by-row
# memcpy.
_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32)


def _as_wide(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Views the tensors' last dims as the widest element type all their layouts allow.

    One type for all, so the views of a copy's source and destination match.

    Args:
        tensors: tensors of one dtype whose last dims are contiguous.

    Returns:
        The same memory with fewer, wider elements in the last dim, or the
        tensors themselves when no wider type fits their sizes, strides or
        alignment.
    """
    item_bytes = tensors[0].element_size()
    for wide in _WIDE_DTYPES:
        ratio = wide.itemsize // item_bytes
        if ratio <= 1:
            break
        if all(_fits(tensor, ratio, wide.itemsize) for tensor in tensors):
            return [tensor.view(wide) for tensor in tensors]
    return list(tensors)


def _fits(tensor: torch.Tensor, ratio: int, wide_bytes: int) -> bool:
    return (
        tensor.stride(-1) == 1
        and tensor.shape[-1] % ratio == 0
        and tensor.storage_offset() % ratio == 0
        and tensor.data_ptr() % wide_bytes == 0
        and all(stride % ratio == 0 for stride in tensor.stride()[:-1])
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    may_pad: bool = True,
) -> None:
    """Writes each token's K/V into its slot; see `shoal.kernels.ops.write_kv`.

    On CPU tensors this is the native kernel (`shoal.kernels.cpu_kernels`) where it
    was built; otherwise, and for tensors it does not take, `write_kv_torch`.

    Args:
        may_pad: False when the caller knows no slot is negative (padding); the
            torch implementation then skips looking, which costs as much as the copy
            itself for a decode step (the native one skips padding as it goes).
    """
    if key_cache.is_cpu:  # not built for the torch path on CUDA tensors (cuda = "reference")
        native = cpu_kernels.try_load()
        if native is not None and native.write_kv(key, value, key_cache, value_cache, slot_mapping):
            return
    write_kv_torch(key, value, key_cache, value_cache, slot_mapping, may_pad=may_pad)


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    may_pad: bool = True,
) -> None:
    """`write_kv` in plain torch: the fallback of the native kernel and its reference in tests.

    Args:
        may_pad: as in `write_kv`.
    """
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if may_pad and slot_mapping.numel() and int(slot_mapping.min()) < 0:
        kept = (slot_mapping >= 0).nonzero().squeeze(1)
        slot_mapping, key, value = slot_mapping[kept], key[kept], value[kept]
    _copy_to_slots(key_cache.view(num_slots, key_cache.shape[2], key_cache.shape[3]), key, slot_mapping)
    _copy_to_slots(
        value_cache.view(num_slots, value_cache.shape[2], value_cache.shape[3]), value, slot_mapping
    )


def _copy_to_slots(rows: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``rows[slot_mapping[i]] = new[i]``: one `index_copy_` over the widest elements that
    both layouts allow (what `_as_wide` picks), checked with as few Python steps as
    possible: this runs once per layer per step, and for a decode step's few KB its fixed
    cost is most of the op's time.

    Args:
        rows: [num_slots, num_kv_heads, head_dim], contiguous.
        new: [num_tokens, num_kv_heads, head_dim], last dim contiguous.
    """
    item_bytes = new.element_size()
    misalignment = rows.data_ptr() | new.data_ptr()
    for wide in _WIDE_DTYPES:
        if wide.itemsize <= item_bytes:
            break
        if misalignment % wide.itemsize:
            continue
        try:  # view() checks that sizes, strides and offsets divide into wide elements
            wide_rows, wide_new = rows.view(wide), new.view(wide)
        except RuntimeError:
            continue
        wide_rows.index_copy_(0, slot_mapping, wide_new)
        return
    rows.index_copy_(0, slot_mapping, new)


class GatherBuffers:
    """Reusable memory for gathered K/V, kept between calls.

    A gather of a decode batch is tens of MB; a fresh tensor of that size is
    mmap-ed and page-faulted on every call (glibc maps allocations above
    32 MB), which costs more than the copy itself. The buffers only grow, to
    the largest gather seen. Not thread-safe: one per thread.
    """

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous [shape] view of buffer `name`, valid until the next `take` of that name.

        Args:
            name: which buffer ("key", "value").
            shape: the shape wanted.
            like: a tensor with the dtype and device wanted.
        """
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel or flat.dtype != like.dtype or flat.device != like.device:
            flat = torch.empty(numel + numel // 4, dtype=like.dtype, device=like.device)
            self._flat[name] = flat
        return flat[:numel].view(shape)


_thread_state = threading.local()


def _buffers() -> GatherBuffers:
    """This thread's gather buffers."""
    buffers = getattr(_thread_state, "buffers", None)
    if buffers is None:
        buffers = _thread_state.buffers = GatherBuffers()
    return buffers


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    buffers: GatherBuffers | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathers each sequence's blocks into contiguous, padded K and V tensors.

    This is the gather inside `paged_attention`, exposed so it can be timed.

    Args:
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        value_cache: same shape as `key_cache`.
        block_tables: int32 [num_seqs, max_blocks_per_seq].
        seq_lens: int32 [num_seqs], context lengths.
        buffers: where to gather into (the results are views of it, valid
            until its next use); None for new tensors.

    Returns:
        (keys, values), each [num_seqs, max_tokens, num_kv_heads, head_dim]
        with max_tokens = the longest sequence rounded up to whole blocks.
        Token t of sequence s is at [s, t] for t < seq_lens[s]; rows past a
        sequence's length hold another block's data (mask them out).
    """
    num_blocks = _blocks_needed(seq_lens.tolist(), key_cache)
    return _gather_blocks(key_cache, value_cache, block_tables, num_blocks, buffers)


def _blocks_needed(seq_lens: list[int], key_cache: torch.Tensor) -> list[int]:
    block_size = key_cache.shape[1]
    return [-(-seq_len // block_size) for seq_len in seq_lens]


def _gather_blocks(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_blocks: list[int],
    buffers: GatherBuffers | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_kv` with each sequence's block count already known."""
    max_blocks = max(num_blocks, default=0)
    if max_blocks > block_tables.shape[1]:
        raise KVContractError(
            f"a sequence needs {max_blocks} blocks but block_tables has {block_tables.shape[1]} columns"
        )
    table = block_tables[:, :max_blocks]
    if min(num_blocks, default=0) < max_blocks:  # entries past a shorter sequence's end may hold anything
        unused = torch.arange(max_blocks) >= torch.tensor(num_blocks)[:, None]
        table = table.masked_fill(unused.to(table.device), 0)
    block_ids = table.reshape(-1)
    shape = (len(num_blocks), max_blocks * key_cache.shape[1], *key_cache.shape[2:])
    gathered: list[torch.Tensor] = []
    for name, cache in (("key", key_cache), ("value", value_cache)):
        if buffers is None:
            out = cache.index_select(0, block_ids)
        else:  # index_select copies a whole block per index: memcpy speed, no wide view needed
            out = buffers.take(name, (block_ids.shape[0], *cache.shape[1:]), cache)
            torch.index_select(cache, 0, block_ids, out=out)
        gathered.append(out.view(shape))
    return gathered[0], gathered[1]


# A prefill with explicit scores (a plan's mask: `attention_plan.MAX_MATH_PREFILL_SCORES`)
# is computed in tiles of this many query rows, each against the keys up to its last row.
PREFILL_TILE_ROWS = 64


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> None:
    """Varlen causal attention over the paged cache; see `shoal.kernels.ops.paged_attention`."""
    plan = plan_attention(
        key_cache, block_tables.tolist(), seq_lens.tolist(), query_start_loc.tolist(), num_tokens=query.shape[0]
    )
    run_attention(out, query, key_cache, value_cache, plan, scale)


def run_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
) -> None:
    """`paged_attention` of a planned batch (the layouts of `shoal.kernels.ops`).

    Decode rows run the native kernel where the plan has it and it takes the
    tensors, else the torch groups; prefill rows run in torch.

    Args:
        new_key: the batch's own K rows [num_tokens, num_kv_heads, head_dim],
            already written to the cache; with `new_value`, a fresh prefill
            (q_len == seq_len) reads them instead of gathering its blocks.
        new_value: the batch's own V rows, like `new_key`.
    """
    native = plan.native_decode
    if native is None or not native.run(out, query, key_cache, value_cache, scale):
        for decode_group in plan.decode:
            _decode(out, query, key_cache, value_cache, decode_group, scale)
    if not plan.prefills:
        return
    group = query.shape[1] // key_cache.shape[2]  # query heads per kv head
    query_heads, out_heads = query.transpose(0, 1), out.transpose(0, 1)  # [heads, tokens, head_dim]
    for prefill in plan.prefills:
        rows = slice(prefill.start, prefill.start + prefill.num_queries)
        if new_key is not None and new_value is not None and prefill.num_queries == prefill.seq_len:
            keys, values = new_key[rows], new_value[rows]
        else:
            keys, values = _gather_sequence(key_cache, value_cache, prefill)
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [kv_heads, seq_len, head_dim]
        if prefill.mask is not None:
            _prefill_scores(
                out_heads[:, rows], query_heads[:, rows], keys, values, prefill.mask, group, scale
            )
        else:
            out_heads[:, rows] = _prefill_sdpa(query_heads[:, rows], keys, values, prefill, scale)


def _gather_sequence(
    key_cache: torch.Tensor, value_cache: torch.Tensor, prefill: PrefillPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, [seq_len, num_kv_heads, head_dim] each."""
    shape = (-1, *key_cache.shape[2:])
    keys = key_cache.index_select(0, prefill.block_ids).view(shape)[: prefill.seq_len]
    values = value_cache.index_select(0, prefill.block_ids).view(shape)[: prefill.seq_len]
    return keys, values


def _prefill_scores(
    out: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    group: int,
    scale: float,
) -> None:
    """Attention with explicit float32 scores into `out`.

    Args:
        out: [heads, q_len, D], written.
        query: [heads, q_len, D].
        keys: [kv_heads, seq_len, D].
        values: like `keys`.
        mask: additive causal [q_len, seq_len].
    """
    if group > 1:  # each kv head's K/V once per query head of its group
        keys = keys.repeat_interleave(group, dim=0)
        values = values.repeat_interleave(group, dim=0)
    q_len, seq_len = mask.shape
    # Rows in tiles, each against the keys up to its last row's position only: the
    # scores above the causal diagonal are mostly not computed (15-22% less time).
    for first in range(0, q_len, PREFILL_TILE_ROWS):
        last = min(q_len, first + PREFILL_TILE_ROWS)
        num_seen = seq_len - q_len + last
        scores = torch.baddbmm(
            mask[first:last, :num_seen], query[:, first:last], keys[:, :num_seen].transpose(1, 2), alpha=scale
        )
        out[:, first:last] = torch.bmm(torch.softmax(scores, dim=-1), values[:, :num_seen])


def _prefill_sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefill: PrefillPlan, scale: float
) -> torch.Tensor:
    """The fused kernel, for long sequences and half dtypes: causal from the cache's positions."""
    q_len, seq_len = prefill.num_queries, prefill.seq_len
    mask = None
    if q_len < seq_len:  # a cached prefix: row i sees positions [0, seq_len - q_len + i]
        positions = torch.arange(seq_len, device=query.device)
        last_seen = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = positions[None, :] <= last_seen[:, None]
    return F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )


def _decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: DecodeGroup,
    scale: float,
) -> None:
    """A group of one-row sequences in one padded, masked attention call."""
    buffers = _buffers()
    num_seqs, num_kv_heads, head_dim = plan.num_seqs, key_cache.shape[2], key_cache.shape[3]
    gathered: list[torch.Tensor] = []
    for name, cache in (("key", key_cache), ("value", value_cache)):
        # index_select copies a whole block per index: memcpy speed, no wide view needed
        rows = buffers.take(name, (plan.block_ids.shape[0], *cache.shape[1:]), cache)
        torch.index_select(cache, 0, plan.block_ids, out=rows)
        rows = rows.view(num_seqs, -1, num_kv_heads, head_dim)
        if plan.lone_seq_len:
            rows = rows[:, : plan.lone_seq_len]
        gathered.append(rows.transpose(1, 2))  # [seqs, kv_heads, positions, head_dim]
    run = slice(plan.first_row, plan.first_row + num_seqs)
    queries = query[run] if plan.rows is None else query.index_select(0, plan.rows)
    # GQA without copying K/V: the query heads that share a kv head become that
    # head's "query positions", so q is [seqs, kv_heads, group, head_dim].
    grouped = queries.reshape(num_seqs, num_kv_heads, -1, head_dim)
    keys, values = gathered
    attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=plan.mask, scale=scale)
    attended = attended.view(num_seqs, -1, head_dim)
    if plan.rows is None:
        out[run] = attended
    else:
        out.index_copy_(0, plan.rows, attended)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies (src, dst) block pairs for every layer; see `shoal.kernels.ops.copy_blocks`."""
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to(kv_cache.device)
    src_ids, dst_ids = mapping[:, 0], mapping[:, 1]
    assert not bool(torch.isin(dst_ids, src_ids).any()), "copy_blocks: a destination block is also a source"
    assert dst_ids.unique().numel() == dst_ids.numel(), "copy_blocks: a destination block appears twice"
    num_layers, _, num_blocks = kv_cache.shape[:3]
    (blocks,) = _as_wide(kv_cache.view(num_layers * 2, num_blocks, -1))
    blocks.index_copy_(1, dst_ids, blocks.index_select(1, src_ids))


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies (src, dst) block pairs between two pools; see `shoal.kernels.ops.swap_blocks`.

    On CPU pools this is the native single-pass copy (`CpuKernels.copy_blocks_between`) where
    it was built; otherwise, and for tensors it does not take, `swap_blocks_torch`.
    """
    if block_mapping.numel() == 0:
        return
    if src_cache.is_cpu and dst_cache.is_cpu:
        native = cpu_kernels.try_load()
        if native is not None and native.copy_blocks_between(src_cache, dst_cache, block_mapping.contiguous()):
            return
    swap_blocks_torch(src_cache, dst_cache, block_mapping)


def swap_blocks_torch(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """`swap_blocks` in plain torch (a gather into a temporary, then a scatter): the fallback
    of the native copy and its reference in tests."""
    if block_mapping.numel() == 0:
        return
    num_layers = src_cache.shape[0]
    src_blocks, dst_blocks = _as_wide(
        src_cache.view(num_layers * 2, src_cache.shape[2], -1),
        dst_cache.view(num_layers * 2, dst_cache.shape[2], -1),
    )
    moved = src_blocks.index_select(1, block_mapping[:, 0].to(src_cache.device))
    dst_blocks.index_copy_(1, block_mapping[:, 1].to(dst_cache.device), moved.to(dst_cache.device))
