"""The native forward's tiled causal attention (kernels/csrc/cpu_prefill_attention.c) against
a float64 torch reference: random head shapes (GQA included), sequences whose query rows
cross the kernel's 32-row and 32-position tiles, prefixes already in the pool, several
sequences (decode rows among them) in one batch, blocks scattered in the pool; every code
path this CPU has, and the same bits on any thread count. The whole pass with it, against
transformers: test_native_forward.py and test_engine_correctness.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.kernels import cpu_kernels
from shoal.kernels.cpu_model import ISA_NAMES, PrefillPlan, get_gemm_isa


def reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: list[list[int]],
    seq_lens: list[int],
    starts: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention in float64, each sequence's K/V gathered from its blocks."""
    num_tokens, num_heads, head_dim = query.shape
    group = num_heads // key_cache.shape[2]
    block_size = key_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    for seq, seq_len in enumerate(seq_lens):
        first, last = starts[seq], starts[seq + 1]
        slots = [tables[seq][p // block_size] * block_size + p % block_size for p in range(seq_len)]
        keys = key_cache.reshape(-1, *key_cache.shape[2:])[slots].double().repeat_interleave(group, dim=1)
        values = value_cache.reshape(-1, *value_cache.shape[2:])[slots].double().repeat_interleave(group, dim=1)
        q = query[first:last].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        positions = torch.arange(seq_len - (last - first), seq_len)
        scores.masked_fill_(torch.arange(seq_len)[None, :] > positions[:, None], float("-inf"))
        out[first:last] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
    return out


@settings(max_examples=40, deadline=None)
@given(
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([16, 32, 48, 64, 80]),
    block_size=st.integers(1, 16),
    shapes=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 80)), min_size=1, max_size=4),
    seed=st.integers(0, 2**31),
)
def test_causal_attention_matches_torch_on_every_code_path_and_thread_count(
    native: cpu_kernels.CpuKernels,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    shapes: list[tuple[int, int]],
    seed: int,
) -> None:
    """shapes: each sequence's (prefix already in the pool, query rows)."""
    generator = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    seq_lens = [prefix + rows for prefix, rows in shapes]
    starts = [0]
    for _, rows in shapes:
        starts.append(starts[-1] + rows)
    blocks_each = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_each) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()  # blocks scattered in the pool
    tables, used = [], 0
    for count in blocks_each:
        tables.append(order[used : used + count])
        used += count
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=generator) * 2
    scale = head_dim**-0.5
    plan = PrefillPlan.build(native, key_cache, tables, seq_lens, starts)
    assert plan is not None
    expected = reference(query, key_cache, value_cache, tables, seq_lens, starts, scale)
    for isa in range(get_gemm_isa(native) + 1):
        one_thread = torch.full_like(query, float("nan"))
        plan.run(one_thread, query, key_cache, value_cache, scale, isa=isa)
        torch.testing.assert_close(one_thread.double(), expected, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, isa=isa: f"{ISA_NAMES[isa]}: {m}")
        two_threads = torch.full_like(query, float("nan"))
        plan.run(two_threads, query, key_cache, value_cache, scale, isa=isa, num_threads=2)
        assert torch.equal(two_threads, one_thread), "an item is computed by one thread, in one order"


def test_a_plan_that_does_not_cover_the_batch_is_refused(native: cpu_kernels.CpuKernels) -> None:
    key_cache = torch.zeros(4, 4, 1, 16)
    plan = PrefillPlan.build(native, key_cache, [[0, 1]], [6], [0, 3])
    assert plan is not None
    with pytest.raises(ValueError, match="does not fit"):  # 4 query rows, the plan has 3
        plan.run(torch.empty(4, 1, 16), torch.zeros(4, 1, 16), key_cache, key_cache.clone(), 0.25)
    too_long = PrefillPlan.build(native, key_cache, [[0, 1]], [6], [0, 7])  # 7 query rows of 6 positions
    assert too_long is not None
    with pytest.raises(ValueError, match="does not fit"):
        too_long.run(torch.empty(7, 1, 16), torch.zeros(7, 1, 16), key_cache, key_cache.clone(), 0.25)
