"""The kernels' path of a pass (what CUDA runs), on the CPU: decode rows on the paged op,
prefill rows on SDPA, equal to `paged_attention` over the whole batch."""

from __future__ import annotations

import random

import pytest
import torch

from shoal.kernels import ops
from shoal.services.worker.engine.device_batch import StagingBuffers, build_device_batch, run_device_attention

CPU = torch.device("cpu")


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_on_the_paged_op_and_prefill_on_sdpa_equal_paged_attention(heads, dtype) -> None:
    num_heads, num_kv_heads = heads
    head_dim, block_size = 32, 4
    rng = random.Random(0)
    # decode rows first (as the runner lays them out), then a fresh prompt, a prompt over a
    # cached prefix, and a chunk in the middle of a long prompt
    q_lens = [1, 1, 1, 13, 5, 8]
    seq_lens = [9, 1, 30, 13, 21, 40]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    generator = torch.Generator().manual_seed(1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    num_tokens = sum(q_lens)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    slots = []
    for table, q_len, seq_len in zip(tables, q_lens, seq_lens, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
    query = torch.randn((num_tokens, num_heads, head_dim), generator=generator).to(dtype)
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=generator).to(dtype)
    value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=generator).to(dtype)
    scale = head_dim**-0.5

    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    ops.write_kv(key, value, expected_keys, expected_values, torch.tensor(slots))
    width = max(len(t) for t in tables)
    expected = torch.empty_like(query)
    ops.paged_attention(
        expected, query, expected_keys, expected_values,
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), scale,
    )

    staging = StagingBuffers(pinned=False)
    staging.begin_pass()
    batch = build_device_batch(staging, [CPU], slots, tables, seq_lens, starts)
    staging.end_pass()
    assert batch.num_decode_rows == 3
    assert [(p.start, p.num_queries, p.seq_len) for p in batch.prefills] == [(3, 13, 13), (16, 5, 21), (21, 8, 40)]
    assert [ids is None for ids in batch.on(CPU).prefill_block_ids] == [True, False, False]
    out = torch.full_like(query, float("nan"))
    run_device_attention(out, query, key, value, key_cache, value_cache, batch, scale, 0)
    assert torch.equal(key_cache, expected_keys) and torch.equal(value_cache, expected_values)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


def test_a_pass_without_decode_rows_or_without_prefills() -> None:
    staging = StagingBuffers(pinned=False)
    only_prefill = build_device_batch(staging, [CPU], list(range(6)), [[0, 1]], [6], [0, 6])
    assert only_prefill.num_decode_rows == 0 and only_prefill.on(CPU).block_tables.shape == (0, 0)
    only_decode = build_device_batch(staging, [CPU], [3, 9], [[0], [2, 5]], [4, 6], [0, 1, 2])
    assert only_decode.num_decode_rows == 2 and not only_decode.prefills
    assert only_decode.on(CPU).block_tables.tolist() == [[0, 0], [2, 5]]
    assert only_decode.on(CPU).query_start_loc.tolist() == [0, 1, 2]


def test_decode_rows_after_a_prefill_are_refused() -> None:
    with pytest.raises(AssertionError, match="decode rows come first"):
        build_device_batch(StagingBuffers(pinned=False), [CPU], [0, 1, 2], [[0], [1]], [2, 5], [0, 2, 3])


def test_every_device_gets_its_own_index_tensors() -> None:
    devices = [torch.device("cpu", 0), torch.device("cpu", 1)]  # two labels: the per-device bookkeeping
    batch = build_device_batch(StagingBuffers(pinned=False), [devices[0], devices[1], devices[1]], [3, 9],
                               [[0], [2, 5]], [4, 6], [0, 1, 2])
    assert set(batch.indexes) == set(devices)
    assert batch.for_layer(0) is batch.on(devices[0]) and batch.for_layer(2) is batch.on(devices[1])
