"""The CPU KV-cache ops against naive references written here with per-token loops.

Attention is checked with both decode implementations: the torch groups and, where the
native library builds, the C kernel (`shoal.kernels.cpu_kernels`); prefill rows are torch
in both."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.kernels import attention_plan, contract, cpu_kernels, ops, reference

BLOCK_SIZES = (1, 8, 16, 32)
HEAD_DIMS = (32, 64, 128)
# (num_heads, num_kv_heads): MHA, GQA 2 and 4, MQA
HEAD_LAYOUTS = ((4, 4), (4, 2), (8, 2), (4, 1))
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


# --- naive references: one token at a time, math in float64 -----------------


def naive_write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[token]
        value_cache[slot // block_size, slot % block_size] = value[token]


def naive_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    out = torch.zeros(query.shape, dtype=torch.float64)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[seq + 1] - starts[seq]
        for i in range(q_len):
            token = starts[seq] + i
            num_seen = seq_len - q_len + i + 1
            for head in range(query.shape[1]):
                kv_head = head // group
                keys, values = [], []
                for position in range(num_seen):
                    block = int(block_tables[seq, position // block_size])
                    keys.append(key_cache[block, position % block_size, kv_head].double())
                    values.append(value_cache[block, position % block_size, kv_head].double())
                scores = torch.stack(keys) @ query[token, head].double() * scale
                weights = torch.softmax(scores, dim=0)
                out[token, head] = weights @ torch.stack(values)
    return out


def naive_copy_pairs(src_cache, dst_cache, block_mapping) -> None:
    for src, dst in block_mapping.tolist():
        for layer in range(src_cache.shape[0]):
            for kv in range(2):
                dst_cache[layer, kv, dst] = src_cache[layer, kv, src]


# --- builders ----------------------------------------------------------------


def random_values(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(dtype)


def transposed(tensor: torch.Tensor) -> torch.Tensor:
    """The same values as a token-strided view, as a HF attention module hands them over."""
    return tensor.transpose(0, 1).contiguous().transpose(0, 1)


def build_batch(
    q_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
):
    """A filled cache, shuffled block tables padded with -1, queries and index tensors."""
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq, default=0) + 2
    num_blocks = sum(blocks_per_seq) + 3
    key_cache = random_values((num_blocks, block_size, num_kv_heads, head_dim), dtype, generator)
    value_cache = random_values((num_blocks, block_size, num_kv_heads, head_dim), dtype, generator)
    free = list(range(num_blocks))
    rng.shuffle(free)
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor([free.pop() for _ in range(count)], dtype=torch.int32)
    query = random_values((sum(q_lens), num_heads, head_dim), dtype, generator)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (
        query,
        key_cache,
        value_cache,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc,
    )


def attention_implementations() -> list[cpu_kernels.CpuKernels | None]:
    """The process's choices to run attention with: None (torch), and the native library
    where it builds."""
    native = cpu_kernels.try_load()
    return [None] if native is None else [None, native]


def check_attention(
    q_lens, seq_lens, block_size, heads, head_dim, dtype, seed=0, strided_query=False
) -> None:
    num_heads, num_kv_heads = heads
    query, key_cache, value_cache, block_tables, lens, starts = build_batch(
        q_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed
    )
    if strided_query:
        query = transposed(query)
    scale = head_dim**-0.5
    expected = naive_paged_attention(query, key_cache, value_cache, block_tables, lens, starts, scale)
    for kernels in attention_implementations():
        previous = cpu_kernels.use(kernels)
        try:
            out = torch.full_like(query, float("nan"))
            ops.paged_attention(out, query, key_cache, value_cache, block_tables, lens, starts, scale)
        finally:
            cpu_kernels.use(previous)
        torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# --- write_kv ----------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    block_size=st.sampled_from(BLOCK_SIZES),
    num_kv_heads=st.sampled_from((1, 2, 4)),
    head_dim=st.sampled_from(HEAD_DIMS),
    dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
    num_tokens=st.integers(0, 40),
    padding=st.floats(0.0, 0.5),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_write_kv_matches_naive(
    block_size, num_kv_heads, head_dim, dtype, num_tokens, padding, strided, seed
):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = math.ceil(num_tokens / block_size) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = random_values(shape, dtype, generator), random_values(shape, dtype, generator)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    key = random_values((num_tokens, num_kv_heads, head_dim), dtype, generator)
    value = random_values((num_tokens, num_kv_heads, head_dim), dtype, generator)
    if strided:
        key, value = transposed(key), transposed(value)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[torch.rand(num_tokens, generator=generator) < padding] = -1

    ops.write_kv(key, value, key_cache, value_cache, slots)
    naive_write_kv(key, value, expected_key, expected_value, slots)

    assert torch.equal(key_cache, expected_key)
    assert torch.equal(value_cache, expected_value)


def test_write_kv_copies_bits_exactly() -> None:
    """NaN payloads and infinities survive the reinterpretation as 16-byte elements."""
    bits = torch.randint(-(2**15), 2**15, (6, 2, 64), dtype=torch.int16)
    bits[0, 0, :8] = torch.tensor(
        [0x7FC1, 0x7F81, -0x7F, 0x7F80, -0x80, 0, -(2**15), 0x7FFF], dtype=torch.int16
    )
    key = bits.view(torch.bfloat16)
    key_cache = torch.zeros(4, 4, 2, 64, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([5, 0, 15, 9, 2, 11])
    ops.write_kv(key, key, key_cache, value_cache, slots)
    written = key_cache.view(16, 2, 64)[slots].view(torch.int16)
    assert torch.equal(written, bits)


@pytest.mark.parametrize("slots", [[7, 1, 0, 11, 3], [7, -1, 0, 11, 3]])
def test_write_kv_with_unaligned_rows_falls_back_to_narrow_elements(slots) -> None:
    wide = torch.randn(5, 3, 33)
    key = wide[:, :, 1:]  # storage offset 1: only 4-byte elements fit, in the cache too
    assert reference._as_wide(key)[0].dtype == torch.float32
    key_cache = torch.zeros(3, 4, 3, 32)
    value_cache = torch.zeros_like(key_cache)
    slot_mapping = torch.tensor(slots)
    ops.write_kv(key, key, key_cache, value_cache, slot_mapping)
    expected = torch.zeros_like(key_cache)
    naive_write_kv(key, key, expected, expected.clone(), slot_mapping)
    assert torch.equal(key_cache, expected)


def test_write_kv_rejects_a_slot_past_the_pool() -> None:
    key_cache = torch.zeros(2, 4, 1, 32)
    key = torch.ones(1, 1, 32)
    with pytest.raises(IndexError):
        ops.write_kv(key, key, key_cache, key_cache.clone(), torch.tensor([8]))


# --- gather_kv ---------------------------------------------------------------


def test_gather_kv_lays_each_sequence_out_in_order() -> None:
    seq_lens = [5, 17, 1, 0]
    _, key_cache, value_cache, block_tables, lens, _ = build_batch(
        [0, 0, 0, 0], seq_lens, 4, 2, 2, 32, torch.float32, seed=3
    )
    keys, values = reference.gather_kv(key_cache, value_cache, block_tables, lens)
    assert keys.shape == values.shape == (4, 20, 2, 32)
    for seq, seq_len in enumerate(seq_lens):
        for position in range(seq_len):
            block = int(block_tables[seq, position // 4])
            assert torch.equal(keys[seq, position], key_cache[block, position % 4])
            assert torch.equal(values[seq, position], value_cache[block, position % 4])


# --- paged_attention ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_batch(block_size, heads, dtype) -> None:
    seq_lens = [1, 7, 33, 64, 20]
    check_attention([1] * len(seq_lens), seq_lens, block_size, heads, 64, dtype, seed=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fresh_prefill(head_dim, heads, dtype) -> None:
    check_attention([9, 23], [9, 23], 8, heads, head_dim, dtype, seed=head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_over_a_cached_prefix(block_size, heads, dtype) -> None:
    check_attention([5, 16, 2], [21, 40, 3], block_size, heads, 32, dtype, seed=block_size + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_batch_with_empty_sequences_and_strided_query(dtype) -> None:
    q_lens = [1, 0, 12, 1, 4, 0, 1, 30]
    seq_lens = [17, 9, 12, 1, 50, 0, 33, 30]
    check_attention(q_lens, seq_lens, 16, (8, 2), 64, dtype, seed=7, strided_query=True)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from(BLOCK_SIZES),
    heads=st.sampled_from(HEAD_LAYOUTS),
    head_dim=st.sampled_from(HEAD_DIMS),
    dtype=st.sampled_from((torch.float32, torch.bfloat16)),
    seed=st.integers(0, 2**16),
)
def test_random_batches(data, block_size, heads, head_dim, dtype, seed) -> None:
    seq_lens = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
    q_lens = [data.draw(st.integers(0, seq_len)) for seq_len in seq_lens]
    check_attention(q_lens, seq_lens, block_size, heads, head_dim, dtype, seed)


# --- the planned path: one AttentionPlan for every layer ----------------------


def test_decode_sequences_are_grouped_by_length_and_chunked(monkeypatch) -> None:
    seq_lens = [3, 70, 5, 66, 130, 4, 69, 1, 140, 7, 65, 6]
    # 3 blocks of K and V (the limit is per torch thread)
    monkeypatch.setattr(attention_plan, "MAX_GROUP_BYTES", 3 * 2 * 16 * 2 * 64 * 4 // torch.get_num_threads())
    _, key_cache, _, block_tables, lens, starts = build_batch(
        [1] * len(seq_lens), seq_lens, 16, 4, 2, 64, torch.float32, seed=0
    )
    plan = attention_plan.plan_attention(key_cache, block_tables.tolist(), lens.tolist(), starts.tolist())
    groups = [(group.num_seqs, group.num_blocks) for group in plan.decode]
    # short (1 block: 6 seqs, 3 per chunk), medium (5 blocks: 4 seqs), long (9 blocks: 2 seqs)
    assert groups == [(3, 1), (3, 1), (1, 5), (1, 5), (1, 5), (1, 5), (1, 9), (1, 9)]
    assert sorted(row for group in plan.decode for row in _rows(group)) == list(range(len(seq_lens)))
    check_attention([1] * len(seq_lens), seq_lens, 16, (4, 2), 64, torch.float32, seed=0)
    # Rows laid out shortest first (as the engine does): every group is a run of rows.
    by_length = sorted(seq_lens)
    _, key_cache, _, block_tables, lens, starts = build_batch(
        [1] * len(seq_lens), by_length, 16, 4, 2, 64, torch.float32, seed=0
    )
    plan = attention_plan.plan_attention(key_cache, block_tables.tolist(), lens.tolist(), starts.tolist())
    assert [group.rows for group in plan.decode] == [None] * len(plan.decode)
    assert [row for group in plan.decode for row in _rows(group)] == list(range(len(seq_lens)))
    check_attention([1] * len(seq_lens), by_length, 16, (4, 2), 64, torch.float32, seed=0)


def _rows(group: attention_plan.DecodeGroup) -> list[int]:
    if group.rows is None:
        return list(range(group.first_row, group.first_row + group.num_seqs))
    return group.rows.tolist()


@pytest.mark.parametrize("heads", HEAD_LAYOUTS)
def test_a_mixed_batch_with_many_decodes_matches_naive(heads) -> None:
    q_lens = [1, 1, 40, 1, 1, 0, 1, 7, 1, 1, 1, 1, 1, 200, 100]
    seq_lens = [90, 3, 40, 17, 150, 12, 1, 60, 33, 34, 35, 129, 2, 200, 150]
    check_attention(q_lens, seq_lens, 8, heads, 64, torch.float32, seed=5)


def test_a_long_prefill_uses_the_fused_kernel(monkeypatch) -> None:
    monkeypatch.setattr(attention_plan, "MAX_MATH_PREFILL_SCORES", 100)
    check_attention([30, 12, 1], [30, 40, 9], 8, (8, 2), 32, torch.float32, seed=9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_run_attention_reads_a_fresh_prefill_from_the_new_rows(dtype) -> None:
    """The engine passes the layer's new K/V (already written): fresh prefills use them as they are."""
    q_lens, seq_lens = [9, 1, 23, 4], [9, 30, 23, 20]
    query, key_cache, value_cache, block_tables, lens, starts = build_batch(
        q_lens, seq_lens, 8, 8, 2, 64, dtype, seed=4
    )
    generator = torch.Generator().manual_seed(5)
    new_key = random_values((sum(q_lens), 2, 64), dtype, generator)
    new_value = random_values((sum(q_lens), 2, 64), dtype, generator)
    slots = [
        int(block_tables[seq, position // 8]) * 8 + position % 8
        for seq, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True))
        for position in range(seq_len - q_len, seq_len)
    ]
    ops.write_kv(new_key, new_value, key_cache, value_cache, torch.tensor(slots))
    expected = torch.empty_like(query)
    ops.paged_attention(expected, query, key_cache, value_cache, block_tables, lens, starts, 0.125)
    plan = attention_plan.plan_attention(key_cache, block_tables.tolist(), lens.tolist(), starts.tolist())
    out = torch.full_like(query, float("nan"))
    reference.run_attention(
        out, query, key_cache, value_cache, plan, 0.125, transposed(new_key), transposed(new_value)
    )
    assert torch.equal(out, expected)


