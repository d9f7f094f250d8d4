"""Shoal's CUDA kernels against the CPU implementation (the reference), on real GPUs."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections.abc import Iterator

import msgspec
import pytest
import torch

from shoal.kernels import contract, cuda_ext, ops, reference
from shoal.kernels.settings import configure, get_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    """Builds the extension once, so a build failure fails here with the compiler's message."""
    cuda_ext.load_extension()


def values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def token_strided(tensor: torch.Tensor) -> torch.Tensor:
    """The same values with an arbitrary token stride (a transposed projection)."""
    return tensor.transpose(0, 1).contiguous().transpose(0, 1)


# --- write_kv ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("strided", [False, True])
def test_write_kv_matches_cpu(dtype, block_size, strided) -> None:
    num_tokens, num_kv_heads, head_dim = 300, 4, 128
    num_blocks = math.ceil(num_tokens / block_size) + 8
    key = values((num_tokens, num_kv_heads, head_dim), dtype, 1)
    value = values((num_tokens, num_kv_heads, head_dim), dtype, 2)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(3))[:num_tokens]
    slots[::7] = -1
    key_cache = values((num_blocks, block_size, num_kv_heads, head_dim), dtype, 4)
    value_cache = values((num_blocks, block_size, num_kv_heads, head_dim), dtype, 5)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    reference.write_kv(key, value, expected_key, expected_value, slots)

    gpu_key_cache, gpu_value_cache = key_cache.cuda(), value_cache.cuda()
    gpu_key, gpu_value = key.cuda(), value.cuda()
    if strided:
        gpu_key, gpu_value = token_strided(gpu_key), token_strided(gpu_value)
        assert gpu_key.stride(0) != num_kv_heads * head_dim
    ops.write_kv(gpu_key, gpu_value, gpu_key_cache, gpu_value_cache, slots.cuda())

    assert torch.equal(gpu_key_cache.cpu(), expected_key)
    assert torch.equal(gpu_value_cache.cpu(), expected_value)


def test_write_kv_with_misaligned_rows_uses_narrow_copies() -> None:
    wide = values((20, 2, 33), torch.float16, 1).cuda()
    key = wide[:, :, 1:]  # 2-byte aligned only
    key_cache = torch.zeros(4, 8, 2, 32, dtype=torch.float16, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    slots = torch.arange(20, device="cuda") + 5
    ops.write_kv(key, key, key_cache, value_cache, slots)
    expected = torch.zeros(4, 8, 2, 32, dtype=torch.float16)
    reference.write_kv(key.cpu(), key.cpu(), expected, expected.clone(), slots.cpu())
    assert torch.equal(key_cache.cpu(), expected)


def test_write_kv_with_no_tokens_is_a_no_op() -> None:
    key_cache = torch.zeros(2, 4, 1, 32, device="cuda")
    empty = torch.empty(0, 1, 32, device="cuda")
    ops.write_kv(empty, empty, key_cache, key_cache.clone(), torch.empty(0, dtype=torch.int64, device="cuda"))
    assert not key_cache.any()


# --- paged_attention ---------------------------------------------------------


def attention_batch(q_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed):
    rng = random.Random(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    key_cache = values((num_blocks, block_size, num_kv_heads, head_dim), dtype, seed)
    value_cache = values((num_blocks, block_size, num_kv_heads, head_dim), dtype, seed + 1)
    free = list(range(num_blocks))
    rng.shuffle(free)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq, default=0) + 1), -1, dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor([free.pop() for _ in range(count)], dtype=torch.int32)
    query = values((sum(q_lens), num_heads, head_dim), dtype, seed + 2)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), starts


def compare_attention(q_lens, seq_lens, block_size, heads, head_dim, dtype, seed=0, strided=False) -> None:
    num_heads, num_kv_heads = heads
    batch = attention_batch(q_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed)
    query = batch[0]
    scale = head_dim**-0.5
    expected = torch.empty_like(query)
    reference.paged_attention(expected, *batch, scale)

    gpu_query, *gpu_rest = (tensor.cuda() for tensor in batch)
    if strided:
        gpu_query = token_strided(gpu_query)
    out = torch.full_like(gpu_query, float("nan"))
    ops.paged_attention(out, gpu_query, *gpu_rest, scale)
    torch.testing.assert_close(
        out.cpu().float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (14, 2), (32, 4), (16, 1)])
def test_decode_batch(dtype, heads) -> None:
    seq_lens = [1, 15, 16, 17, 100, 513, 1000]
    compare_attention([1] * len(seq_lens), seq_lens, 16, heads, 128, dtype, seed=1)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_head_dims(head_dim, dtype) -> None:
    q_lens = [1, 0, 37, 1, 12, 0, 64]
    seq_lens = [40, 5, 37, 1, 300, 0, 64]
    compare_attention(q_lens, seq_lens, 16, (8, 2), head_dim, dtype, seed=head_dim, strided=True)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_prefill_over_a_cached_prefix(block_size) -> None:
    compare_attention([9, 33, 2], [70, 33, 129], block_size, (8, 4), 64, torch.bfloat16, seed=block_size)


