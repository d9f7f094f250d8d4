"""The native CPU decode attention (kernels/csrc/cpu_attention.c) against a float64
reference written here, on both of its code paths (baseline and AVX2), and the torch
path serving, with the same results, wherever the native one does not run."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from shoal.kernels import attention_plan, cpu_build, cpu_kernels, ops, reference
from shoal.kernels.settings import KernelSettings

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)



def isas(native: cpu_kernels.CpuKernels) -> list[int]:
    """The kernel's code paths this CPU runs."""
    if native.attention_isa == cpu_kernels.ISA_AVX2:
        return [cpu_kernels.ISA_BASELINE, cpu_kernels.ISA_AVX2]
    return [cpu_kernels.ISA_BASELINE]


@pytest.fixture(params=[cpu_kernels.ISA_BASELINE, cpu_kernels.ISA_AVX2], ids=["baseline", "avx2"])
def isa(request: pytest.FixtureRequest, native: cpu_kernels.CpuKernels) -> int:
    """Each code path of the kernel (AVX2 skipped on a CPU without it)."""
    if request.param not in isas(native):
        pytest.skip("this CPU has no AVX2")
    return int(request.param)


@pytest.fixture
def process_choice() -> Iterator[None]:
    """Restores this process's choice of implementation after a test that changes it."""
    previous = cpu_kernels.try_load()
    yield
    cpu_kernels.use(previous)


# --- a batch and its float64 reference ----------------------------------------------------


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: list[list[int]]
    seq_lens: list[int]
    rows: list[int]
    """Each sequence's query row; the other rows of `query` decode nothing."""


def make_batch(
    seq_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    *,
    query_layout: str = "contiguous",
) -> Batch:
    """A filled cache with shuffled blocks, tables padded with ids past the pool and negative
    ones (never read), and decoding rows scattered among idle ones."""
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(count)] + [-1, num_blocks + 7] for count in blocks_per_seq]
    num_tokens = len(seq_lens) + 2
    query = (2 * torch.randn((num_tokens, num_heads, head_dim), generator=generator)).to(dtype)
    if query_layout == "head_major":  # [heads, tokens, D] transposed: token stride head_dim
        query = query.transpose(0, 1).contiguous().transpose(0, 1)
    elif query_layout == "token_strided":  # rows of a wider tensor, as a fused QKV projection's
        wide = torch.empty((num_tokens, 3 * num_heads, head_dim), dtype=dtype)
        wide[:, num_heads : 2 * num_heads] = query
        query = wide[:, num_heads : 2 * num_heads]
    rows = rng.sample(range(num_tokens), len(seq_lens))
    return Batch(query, key_cache, value_cache, tables, seq_lens, rows)


