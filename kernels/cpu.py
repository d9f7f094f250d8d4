"""The torch implementation of the KV-cache ops: the reference for the CUDA kernels.

It serves on machines without CUDA, so it is vectorized: no Python loop per
token (paged_attention loops over prefill sequences and over groups of decode
sequences of similar length). It is plain torch and device-agnostic, so it
also runs on CUDA tensors (``SHOAL_KERNELS=reference``). Two exceptions, on CPU
tensors where the native library (`shoal.kernels.cpu_native`, built on first
use) is available: `write_kv` runs a small C loop with streaming stores for
large writes (`write_kv_torch` serves otherwise, and is its reference in
tests), and the decode rows of `paged_attention` run a C kernel that reads
K/V straight from the blocks (the torch decode groups below serve otherwise,
and are its reference). The contract and the block layout are documented in
`shoal.kernels.ops`; docs/kernels.md says how each op is done and why.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.kernels import cpu_native
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

    On CPU tensors this is the native kernel (`shoal.kernels.cpu_native`) where it
    was built; otherwise, and for tensors it does not take, `write_kv_torch`.

    Args:
        may_pad: False when the caller knows no slot is negative (padding); the
            torch implementation then skips looking, which costs as much as the copy
            itself for a decode step (the native one skips padding as it goes).
    """
    if key_cache.is_cpu:  # not built for the torch path on CUDA tensors (SHOAL_KERNELS=reference)
        native = cpu_native.try_load()
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


# --- paged_attention ----------------------------------------------------------
#
# Everything paged_attention needs besides the tensors it reads is host-side
# metadata: which rows decode, which blocks each sequence reads, masks. A model
# runs the same batch through every layer, so that metadata is an
# `AttentionPlan`, built once per batch from Python ints (`plan_attention`) and
# used by every layer (`run_attention`); `paged_attention` builds one per call.

# A prefill of q_len rows over seq_len positions is computed with explicit
# scores ([heads, q_len, seq_len] float32) up to this many score entries per
# head, which on CPU is ~1.5x faster than the fused SDPA kernel for the short
# sequences of a batch; longer ones use SDPA, which never holds all scores.
MAX_MATH_PREFILL_SCORES = 512 * 512
# ...in tiles of this many query rows, each against the keys up to its last row.
PREFILL_TILE_ROWS = 64

# Decode sequences are attended in groups of similar length (less padding); one
# more group costs about as much as gathering and attending this many bytes of K/V.
GROUP_OVERHEAD_BYTES = 512 * 1024
# ...and of at most this many gathered bytes (K and V) per torch thread: attention
# then reads what the gather just wrote from the cache. Measured on a 2-core EPYC
# (1 MB L2, 32 MB L3 shared with other jobs), one thread: a 10 MB gather + attention
# cost 1.8x four 2.6 MB ones; 32 sequences of 512 tokens attend in 24 ms instead of
# 35. Scaled by the thread count so that each call still has work for every thread.
MAX_GROUP_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences with one query row each, attended in one call over K/V gathered into
    rows of `num_blocks` blocks; positions past a sequence's length are masked out."""

    first_row: int
    rows: torch.Tensor | None
    """int64 query rows of the group's sequences; None when they are the run of rows
    `first_row` .. `first_row + num_seqs - 1`, read and written in place."""
    block_ids: torch.Tensor
    """int64 [num_seqs * num_blocks]: each sequence's blocks, then block 0 as padding."""
    num_seqs: int
    num_blocks: int
    lone_seq_len: int
    """For a group of one sequence, its length (K/V are sliced to it, no mask); 0 otherwise."""
    mask: torch.Tensor | None
    """Additive [num_seqs, 1, 1, num_blocks * block_size] in the cache's dtype, -inf past
    each sequence's length; None when no position is masked."""


@dataclass(frozen=True)
class PrefillPlan:
    """One sequence with several query rows: the last `num_queries` of its `seq_len` positions."""

    start: int
    """Its first query row."""
    num_queries: int
    seq_len: int
    block_ids: torch.Tensor
    """int64 [blocks needed for seq_len]: the sequence's blocks."""
    mask: torch.Tensor | None
    """Additive float32 causal mask [num_queries, seq_len] for the explicit-scores path
    (float32 caches up to `MAX_MATH_PREFILL_SCORES`); None for the fused SDPA path."""


