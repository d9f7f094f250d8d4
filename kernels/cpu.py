"""The torch implementation of the KV-cache ops: the reference for the CUDA kernels.

It serves on machines without CUDA, so it is vectorized: no Python loop per
token (paged_attention loops over prefill sequences, and batches every decode
sequence into one attention call). It is plain torch and device-agnostic, so
it also runs on CUDA tensors (``SHOAL_KERNELS=reference``). The contract and
the block layout are documented in `shoal.kernels.ops`.
"""

from __future__ import annotations

import itertools
import math
import threading

import torch
import torch.nn.functional as F

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
) -> None:
    """Writes each token's K/V into its slot; see `shoal.kernels.ops.write_kv`."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        kept = (slot_mapping >= 0).nonzero().squeeze(1)
        slot_mapping, key, value = slot_mapping[kept], key[kept], value[kept]
    for new, cache in ((key, key_cache), (value, value_cache)):
        rows, source = _as_wide(cache.view(num_slots, *cache.shape[2:]), new)
        rows.index_copy_(0, slot_mapping, source)


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
    gathered = []
    for name, cache in (("key", key_cache), ("value", value_cache)):
        if buffers is None:
            out = cache.index_select(0, block_ids)
        else:  # index_select copies a whole block per index: memcpy speed, no wide view needed
            out = buffers.take(name, (block_ids.shape[0], *cache.shape[1:]), cache)
            torch.index_select(cache, 0, block_ids, out=out)
        gathered.append(out.view(shape))
    return gathered[0], gathered[1]


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
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if starts[0] != 0 or starts[-1] != query.shape[0]:
        raise KVContractError(f"query_start_loc must run from 0 to num_tokens={query.shape[0]}, got {starts}")
    q_lens = [end - start for start, end in itertools.pairwise(starts)]
    for seq, (q_len, seq_len) in enumerate(zip(q_lens, lens, strict=True)):
        if not 0 <= q_len <= seq_len:
            raise KVContractError(f"sequence {seq}: q_len {q_len} must be in [0, seq_len={seq_len}]")
    decode = [seq for seq, q_len in enumerate(q_lens) if q_len == 1]
    if decode and len(decode) == len(q_lens):  # a pure decode step: query row s is sequence s
        _decode(out, query, key_cache, value_cache, block_tables, seq_lens, lens, scale)
    elif decode:
        index = torch.tensor(decode, device=query.device)
        rows = query_start_loc[index].long()
        attended = torch.empty((len(decode), *query.shape[1:]), dtype=query.dtype, device=query.device)
        _decode(
            attended,
            query.index_select(0, rows),
            key_cache,
            value_cache,
            block_tables[index],
            seq_lens[index],
            [lens[seq] for seq in decode],
            scale,
        )
        out.index_copy_(0, rows, attended)
    for seq, q_len in enumerate(q_lens):
        if q_len > 1:
            _prefill(
                out, query, key_cache, value_cache, block_tables, seq, starts[seq], q_len, lens[seq], scale
            )


def _decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    lens: list[int],
    scale: float,
) -> None:
    """Query row s is sequence s's one new token: one padded, masked attention call for all."""
    num_blocks = _blocks_needed(lens, key_cache)
    keys, values = _gather_blocks(key_cache, value_cache, block_tables, num_blocks, _buffers())
    num_seqs, num_kv_heads, head_dim = len(lens), key_cache.shape[2], key_cache.shape[3]
    # GQA without copying K/V: the query heads that share a kv head become that
    # head's "query positions", so q is [seqs, kv_heads, group, head_dim].
    grouped = query.reshape(num_seqs, num_kv_heads, -1, head_dim)
    mask = None
    if min(lens) < keys.shape[1]:
        positions = torch.arange(keys.shape[1], device=query.device)
        mask = (positions < seq_lens[:, None])[:, None, None, :]
    attended = F.scaled_dot_product_attention(
        grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
    )
    out.copy_(attended.view(num_seqs, -1, head_dim))


def _prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq: int,
    start: int,
    q_len: int,
    seq_len: int,
    scale: float,
) -> None:
    """Several query tokens of one sequence: the last q_len of its seq_len positions."""
    keys, values = _gather_blocks(
        key_cache, value_cache, block_tables[seq : seq + 1], _blocks_needed([seq_len], key_cache), _buffers()
    )
    num_kv_heads = key_cache.shape[2]
    keys = keys[0, :seq_len].transpose(0, 1)  # [kv_heads, seq_len, head_dim]
    values = values[0, :seq_len].transpose(0, 1)
    mask = None
    if q_len < seq_len:  # a cached prefix: row i sees positions [0, seq_len - q_len + i]
        positions = torch.arange(seq_len, device=query.device)
        last_seen = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = positions[None, :] <= last_seen[:, None]
    grouped_query = query[start : start + q_len].unflatten(1, (num_kv_heads, -1))
    grouped_out = out[start : start + q_len].unflatten(1, (num_kv_heads, -1))
    # One call per query head of each kv group keeps K/V un-repeated and the
    # mask [q_len, seq_len] (folding the group into the rows would repeat it).
    for member in range(grouped_query.shape[2]):
        attended = F.scaled_dot_product_attention(
            grouped_query[:, :, member].transpose(0, 1),
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
        )
        grouped_out[:, :, member] = attended.transpose(0, 1)


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
    """Copies (src, dst) block pairs between two pools; see `shoal.kernels.ops.swap_blocks`."""
    if block_mapping.numel() == 0:
        return
    num_layers = src_cache.shape[0]
    src_blocks, dst_blocks = _as_wide(
        src_cache.view(num_layers * 2, src_cache.shape[2], -1),
        dst_cache.view(num_layers * 2, dst_cache.shape[2], -1),
    )
    moved = src_blocks.index_select(1, block_mapping[:, 0].to(src_cache.device))
    dst_blocks.index_copy_(1, block_mapping[:, 1].to(dst_cache.device), moved.to(dst_cache.device))
