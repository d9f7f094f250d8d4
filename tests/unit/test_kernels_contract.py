"""The KV ops' contract on the CPU path: each gap between `kernels/contract.py` and what the
kernels rely on is refused with a `KVContractError` before anything is written.

tests/gpu/test_kernels_cuda.py holds the same cases on CUDA tensors (the same errors; the
batch-value cases with the setting ``check_cuda_indices``, and as device-side asserts
without it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from shoal.kernels import attention_plan, contract, ops, reference

BLOCK_SIZE = 4


@dataclass(frozen=True)
class Attention:
    """The arguments of one `ops.paged_attention` call."""

    out: torch.Tensor
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def run(self) -> None:
        ops.paged_attention(
            self.out,
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            0.125,
        )


def attention(
    q_lens: list[int], seq_lens: list[int], *, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32
) -> Attention:
    """A valid batch: sequence s owns blocks 2s and 2s + 1 (at most 8 positions)."""
    generator = torch.Generator().manual_seed(0)
    num_blocks = 2 * len(seq_lens) + 1
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator)
    tables = [[2 * seq, 2 * seq + 1] for seq in range(len(seq_lens))]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return Attention(
        out=torch.full_like(query, float("nan")),
        query=query,
        key_cache=torch.randn(cache_shape, generator=generator),
        value_cache=torch.randn(cache_shape, generator=generator),
        block_tables=torch.tensor(tables, dtype=torch.int32).reshape(len(seq_lens), 2),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
    )


def strided(tensor: torch.Tensor) -> torch.Tensor:
    """The same values, not contiguous (every other element of a tensor twice as long)."""
    wide = torch.zeros((*tensor.shape[:-1], 2 * tensor.shape[-1]), dtype=tensor.dtype)
    wide[..., ::2] = tensor
    view = wide[..., ::2]
    assert not view.is_contiguous() and torch.equal(view, tensor)
    return view


def more_rows_than_the_sequences(batch: Attention) -> Attention:
    query = torch.cat([batch.query, batch.query[:1]])  # one row no sequence owns
    return replace(batch, query=query, out=torch.full_like(query, float("nan")))


def query_start_loc_from_one(batch: Attention) -> Attention:
    # 4 rows, query_start_loc [1, 2, 3, 4]: row 0 belongs to no sequence
    return replace(batch, query_start_loc=torch.tensor([1, 2, 3, 4], dtype=torch.int32))


def query_start_loc_decreasing(batch: Attention) -> Attention:
    return replace(batch, query_start_loc=torch.tensor([0, 3, 2, 4], dtype=torch.int32))


# Changes of the valid batch `attention([2, 1, 1], [5, 3, 2])`: (case, change, error).
BATCH_VALUE_GAPS: list[tuple[str, Callable[[Attention], Attention], str]] = [
    ("more query rows than query_start_loc[-1]", more_rows_than_the_sequences, "run from 0 to num_tokens=5"),
    ("query_start_loc[0] != 0", query_start_loc_from_one, r"run from 0 to num_tokens=4 .*got 1 \.\. 4"),
    ("query_start_loc decreasing", query_start_loc_decreasing, "sequence 1: q_len -1 must be in"),
]


@pytest.mark.parametrize(
    ("change", "error"), [case[1:] for case in BATCH_VALUE_GAPS], ids=[case[0] for case in BATCH_VALUE_GAPS]
)
def test_a_batch_whose_rows_do_not_match_its_sequences_is_refused(change, error) -> None:
    batch = change(attention([2, 1, 1], [5, 3, 2]))
    with pytest.raises(contract.KVContractError, match=error):
        batch.run()
    assert batch.out.isnan().all(), "nothing was written"


def test_the_engine_path_refuses_the_same_batches() -> None:
    """`plan_attention` (the CPU engine builds one per pass) runs the same value checks."""
    batch = attention([2, 1], [5, 3])
    tables, lens = batch.block_tables.tolist(), batch.seq_lens.tolist()
    with pytest.raises(contract.KVContractError, match="run from 0 to num_tokens=4"):
        attention_plan.plan_attention(batch.key_cache, tables, lens, [0, 2, 3], num_tokens=4)
    with pytest.raises(contract.KVContractError, match="run from 0"):
        attention_plan.plan_attention(batch.key_cache, tables, lens, [1, 2, 3])
    with pytest.raises(contract.KVContractError, match="sequence 1 needs 3 blocks"):
        attention_plan.plan_attention(batch.key_cache, tables, [5, 9], [0, 2, 3])


def test_head_dims_past_the_cuda_kernels_limit_are_refused_on_the_cpu_too() -> None:
    batch = attention([1, 1], [5, 3], head_dim=contract.MAX_HEAD_DIM + 16)
    with pytest.raises(contract.KVContractError, match=f"head_dim <= {contract.MAX_HEAD_DIM}"):
        batch.run()
    assert batch.out.isnan().all()
    with pytest.raises(contract.KVContractError, match=f"head_dim <= {contract.MAX_HEAD_DIM}"):
        attention_plan.plan_attention(batch.key_cache, [[0, 1], [2, 3]], [5, 3], [0, 1, 2])


def test_the_largest_head_dim_runs_and_matches_the_torch_path() -> None:
    batch = attention([2, 1], [5, 3], head_dim=contract.MAX_HEAD_DIM)
    batch.run()
    expected = torch.empty_like(batch.query)
    reference.paged_attention(
        expected,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        0.125,
    )
    assert torch.equal(batch.out, expected)


@pytest.mark.parametrize("name", ["block_tables", "seq_lens", "query_start_loc"])
def test_non_contiguous_index_tensors_are_refused_by_paged_attention(name) -> None:
    batch = attention([2, 1], [5, 3])
    batch = replace(batch, **{name: strided(getattr(batch, name))})
    with pytest.raises(contract.KVContractError, match=f"{name} must be contiguous"):
        batch.run()
    assert batch.out.isnan().all()


def test_non_contiguous_index_tensors_are_refused_by_the_other_ops() -> None:
    key_cache = torch.zeros(3, BLOCK_SIZE, 2, 32)
    key = torch.randn(3, 2, 32)
    with pytest.raises(contract.KVContractError, match="slot_mapping must be contiguous"):
        ops.write_kv(key, key, key_cache, key_cache.clone(), strided(torch.tensor([0, 5, 9])))
    assert not key_cache.any()
    pool = torch.zeros(2, 2, 6, BLOCK_SIZE, 2, 32)
    mapping = torch.tensor([[0, 1], [2, 3]]).t().contiguous().t()  # (src, dst) pairs, column-major
    assert not mapping.is_contiguous()
    with pytest.raises(contract.KVContractError, match="block_mapping must be contiguous"):
        ops.copy_blocks(pool, mapping)
    with pytest.raises(contract.KVContractError, match="block_mapping must be contiguous"):
        ops.swap_blocks(pool, pool.clone(), mapping)


@pytest.mark.parametrize(
    "cache_shape", [(4, BLOCK_SIZE, 0, 32), (4, 0, 2, 32), (4, BLOCK_SIZE, 2, 0)], ids=["kv_heads", "block", "dim"]
)
def test_a_cache_with_an_empty_dimension_is_refused_not_divided_by(cache_shape) -> None:
    """num_kv_heads == 0 divided by zero in the contract itself; block_size == 0 in the planner."""
    key_cache = torch.zeros(cache_shape)
    num_kv_heads, head_dim = cache_shape[2], cache_shape[3]
    query = torch.zeros(1, 4, head_dim)
    with pytest.raises(contract.KVContractError, match="at least 1"):
        ops.paged_attention(
            query.clone(),
            query,
            key_cache,
            key_cache.clone(),
            torch.zeros(1, 2, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            1.0,
        )
    key = torch.zeros(1, num_kv_heads, head_dim)
    with pytest.raises(contract.KVContractError, match="at least 1"):
        ops.write_kv(key, key, key_cache, key_cache.clone(), torch.zeros(1, dtype=torch.int64))


def test_no_query_heads_or_rows_without_sequences_are_refused() -> None:
    batch = attention([1, 1], [5, 3])
    no_heads = batch.query[:, :0]
    with pytest.raises(contract.KVContractError, match="positive multiple of num_kv_heads"):
        replace(batch, query=no_heads, out=no_heads.clone()).run()
    no_sequences = replace(
        batch,
        block_tables=batch.block_tables[:0],
        seq_lens=batch.seq_lens[:0],
        query_start_loc=batch.query_start_loc[:1],
    )
    with pytest.raises(contract.KVContractError, match="with no sequences the query must have no rows, got 2"):
        no_sequences.run()
    assert batch.out.isnan().all()