@dataclass(frozen=True)
class DecodeSequences:
    """The decoding sequences of a batch as `plan_attention` was given them."""

    seqs: list[int]
    block_tables: Sequence[Sequence[int]]
    seq_lens: Sequence[int]
    query_start_loc: Sequence[int]
    key_cache: torch.Tensor
    """A layer's key cache (its shape, dtype and device)."""


@dataclass(frozen=True)
class AttentionPlan:
    """Host-side metadata of one `paged_attention` batch, shared by every layer."""

    num_tokens: int
    prefills: tuple[PrefillPlan, ...]
    native_decode: cpu_native.DecodePlan | None
    """The decoding sequences for the native kernel (CPU caches it takes, when it is
    loaded and chosen); None: the torch groups (`decode`) attend them."""
    decode_sequences: DecodeSequences

    @functools.cached_property
    def decode(self) -> tuple[DecodeGroup, ...]:
        """The torch path's length groups of the decoding sequences, built on first use:
        with the native kernel only if it declines a layer's tensors."""
        return _plan_decode_groups(self.decode_sequences)


def plan_attention(
    key_cache: torch.Tensor,
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_start_loc: Sequence[int],
) -> AttentionPlan:
    """Builds the metadata of a batch (see `shoal.kernels.ops.paged_attention`) once.

    Args:
        key_cache: a layer's key cache (only its shape, dtype and device are used).
        block_tables: each sequence's block ids; entries past the blocks its
            length needs are ignored.
        seq_lens: context lengths, including the new query tokens.
        query_start_loc: num_seqs + 1 cumulative query counts, from 0.

    Raises:
        KVContractError: a q_len outside [0, seq_len], or a table too short for its sequence.
    """
    block_size, dtype, device = key_cache.shape[1], key_cache.dtype, key_cache.device
    decode_seqs: list[int] = []
    prefills: list[PrefillPlan] = []
    for seq, seq_len in enumerate(seq_lens):
        start = query_start_loc[seq]
        q_len = query_start_loc[seq + 1] - start
        if not 0 <= q_len <= seq_len:
            raise KVContractError(f"sequence {seq}: q_len {q_len} must be in [0, seq_len={seq_len}]")
        num_blocks = -(-seq_len // block_size)
        if num_blocks > len(block_tables[seq]):
            raise KVContractError(
                f"a sequence needs {num_blocks} blocks but block_tables has {len(block_tables[seq])} columns"
            )
        if q_len == 1:
            decode_seqs.append(seq)
        elif q_len > 1:
            mask = None
            if dtype == torch.float32 and q_len * seq_len <= MAX_MATH_PREFILL_SCORES:
                # Row i is position seq_len - q_len + i and sees positions <= it.
                mask = torch.full((q_len, seq_len), float("-inf"), device=device).triu_(seq_len - q_len + 1)
            block_ids = torch.tensor(block_tables[seq][:num_blocks], dtype=torch.int64, device=device)
            prefills.append(PrefillPlan(start, q_len, seq_len, block_ids, mask))
    native_decode = None
    if decode_seqs and key_cache.is_cpu:  # never built for the torch path on CUDA tensors
        kernels = cpu_native.try_load()
        if kernels is not None and kernels.decode_attention_enabled:
            native_decode = kernels.plan_decode(
                key_cache,
                [block_tables[seq] for seq in decode_seqs],
                [seq_lens[seq] for seq in decode_seqs],
                [query_start_loc[seq] for seq in decode_seqs],
            )
    return AttentionPlan(
        query_start_loc[-1],
        tuple(prefills),
        native_decode,
        DecodeSequences(decode_seqs, block_tables, seq_lens, query_start_loc, key_cache),
    )


def _plan_decode_groups(batch: DecodeSequences) -> tuple[DecodeGroup, ...]:
    """The torch path's decode groups: by length, then in chunks of at most `MAX_GROUP_BYTES`."""
    if not batch.seqs:
        return ()
    key_cache, seq_lens = batch.key_cache, batch.seq_lens
    block_size = key_cache.shape[1]
    # A group costs a few op calls, about as much as attending to this many padded blocks.
    block_bytes = 2 * key_cache[0].numel() * key_cache.element_size()  # K and V
    groups = _group_by_length(batch.seqs, seq_lens, block_size, max(1, GROUP_OVERHEAD_BYTES // block_bytes))
    max_bytes = MAX_GROUP_BYTES * torch.get_num_threads()
    chunks = [
        group[start : start + size]
        for group in groups
        for size in [_max_group_seqs(group, seq_lens, block_size, block_bytes, max_bytes)]
        for start in range(0, len(group), size)
    ]
    return tuple(
        _plan_decode_group(chunk, batch.block_tables, seq_lens, batch.query_start_loc, key_cache)
        for chunk in chunks
    )


def _group_by_length(
    seqs: list[int], seq_lens: Sequence[int], block_size: int, group_cost: int
) -> list[list[int]]:
    """Splits decode sequences into groups of similar length, to pad less.

    Minimizes sum over groups of (group_cost + num_seqs * longest's blocks), by dynamic
    programming over the sequences sorted by block count (groups are runs of that order),
    cutting only where the block count changes.
    """
    by_blocks = sorted(seqs, key=lambda seq: seq_lens[seq])
    blocks = [-(-seq_lens[seq] // block_size) for seq in by_blocks]
    if blocks[0] == blocks[-1]:
        return [by_blocks]
    cuts = [0] + [i for i in range(1, len(blocks)) if blocks[i] != blocks[i - 1]]
    # best[k]: cost of grouping by_blocks[:cuts[k]] (cuts[len(cuts)] = n)
    ends = [*cuts[1:], len(blocks)]
    best = [0] * (len(ends) + 1)
    choice = [0] * (len(ends) + 1)
    for k in range(1, len(ends) + 1):
        end = ends[k - 1]
        best[k], choice[k] = min(
            (best[j] + group_cost + (end - cuts[j]) * blocks[end - 1], j) for j in range(k)
        )
    groups = []
    k = len(ends)
    while k:
        j = choice[k]
        groups.append(by_blocks[cuts[j] : ends[k - 1]])
        k = j
    return groups[::-1]


def _max_group_seqs(
    group: list[int], seq_lens: Sequence[int], block_size: int, block_bytes: int, max_bytes: int
) -> int:
    """How many of a group's sequences fit in `max_bytes` of gathered K/V (at least 1)."""
    padded_blocks = -(-max(seq_lens[seq] for seq in group) // block_size)
    return max(1, max_bytes // (padded_blocks * block_bytes))


def _plan_decode_group(
    seqs: list[int],
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_start_loc: Sequence[int],
    key_cache: torch.Tensor,
) -> DecodeGroup:
    """The metadata of one attention call over `seqs` (decoding sequences)."""
    block_size, device = key_cache.shape[1], key_cache.device
    lens = [seq_lens[seq] for seq in seqs]
    max_blocks = -(-max(lens) // block_size)
    block_ids: list[int] = []
    for seq, seq_len in zip(seqs, lens, strict=True):
        num_blocks = -(-seq_len // block_size)
        block_ids += block_tables[seq][:num_blocks]
        block_ids += [0] * (max_blocks - num_blocks)
    row_ids = [query_start_loc[seq] for seq in seqs]
    rows = None
    if row_ids != list(range(row_ids[0], row_ids[0] + len(row_ids))):  # not a run: pick them out
        rows = torch.tensor(row_ids, dtype=torch.int64, device=device)
    mask = None
    num_positions = max_blocks * block_size
    if len(seqs) > 1 and min(lens) < num_positions:
        past_end = torch.arange(num_positions) >= torch.tensor(lens)[:, None]
        mask = torch.zeros((len(seqs), 1, 1, num_positions), dtype=key_cache.dtype)
        mask.masked_fill_(past_end[:, None, None, :], float("-inf"))
        mask = mask.to(device)
    return DecodeGroup(
        row_ids[0],
        rows,
        torch.tensor(block_ids, dtype=torch.int64, device=device),
        len(seqs),
        max_blocks,
        lens[0] if len(seqs) == 1 else 0,
        mask,
    )


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
    if starts[0] != 0 or starts[-1] != query.shape[0]:
        raise KVContractError(f"query_start_loc must run from 0 to num_tokens={query.shape[0]}, got {starts}")
    plan = plan_attention(key_cache, block_tables.tolist(), seq_lens.tolist(), starts)
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