def test_long_context_decode_splits_the_context() -> None:
    compare_attention([1, 1], [8192, 3001], 16, (32, 8), 128, torch.float16, seed=5)


def test_split_context_with_short_rows_and_a_prefill() -> None:
    """Rows far shorter than the widest block table use only their first partitions."""
    compare_attention([1, 1, 3, 1], [6000, 20, 700, 1], 16, (8, 1), 64, torch.float32, seed=6)


# --- copy_blocks / swap_blocks -----------------------------------------------


def pool(num_blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return values((4, 2, num_blocks, 16, 4, 64), dtype, seed)


def pairs(num_src: int, num_dst: int, count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.stack(
        [
            torch.randperm(num_src, generator=generator)[:count],
            torch.randperm(num_dst, generator=generator)[:count],
        ],
        dim=1,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_cpu(dtype) -> None:
    kv_cache = pool(128, dtype, 0)
    ids = torch.randperm(128, generator=torch.Generator().manual_seed(1))
    mapping = torch.stack([ids[:50], ids[50:100]], dim=1)
    expected = kv_cache.clone()
    reference.copy_blocks(expected, mapping)
    gpu_cache = kv_cache.cuda()
    ops.copy_blocks(gpu_cache, mapping.cuda())
    assert torch.equal(gpu_cache.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_out_and_in_through_pinned_memory(dtype) -> None:
    gpu_pool = pool(96, dtype, 0).cuda()
    host_pool = pool(200, dtype, 1).pin_memory()
    out_mapping = pairs(96, 200, 70, seed=2)
    expected_host = host_pool.clone()
    reference.swap_blocks(gpu_pool.cpu(), expected_host, out_mapping)
    ops.swap_blocks(gpu_pool, host_pool, out_mapping)  # CPU mapping: moved to the device by ops
    torch.cuda.synchronize()
    assert torch.equal(host_pool, expected_host)

    in_mapping = pairs(200, 96, 40, seed=3)
    expected_gpu = gpu_pool.cpu()
    reference.swap_blocks(host_pool, expected_gpu, in_mapping)
    ops.swap_blocks(host_pool, gpu_pool, in_mapping.cuda())
    assert torch.equal(gpu_pool.cpu(), expected_gpu)


def test_swap_between_device_pools() -> None:
    src, dst = pool(30, torch.float16, 0).cuda(), pool(40, torch.float16, 1).cuda()
    mapping = pairs(30, 40, 25, seed=4)
    expected = dst.cpu()
    reference.swap_blocks(src.cpu(), expected, mapping)
    ops.swap_blocks(src, dst, mapping)
    assert torch.equal(dst.cpu(), expected)


def test_swap_refuses_pageable_host_memory() -> None:
    with pytest.raises(RuntimeError, match="pinned"):
        ops.swap_blocks(pool(4, torch.float32, 0).cuda(), pool(4, torch.float32, 1), pairs(4, 4, 2, 0))


def test_kernels_run_on_the_current_stream() -> None:
    kv_cache = pool(64, torch.float32, 0).cuda()
    sources = torch.randperm(32, generator=torch.Generator().manual_seed(5))[:20]
    mapping = torch.stack([sources, torch.arange(32, 52)], dim=1)  # sources < 32 <= destinations
    expected = kv_cache.cpu()
    reference.copy_blocks(expected, mapping)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.copy_blocks(kv_cache, mapping.cuda())
    stream.synchronize()
    assert torch.equal(kv_cache.cpu(), expected)


# --- the contract: the CPU path's answers (tests/unit/test_kernels_contract.py) -----


@pytest.fixture
def check_cuda_indices() -> Iterator[None]:
    """The debug setting on for one test: batch values are checked on the host."""
    previous = get_settings()
    configure(msgspec.structs.replace(previous, check_cuda_indices=True))
    yield
    configure(previous)


def small_batch(q_lens: list[int], seq_lens: list[int], head_dim: int = 32) -> list[torch.Tensor]:
    """[out (NaN), query, key_cache, value_cache, block_tables, seq_lens, query_start_loc] on CUDA."""
    query, *rest = attention_batch(q_lens, seq_lens, 4, 4, 2, head_dim, torch.float32, seed=0)
    return [tensor.cuda() for tensor in (torch.full_like(query, float("nan")), query, *rest)]


def strided(tensor: torch.Tensor) -> torch.Tensor:
    """The same values, not contiguous."""
    wide = torch.zeros((*tensor.shape[:-1], 2 * tensor.shape[-1]), dtype=tensor.dtype, device=tensor.device)
    wide[..., ::2] = tensor
    return wide[..., ::2]


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda b: small_batch([1, 1], [5, 3], head_dim=272), "head_dim <= 256"),
        (lambda b: [*b[:4], strided(b[4]), *b[5:]], "block_tables must be contiguous"),
        (lambda b: [*b[:5], strided(b[5]), b[6]], "seq_lens must be contiguous"),
        (lambda b: [*b[:6], strided(b[6])], "query_start_loc must be contiguous"),
        (lambda b: [*b[:4], b[4][:0], b[5][:0], b[6][:1]], "with no sequences the query must have no rows"),
    ],
    ids=["head_dim>256", "block_tables", "seq_lens", "query_start_loc", "rows without sequences"],
)
def test_shape_gaps_are_refused_before_the_launch(change, error) -> None:
    batch = change(small_batch([2, 1], [5, 3]))
    with pytest.raises(contract.KVContractError, match=error):
        ops.paged_attention(*batch, 0.125)
    assert batch[0].isnan().all()


def test_a_cache_without_kv_heads_is_refused_not_divided_by() -> None:
    key_cache = torch.zeros(4, 4, 0, 32, device="cuda")
    query = torch.zeros(1, 4, 32, device="cuda")
    index = [torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.tensor([0, 1])]
    with pytest.raises(contract.KVContractError, match="at least 1"):
        ops.paged_attention(query.clone(), query, key_cache, key_cache.clone(), *(t.int().cuda() for t in index), 1.0)
    key = torch.zeros(1, 0, 32, device="cuda")
    with pytest.raises(contract.KVContractError, match="at least 1"):
        ops.write_kv(key, key, key_cache, key_cache.clone(), torch.zeros(1, dtype=torch.int64, device="cuda"))


# Changes of the valid batch `small_batch([2, 1, 1], [5, 3, 2])` (4 rows): (query rows,
# query_start_loc, the CPU path's error).
BATCH_VALUE_GAPS = {
    "more query rows than query_start_loc[-1]": (5, [0, 2, 3, 4], "run from 0 to num_tokens=5"),
    "query_start_loc[0] != 0": (4, [1, 2, 3, 4], r"run from 0 to num_tokens=4 .*got 1 \.\. 4"),
    "query_start_loc decreasing": (4, [0, 3, 2, 4], "sequence 1: q_len -1 must be in"),
}


def broken_batch(num_rows: int, query_start_loc: list[int]) -> list[torch.Tensor]:
    _, query, key_cache, value_cache, block_tables, seq_lens, _ = small_batch([2, 1, 1], [5, 3, 2])
    query = torch.cat([query, query])[:num_rows]
    starts = torch.tensor(query_start_loc, dtype=torch.int32, device="cuda")
    return [torch.full_like(query, float("nan")), query, key_cache, value_cache, block_tables, seq_lens, starts]


@pytest.mark.parametrize("case", list(BATCH_VALUE_GAPS))
def test_batch_value_gaps_are_refused_in_debug_mode_as_on_the_cpu(case, check_cuda_indices) -> None:
    num_rows, starts, error = BATCH_VALUE_GAPS[case]
    batch = broken_batch(num_rows, starts)
    with pytest.raises(contract.KVContractError, match=error):
        ops.paged_attention(*batch, 0.125)
    assert batch[0].isnan().all()
    cpu_batch = [tensor.cpu() for tensor in batch]
    with pytest.raises(contract.KVContractError, match=error):
        ops.paged_attention(*cpu_batch, 0.125)


def test_debug_mode_leaves_valid_batches_alone(check_cuda_indices) -> None:
    compare_attention([1, 0, 37, 1, 12], [40, 5, 37, 1, 300], 16, (8, 2), 64, torch.bfloat16, seed=7)


_ASSERT_SCRIPT = """
import sys
import torch
from shoal.kernels import ops
num_rows, starts = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")]
cache = torch.randn(8, 4, 2, 32, device="cuda")
tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32, device="cuda")
query = torch.randn(num_rows, 4, 32, device="cuda")
ops.paged_attention(
    torch.empty_like(query), query, cache, cache.clone(), tables,
    torch.tensor([5, 3, 2], dtype=torch.int32, device="cuda"),
    torch.tensor(starts, dtype=torch.int32, device="cuda"), 0.125,
)
torch.cuda.synchronize()
"""


@pytest.mark.parametrize("case", list(BATCH_VALUE_GAPS))
def test_batch_value_gaps_stop_the_kernel_without_debug_mode(case) -> None:
    """Without the host checks the kernel's device-side assert stops it, which leaves the
    process's CUDA context unusable: each case runs in its own process."""
    num_rows, starts, _ = BATCH_VALUE_GAPS[case]
    result = subprocess.run(
        [sys.executable, "-c", _ASSERT_SCRIPT, str(num_rows), ",".join(map(str, starts))],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode != 0, result.stdout
    assert "query_start_loc" in result.stderr and "device-side assert" in result.stderr, result.stderr[-2000:]