def naive_attention(batch: Batch, scale: float) -> torch.Tensor:
    """Each sequence's row attended over its context, in float64 (other rows zero)."""
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    block_size, num_kv_heads = batch.key_cache.shape[1], batch.key_cache.shape[2]
    group = batch.query.shape[1] // num_kv_heads
    for table, seq_len, row in zip(batch.block_tables, batch.seq_lens, batch.rows, strict=True):
        positions = torch.arange(seq_len)
        blocks = torch.tensor(table)[positions // block_size]
        keys = batch.key_cache[blocks, positions % block_size].double()  # [seq_len, kv_heads, D]
        values = batch.value_cache[blocks, positions % block_size].double()
        for head in range(batch.query.shape[1]):
            scores = keys[:, head // group] @ batch.query[row, head].double() * scale
            out[row, head] = torch.softmax(scores, dim=0) @ values[:, head // group]
    return out


def run_native(
    kernels: cpu_kernels.CpuKernels, batch: Batch, scale: float, isa: int = cpu_kernels.ISA_BEST
) -> torch.Tensor:
    plan = kernels.plan_decode(batch.key_cache, batch.block_tables, batch.seq_lens, batch.rows)
    assert plan is not None
    out = torch.full_like(batch.query, float("nan"))
    assert plan.run(out, batch.query, batch.key_cache, batch.value_cache, scale, isa=isa)
    return out


def check(kernels: cpu_kernels.CpuKernels, batch: Batch, isa: int, scale: float | None = None) -> None:
    """The native result against the reference; rows that do not decode stay untouched."""
    head_dim = batch.query.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = run_native(kernels, batch, scale, isa)
    expected = naive_attention(batch, scale)
    tolerance = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out[batch.rows].double(), expected[batch.rows], atol=tolerance, rtol=tolerance)
    idle = [row for row in range(out.shape[0]) if row not in batch.rows]
    assert out[idle].isnan().all()


# --- against the reference ----------------------------------------------------------------

LONG_LENS = [1, 15, 16, 17, 31, 32, 33, 64, 65, 500, 1100]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("head_dim", (32, 64, 128, 256))
@pytest.mark.parametrize("group", (1, 2, 4, 8))
def test_gqa_ratios_and_head_dims_over_long_contexts(native, group, head_dim, dtype, isa) -> None:
    """Contexts of 1 to 1100 tokens (tiles of 32, blocks of 16: both boundaries)."""
    num_kv_heads = 2
    batch = make_batch(LONG_LENS, 16, group * num_kv_heads, num_kv_heads, head_dim, dtype, seed=group + head_dim)
    check(native, batch, isa)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", (1, 8, 16, 32))
def test_block_sizes_and_dtypes(native, block_size, dtype, isa) -> None:
    batch = make_batch([1, 7, 33, 64, 20, 130], block_size, 8, 2, 64, dtype, seed=block_size)
    check(native, batch, isa)


@pytest.mark.parametrize("heads", [(3, 1), (5, 1), (6, 2), (7, 7), (12, 4), (16, 1), (24, 2), (32, 8)])
def test_groups_that_split_into_subgroups(native, heads, isa) -> None:
    """Query heads per kv head that are not 1, 2, 4 or 8: subgroups of 8, 4, 2, 1."""
    batch = make_batch([1, 40, 77], 8, heads[0], heads[1], 32, torch.float32, seed=heads[0])
    check(native, batch, isa)


@pytest.mark.parametrize("layout", ["head_major", "token_strided"])
def test_strided_queries(native, layout) -> None:
    batch = make_batch([5, 90], 16, 8, 2, 64, torch.bfloat16, seed=3, query_layout=layout)
    check(native, batch, cpu_kernels.ISA_BEST)


def test_scores_far_apart_stay_finite(native) -> None:
    """Large scores (the running max moves by hundreds across tiles) and a scale other than
    head_dim ** -0.5: the online softmax rescales without overflow or lost weight."""
    batch = make_batch([300], 16, 4, 2, 64, torch.float32, seed=1)
    batch.query.mul_(30.0)
    for isa in isas(native):
        check(native, batch, isa, scale=0.3)


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from((1, 4, 8, 16, 32)),
    num_kv_heads=st.integers(1, 4),
    group=st.sampled_from((1, 2, 3, 4, 5, 8, 16)),
    head_dim=st.sampled_from((16, 32, 48, 64, 80, 96, 128, 256)),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(("contiguous", "head_major", "token_strided")),
    seed=st.integers(0, 2**16),
)
def test_random_batches(native, data, block_size, num_kv_heads, group, head_dim, dtype, layout, seed) -> None:
    seq_lens = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
    isa = data.draw(st.sampled_from(isas(native)))
    batch = make_batch(
        seq_lens, block_size, group * num_kv_heads, num_kv_heads, head_dim, dtype, seed, query_layout=layout
    )
    check(native, batch, isa)


def test_both_code_paths_agree_closely(native) -> None:
    """The AVX2 path fuses products and sums, the baseline does not: last bits only."""
    if cpu_kernels.ISA_AVX2 not in isas(native):
        pytest.skip("this CPU has no AVX2")
    batch = make_batch([3, 200, 1000], 16, 16, 4, 128, torch.float32, seed=9)
    baseline = run_native(native, batch, 0.1, cpu_kernels.ISA_BASELINE)
    avx2 = run_native(native, batch, 0.1, cpu_kernels.ISA_AVX2)
    torch.testing.assert_close(avx2[batch.rows], baseline[batch.rows], atol=1e-6, rtol=1e-5)


def test_one_plan_serves_every_layer(native) -> None:
    """Built once per pass, run with each layer's caches (views of one pool, as the engine's)."""
    batch = make_batch([9, 70], 16, 8, 2, 64, torch.float32, seed=4)
    pool = torch.randn((3, 2, *batch.key_cache.shape))
    plan = native.plan_decode(pool[0, 0], batch.block_tables, batch.seq_lens, batch.rows)
    assert plan is not None
    for layer in range(3):
        batch.key_cache, batch.value_cache = pool[layer, 0], pool[layer, 1]
        out = torch.full_like(batch.query, float("nan"))
        assert plan.run(out, batch.query, batch.key_cache, batch.value_cache, 0.125)
        expected = naive_attention(batch, 0.125)[batch.rows]
        torch.testing.assert_close(out[batch.rows].double(), expected, atol=2e-5, rtol=2e-5)


# --- what is refused ------------------------------------------------------------------------


def test_a_block_id_past_the_pool_raises_and_writes_nothing(native) -> None:
    """Checked before anything is read, on every call: the plan's arrays are the caller's
    to get right, the pool's bounds are the kernel's to keep."""
    batch = make_batch([5, 20], 4, 4, 2, 32, torch.float32, seed=2)
    plan = native.plan_decode(batch.key_cache, batch.block_tables, batch.seq_lens, batch.rows)
    assert plan is not None
    out = torch.full_like(batch.query, float("nan"))
    for bad in (batch.key_cache.shape[0], -1):  # the second sequence needs 5 blocks; its third is bad
        plan.block_tables[1 * plan.struct.table_stride + 2] = bad
        with pytest.raises(IndexError, match="decoding sequence 1"):
            plan.run(out, batch.query, batch.key_cache, batch.value_cache, 0.1)
        assert out.isnan().all()


def test_a_row_past_the_query_raises_and_writes_nothing(native) -> None:
    batch = make_batch([5, 20], 4, 4, 2, 32, torch.float32, seed=2)
    batch.rows[0] = batch.query.shape[0]
    plan = native.plan_decode(batch.key_cache, batch.block_tables, batch.seq_lens, batch.rows)
    assert plan is not None
    out = torch.full_like(batch.query, float("nan"))
    with pytest.raises(IndexError, match="decoding sequence 0"):
        plan.run(out, batch.query, batch.key_cache, batch.value_cache, 0.1)
    assert out.isnan().all()


def test_caches_and_tensors_it_does_not_take(native) -> None:
    batch = make_batch([5, 20], 4, 4, 2, 32, torch.float32, seed=2)
    args = (batch.block_tables, batch.seq_lens, batch.rows)
    # Caches it plans nothing for: another dtype, a head_dim not a multiple of 16, not contiguous.
    assert native.plan_decode(batch.key_cache.double(), *args) is None
    assert native.plan_decode(torch.zeros((*batch.key_cache.shape[:3], 24)), *args) is None
    assert native.plan_decode(batch.key_cache.transpose(0, 1), *args) is None
    # Tensors a plan declines at run time: nothing is written, the torch path serves.
    plan = native.plan_decode(batch.key_cache, *args)
    assert plan is not None
    query, key_cache, value_cache = batch.query, batch.key_cache, batch.value_cache
    out = torch.full_like(query, float("nan"))
    declined = [
        (out, query.double(), key_cache, value_cache),  # another dtype
        (out, query, key_cache[:-1], value_cache[:-1]),  # another pool than planned
        (out, query, key_cache, value_cache.transpose(1, 2).contiguous().transpose(1, 2)),  # not contiguous
        (out[:-1], query, key_cache, value_cache),  # out and query differ
        (out[:, :3], query[:, :3], key_cache, value_cache),  # heads not a multiple of the kv heads
        (out, query.transpose(1, 2).contiguous().transpose(1, 2), key_cache, value_cache),  # head_dim strided
    ]
    for arguments in declined:
        assert not plan.run(*arguments, 0.1)
    assert out.isnan().all()


def test_a_code_path_this_cpu_lacks_is_refused(native) -> None:
    if cpu_kernels.ISA_AVX2 in isas(native):
        pytest.skip("this CPU runs every code path")
    batch = make_batch([5], 4, 4, 2, 32, torch.float32, seed=2)
    with pytest.raises(ValueError, match="not available"):
        run_native(native, batch, 0.1, cpu_kernels.ISA_AVX2)


# --- wired into the CPU path ------------------------------------------------------------------


def paged_attention(batch_q_lens: list[int], seq_lens: list[int], dtype: torch.dtype, seed: int):
    """`ops.paged_attention` of a mixed batch (decodes and prefills) with its inputs."""
    generator = torch.Generator().manual_seed(seed)
    block_size, num_heads, num_kv_heads, head_dim = 8, 8, 2, 64
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    ids = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros((len(seq_lens), max(blocks_per_seq) + 1), dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = torch.tensor([ids.pop() for _ in range(count)])
    query = torch.randn((sum(batch_q_lens), num_heads, head_dim), generator=generator).to(dtype)
    starts = torch.tensor([0, *torch.tensor(batch_q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    def run() -> torch.Tensor:
        out = torch.full_like(query, float("nan"))
        ops.paged_attention(out, query, key_cache, value_cache, tables, lens, starts, 0.125)
        return out

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_runs_native_decodes_and_torch_prefills(native, process_choice, dtype) -> None:
    """The same batch with the native decode attention, with the torch one
    (the setting ``cpu_attention = "torch"``) and with no native library at all: decode rows agree
    within the tolerance, prefill rows (torch in every case) bit for bit."""
    q_lens = [1, 12, 1, 0, 5, 1]
    seq_lens = [40, 12, 3, 9, 30, 200]
    run = paged_attention(q_lens, seq_lens, dtype, seed=1)
    results = []
    torch_attention = cpu_kernels.CpuKernels(native.library_path, decode_attention=False)
    for kernels in (native, torch_attention, None):
        cpu_kernels.use(kernels)
        results.append(run())
    decode_rows = [0, 13, 19]
    prefill_rows = [row for row in range(sum(q_lens)) if row not in decode_rows]
    tolerance = TOLERANCE[dtype]
    for other in results[1:]:
        torch.testing.assert_close(results[0][decode_rows], other[decode_rows], atol=tolerance, rtol=tolerance)
        assert torch.equal(results[0][prefill_rows], other[prefill_rows])
    assert torch.equal(results[1], results[2])  # the torch path, whatever write_kv runs


def test_the_plan_carries_the_native_decode_only_where_it_runs(native, process_choice) -> None:
    key_cache = torch.zeros(6, 4, 2, 32)
    tables, lens, starts = [[0, 1], [2, 3, 4]], [5, 9], [0, 1, 2]
    cpu_kernels.use(native)
    plan = attention_plan.plan_attention(key_cache, tables, lens, starts)
    assert plan.native_decode is not None and plan.native_decode.num_seqs == 2
    assert "decode" not in vars(plan), "the torch groups are built only when needed"
    assert sum(group.num_seqs for group in plan.decode) == 2  # still there for a fallback
    assert attention_plan.plan_attention(torch.zeros(6, 4, 2, 24), tables, lens, starts).native_decode is None
    assert attention_plan.plan_attention(key_cache, tables, lens, [0, 3, 5]).native_decode is None  # prefills only
    cpu_kernels.use(cpu_kernels.CpuKernels(native.library_path, decode_attention=False))
    assert attention_plan.plan_attention(key_cache, tables, lens, starts).native_decode is None
    cpu_kernels.use(None)
    assert attention_plan.plan_attention(key_cache, tables, lens, starts).native_decode is None


def test_a_failed_build_leaves_decode_attention_to_torch(tmp_path, process_choice) -> None:
    """A compiler that fails: `select` logs it and returns None, and paged_attention gives the
    torch path's result (checked against the float64 reference)."""
    script = tmp_path / "fake-cc"
    script.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo fake-cc 1.0; exit 0; fi\nexit 1\n')
    script.chmod(0o755)
    with capture_logs() as logs:
        kernels = cpu_kernels.select(KernelSettings(), [str(script)], [tmp_path / "cache"])
    assert kernels is None and logs[0]["event"] == "kernels.cpu_native_unavailable"
    cpu_kernels.use(kernels)
    batch = make_batch([3, 50], 8, 8, 2, 64, torch.float32, seed=6)
    plan = attention_plan.plan_attention(batch.key_cache, batch.block_tables, batch.seq_lens, [0, 1, 2])  # rows 0, 1
    assert plan.native_decode is None
    out = torch.full_like(batch.query, float("nan"))
    reference.run_attention(out, batch.query, batch.key_cache, batch.value_cache, plan, 0.125)
    batch.rows = [0, 1]
    torch.testing.assert_close(out[:2].double(), naive_attention(batch, 0.125)[:2], atol=2e-5, rtol=2e-5)


def test_the_attention_choice_is_a_setting(native) -> None:
    compiler = cpu_build.default_compiler()
    cache = [native.library_path.parent]  # built already
    chosen = cpu_kernels.select(KernelSettings(), compiler, cache)
    assert chosen is not None and chosen.decode_attention_enabled
    torch_attention = cpu_kernels.select(KernelSettings(cpu_attention="torch"), compiler, cache)
    assert torch_attention is not None and not torch_attention.decode_attention_enabled


def test_configure_switches_the_decode_attention_of_the_next_plan(native, kernel_settings) -> None:
    """`configure` drops the process's choice; the next plan is made with the new settings."""
    batch = make_batch([3, 50], 8, 8, 2, 64, torch.float32, seed=7)
    kernel_settings(cpu_attention="torch")
    torch_plan = attention_plan.plan_attention(batch.key_cache, batch.block_tables, batch.seq_lens, [0, 1, 2])
    kernels = cpu_kernels.try_load()
    assert kernels is not None and not kernels.decode_attention_enabled
    assert torch_plan.native_decode is None
    kernel_settings(cpu_attention="native")
    native_plan = attention_plan.plan_attention(batch.key_cache, batch.block_tables, batch.seq_lens, [0, 1, 2])
    assert native_plan.native_decode is not None
