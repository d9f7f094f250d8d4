"""The CUDA kernels on the shapes and sizes a first GPU machine must check (issue 13): forced
partitions crossed with head chunks and odd head dims, peaked attention against float64, a
cache past 2^31 elements, a realistic serving batch, and CUDA-graph capture on the current
stream. Skipped without CUDA; the partition plan itself is tested on the CPU
(tests/unit/test_kernels_partitions.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from shoal.kernels import cuda_ext, ops, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    cuda_ext.load_extension()


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _batch(q_lens: list[int], seq_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int,
           head_dim: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """[query, key_cache, value_cache, block_tables, seq_lens, query_start_loc] on the CPU,
    blocks in random pool order."""
    rng = random.Random(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    key_cache = _values((num_blocks, block_size, num_kv_heads, head_dim), dtype, seed)
    value_cache = _values((num_blocks, block_size, num_kv_heads, head_dim), dtype, seed + 1)
    free = list(range(num_blocks))
    rng.shuffle(free)
    block_tables = torch.zeros((len(seq_lens), max(blocks_per_seq, default=0) + 1), dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor([free.pop() for _ in range(count)], dtype=torch.int32)
    query = _values((sum(q_lens), num_heads, head_dim), dtype, seed + 2)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return [query, key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), starts]


def _expected(batch: list[torch.Tensor], scale: float) -> torch.Tensor:
    expected = torch.empty_like(batch[0])
    reference.paged_attention(expected, *batch, scale)
    return expected


@pytest.mark.parametrize("partition_length", [0, 64, 256, 1 << 20])  # planned, small, the default, one
@pytest.mark.parametrize("heads", [(64, 4), (40, 2), (32, 8)])  # 2, 3 and 1 head chunks of <= 8
@pytest.mark.parametrize("head_dim", [80, 96])
def test_forced_partitions_with_head_chunks_and_odd_head_dims(partition_length, heads, head_dim) -> None:
    q_lens = [1, 1, 5, 1, 17, 1]
    seq_lens = [3000, 1, 700, 257, 1200, 64]
    batch = _batch(q_lens, seq_lens, 16, *heads, head_dim, torch.bfloat16, seed=head_dim + heads[0])
    scale = head_dim**-0.5
    expected = _expected(batch, scale)
    query, *rest = (tensor.cuda() for tensor in batch)
    out = torch.full_like(query, float("nan"))
    cuda_ext.load_extension().paged_attention(out, query, *rest, scale, partition_length=partition_length)
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_length", [0, 128])
def test_peaked_attention_matches_float64_without_inf_or_nan(dtype, partition_length) -> None:
    """One position's key matches the query far above all others (a "needle"): the softmax
    is nearly one-hot, with logits in the hundreds, where a wrong running max overflows."""
    num_heads, num_kv_heads, head_dim, context = 8, 2, 128, 4000
    batch = _batch([1, 1], [context, 1500], 16, num_heads, num_kv_heads, head_dim, dtype, seed=9)
    query, key_cache, value_cache, block_tables, _, _ = batch
    needle = 3333
    block, offset = int(block_tables[0, needle // 16]), needle % 16
    for kv_head in range(num_kv_heads):
        key_cache[block, offset, kv_head] = (query[0, kv_head * 4] * 16).to(dtype)  # logit ~ 16 |q|^2 / sqrt(d)
    scale = head_dim**-0.5
    # float64 reference: gather sequence 0's K/V and attend.
    positions = torch.arange(context)
    rows = block_tables[0, positions // 16].long() * 16 + positions % 16
    keys = key_cache.reshape(-1, num_kv_heads, head_dim)[rows].double()
    vals = value_cache.reshape(-1, num_kv_heads, head_dim)[rows].double()
    q = query[0].double().view(num_kv_heads, 4, head_dim)
    scores = torch.einsum("kgd,pkd->kgp", q, keys) * scale
    expected = torch.einsum("kgp,pkd->kgd", scores.softmax(-1), vals).reshape(num_heads, head_dim)
    assert scores.max() > 100, "the needle dominates"

    gpu = [tensor.cuda() for tensor in batch]
    out = torch.full_like(gpu[0], float("nan"))
    cuda_ext.load_extension().paged_attention(out, *gpu, scale, partition_length=partition_length)
    result = out.cpu().double()
    assert torch.isfinite(result).all()
    torch.testing.assert_close(result[0], expected, atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype] * 4)


def test_a_cache_past_two_to_the_31_elements_is_written_and_read_at_its_last_blocks() -> None:
    block_size, num_kv_heads, head_dim = 16, 8, 128
    num_blocks = (1 << 31) // (block_size * num_kv_heads * head_dim) + 64  # 2^31 + 1M elements per cache
    needed = 2 * num_blocks * block_size * num_kv_heads * head_dim * 2  # bf16 K and V
    free_bytes, _ = torch.cuda.mem_get_info()
    if needed > 0.9 * free_bytes:
        pytest.skip(f"needs {needed / 2**30:.1f} GiB of GPU memory")
    key_cache = torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.bfloat16, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    assert key_cache.numel() > 1 << 31
    seq_len = 100
    last_blocks = torch.arange(num_blocks - 7, num_blocks, dtype=torch.int32)  # 7 blocks: 112 slots
    slots = (last_blocks.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]
    key = _values((seq_len, num_kv_heads, head_dim), torch.bfloat16, 1)
    value = _values((seq_len, num_kv_heads, head_dim), torch.bfloat16, 2)
    ops.write_kv(key.cuda(), value.cuda(), key_cache, value_cache, slots.cuda())
    assert torch.equal(key_cache[num_blocks - 1, : seq_len - 6 * block_size].cpu(), key[6 * block_size :])
    query = _values((1, 32, head_dim), torch.bfloat16, 3)
    out = torch.full_like(query, float("nan")).cuda()
    tables = last_blocks.view(1, -1)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    ops.paged_attention(out, query.cuda(), key_cache, value_cache, tables.cuda(), lens.cuda(), starts.cuda(),
                        head_dim**-0.5)
    small_keys = key_cache[last_blocks.long()].cpu()  # the same 7 blocks as a small cache
    small_values = value_cache[last_blocks.long()].cpu()
    expected = torch.empty_like(query)
    reference.paged_attention(expected, query, small_keys, small_values, torch.arange(7, dtype=torch.int32)[None],
                              lens, starts, head_dim**-0.5)
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads", [(32, 8), (28, 4)])
def test_a_realistic_serving_batch(heads) -> None:
    """256 decode rows of random lengths up to 4K, with two chunked-prefill rows over a prefix."""
    rng = random.Random(11)
    seq_lens = [rng.randint(1, 4096) for _ in range(256)] + [2048 + 512, 700]
    q_lens = [1] * 256 + [512, 300]
    batch = _batch(q_lens, seq_lens, 16, *heads, 128, torch.bfloat16, seed=heads[1])
    scale = 128**-0.5
    expected = _expected(batch, scale)
    query, *rest = (tensor.cuda() for tensor in batch)
    out = torch.full_like(query, float("nan"))
    ops.paged_attention(out, query, *rest, scale)
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_decode_steps_capture_in_a_cuda_graph_and_replay_on_new_inputs() -> None:
    """CUDA-graph capture runs on a side stream: a kernel launched on the default stream
    instead of the current one breaks the capture (an error), and a kernel that read host
    values at capture would replay stale ones (wrong output)."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    batch = _batch([1] * 4, [100, 37, 513, 1990], block_size, num_heads, num_kv_heads, head_dim,
                   torch.float16, seed=21)
    query, key_cache, value_cache, block_tables, seq_lens, starts = (tensor.cuda() for tensor in batch)
    new_key = torch.zeros((4, num_kv_heads, head_dim), dtype=torch.float16, device="cuda")
    new_value = torch.zeros_like(new_key)
    slots = torch.zeros(4, dtype=torch.int64, device="cuda")
    out = torch.empty_like(query)
    scale = head_dim**-0.5

    def step() -> None:
        ops.write_kv(new_key, new_value, key_cache, value_cache, slots)
        ops.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, starts, scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture (workspace allocations)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for round_ in range(3):  # new tokens: one more position per sequence, new values everywhere
        seq_lens += 1
        last = seq_lens.long() - 1
        slots.copy_(block_tables.gather(1, (last // block_size)[:, None]).flatten().long() * block_size
                    + last % block_size)
        new_key.copy_(_values(tuple(new_key.shape), torch.float16, 100 + round_).cuda())
        new_value.copy_(_values(tuple(new_value.shape), torch.float16, 200 + round_).cuda())
        query.copy_(_values(tuple(query.shape), torch.float16, 300 + round_).cuda())
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.empty_like(query).cpu()
        reference.paged_attention(expected, query.cpu(), key_cache.cpu(), value_cache.cpu(), block_tables.cpu(),
                                  seq_lens.cpu(), starts.cpu(), scale)
        torch.testing.assert_close(out.cpu().float(), expected.float(), atol=2e-3, rtol=2e-3)
        assert torch.equal(key_cache.view(-1, num_kv_heads, head_dim)[slots].cpu(), new_key.cpu())
