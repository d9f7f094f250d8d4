"""The CPU attention planner: the host-side metadata of a `paged_attention` batch.

Everything paged_attention needs besides the tensors it reads is host-side
metadata: which rows decode, which blocks each sequence reads, masks. A model
runs the same batch through every layer, so that metadata is an `AttentionPlan`,
built once per batch from Python ints (`plan_attention`) and used by every layer
(`shoal.kernels.reference.run_attention`); `reference.paged_attention` builds one
per call. Decode rows go to the native C kernel (`shoal.kernels.cpu_kernels`) where
it is loaded and chosen, else to the torch decode groups planned here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.kernels import contract, cpu_kernels

# A prefill of q_len rows over seq_len positions is computed with explicit
# scores ([heads, q_len, seq_len] float32) up to this many score entries per
# head, which on CPU is ~1.5x faster than the fused SDPA kernel for the short
# sequences of a batch; longer ones use SDPA, which never holds all scores.
MAX_MATH_PREFILL_SCORES = 512 * 512

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
    native_decode: cpu_kernels.DecodePlan | None
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
    *,
    num_tokens: int | None = None,
) -> AttentionPlan:
    """Builds the metadata of a batch (see `shoal.kernels.ops.paged_attention`) once.

    The batch's index values and the cache's geometry are checked here, once per batch
    (`contract.check_attention_batch`, `contract.check_attention_cache`).

    Args:
        key_cache: a layer's key cache (only its shape, dtype and device are used).
        block_tables: each sequence's block ids; entries past the blocks its
            length needs are ignored.
        seq_lens: context lengths, including the new query tokens.
        query_start_loc: num_seqs + 1 cumulative query counts, from 0.
        num_tokens: the query's rows; None when they are ``query_start_loc[-1]`` by
            construction (the engine's batches).

    Raises:
        KVContractError: the cache's geometry or the batch's values break the contract.
    """
    contract.check_attention_cache(key_cache)
    contract.check_attention_batch(
        query_start_loc[-1] if num_tokens is None else num_tokens,
        key_cache.shape[1],
        block_tables,
        seq_lens,
        query_start_loc,
    )
    block_size, dtype, device = key_cache.shape[1], key_cache.dtype, key_cache.device
    decode_seqs: list[int] = []
    prefills: list[PrefillPlan] = []
    for seq, seq_len in enumerate(seq_lens):
        start = query_start_loc[seq]
        q_len = query_start_loc[seq + 1] - start
        num_blocks = -(-seq_len // block_size)
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
        kernels = cpu_kernels.try_load()
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