def test_a_batch_without_sequences_is_a_no_op() -> None:
    key_cache = torch.zeros(2, 4, 2, 32)
    empty = torch.empty(0, 2, 32)
    ops.paged_attention(
        empty,
        empty,
        key_cache,
        key_cache.clone(),
        torch.empty(0, 3, dtype=torch.int32),
        torch.empty(0, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        0.1,
    )


def test_q_len_longer_than_the_sequence_is_rejected() -> None:
    query, key_cache, value_cache, block_tables, _, starts = build_batch(
        [4], [4], 4, 2, 2, 32, torch.float32, 0
    )
    out = torch.empty_like(query)
    with pytest.raises(contract.KVContractError, match="q_len"):
        ops.paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            torch.tensor([3], dtype=torch.int32),
            starts,
            0.1,
        )


# --- copy_blocks / swap_blocks -----------------------------------------------


def pool(num_blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return random_values((3, 2, num_blocks, 16, 2, 64), dtype, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_copies_every_pair_for_every_layer(dtype) -> None:
    kv_cache = pool(64, dtype, seed=0)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    mapping = torch.stack([ids[:30], ids[30:60]], dim=1)
    expected = kv_cache.clone()
    naive_copy_pairs(expected, expected, mapping)
    ops.copy_blocks(kv_cache, mapping)
    assert torch.equal(kv_cache, expected)


def test_copy_blocks_refuses_a_destination_that_is_also_a_source() -> None:
    kv_cache = pool(8, torch.float32, seed=0)
    with pytest.raises(AssertionError, match="also a source"):
        ops.copy_blocks(kv_cache, torch.tensor([[1, 2], [2, 3]]))


def test_copy_blocks_with_no_pairs_changes_nothing() -> None:
    kv_cache = pool(4, torch.float32, seed=0)
    before = kv_cache.clone()
    ops.copy_blocks(kv_cache, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(kv_cache, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_blocks_between_pools_of_different_sizes(dtype) -> None:
    gpu_like, cpu_like = pool(40, dtype, seed=0), pool(100, dtype, seed=1)
    generator = torch.Generator().manual_seed(2)
    out_mapping = torch.stack(
        [torch.randperm(40, generator=generator)[:25], torch.randperm(100, generator=generator)[:25]], dim=1
    )
    expected = cpu_like.clone()
    naive_copy_pairs(gpu_like, expected, out_mapping)
    ops.swap_blocks(gpu_like, cpu_like, out_mapping)
    assert torch.equal(cpu_like, expected)

    in_mapping = out_mapping.flip(1)[:10]
    gpu_like.zero_()
    expected = gpu_like.clone()
    naive_copy_pairs(cpu_like, expected, in_mapping)
    ops.swap_blocks(cpu_like, gpu_like, in_mapping)
    assert torch.equal(gpu_like, expected)


# --- contract ----------------------------------------------------------------


def test_contract_errors_name_the_argument() -> None:
    key_cache = torch.zeros(2, 4, 2, 32)
    key = torch.zeros(3, 2, 32)
    with pytest.raises(contract.KVContractError, match=r"slot_mapping must be torch\.int64"):
        ops.write_kv(key, key, key_cache, key_cache.clone(), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(contract.KVContractError, match="key dtype"):
        ops.write_kv(key.half(), key, key_cache, key_cache.clone(), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(contract.KVContractError, match="multiple of num_kv_heads"):
        ops.paged_attention(
            torch.zeros(1, 3, 32),
            torch.zeros(1, 3, 32),
            key_cache,
            key_cache.clone(),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            1.0,
        )
    with pytest.raises(contract.KVContractError, match="more than their block count"):
        ops.swap_blocks(
            pool(4, torch.float32, 0), torch.zeros(3, 2, 4, 8, 2, 64), torch.zeros(0, 2, dtype=torch.int64)
        )
