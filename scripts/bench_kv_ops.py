"""Bandwidth of Shoal's CPU KV-cache ops against a contiguous copy, and paged decode attention.

    python scripts/bench_kv_ops.py [--quick] [--repeats N] [--threads N | --cpu-time] [--decode-only]
                                   [--cpu native|torch]

For each dtype and head_dim (16-token blocks, 8 kv heads):

* ``write_kv`` of thousands of tokens (K and V), with the slots of a prefill
  (each block filled in order, blocks in random pool order) and of a decode
  batch (one token per sequence, scattered over the pool);
* ``gather_kv``, the block gather inside ``paged_attention``, for the same
  number of tokens as 512-token sequences with random block tables;

each reported in GB/s and as a fraction of ``dst.copy_(src)`` moving the same
number of bytes between contiguous tensors, measured in the same loop, with the
implementation that ran (``impl``: the native C kernel of
``shoal.kernels.cpu_kernels`` with streaming or ordinary stores, or torch;
``--cpu torch``, the kernels' setting ``cpu = "torch"``, measures the torch one). Then
``write_kv`` at the size of one layer of a decode step (32 tokens), per call
against a copy of the same bytes: there the op's fixed cost, not bandwidth, is
what is measured. Then ``paged_attention`` decode for 1, 8 and 32 sequences (and
the demo models' head shapes at 32 sequences) with each decode implementation
(``impl``: the native C kernel reading K/V from the blocks, with its code path,
or torch's gather + SDPA; ``--cpu torch`` leaves only torch) against
``scaled_dot_product_attention`` over contiguous K/V of the same shapes, and the
fixed cost per layer of a tiny decode with each.
Repetitions of every contender are interleaved and medians reported, because
shared machines are noisy. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.kernels import attention_plan, cpu_kernels, reference
from shoal.kernels.settings import KernelSettings, configure

BLOCK_SIZE = 16
NUM_KV_HEADS = 8
NUM_HEADS = 32
GATHER_SEQ_LEN = 512


@dataclass(frozen=True)
class Timing:
    """Median seconds of each contender, measured interleaved."""

    seconds: dict[str, float]


# time.perf_counter (wall) or time.thread_time (--cpu-time: this thread's CPU
# time, which leaves out the time other jobs hold the core).
clock: Callable[[], float] = time.perf_counter


def interleaved_medians(contenders: dict[str, Callable[[], object]], repeats: int) -> Timing:
    """Runs every contender once per round, `repeats` rounds after one warm-up round.

    Returns:
        The median time of each contender.
    """
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for round_index in range(repeats + 1):
        for name, run in contenders.items():
            start = clock()
            run()
            elapsed = clock() - start
            if round_index:
                samples[name].append(elapsed)
    return Timing({name: statistics.median(times) for name, times in samples.items()})


def random_values(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def write_slots(num_tokens: int, num_blocks: int, pattern: str) -> torch.Tensor:
    """Slots of `num_tokens` new tokens in a pool of `num_blocks` blocks."""
    if pattern == "prefill":
        blocks = torch.randperm(num_blocks)[: num_tokens // BLOCK_SIZE]
        return (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).reshape(-1)
    return torch.randperm(num_blocks * BLOCK_SIZE)[:num_tokens]


def bench_write_kv(dtype: torch.dtype, head_dim: int, num_tokens: int, pattern: str, repeats: int) -> dict:
    num_blocks = 2 * num_tokens // BLOCK_SIZE
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    key_cache, value_cache = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
    key = random_values((num_tokens, NUM_KV_HEADS, head_dim), dtype)
    value = random_values((num_tokens, NUM_KV_HEADS, head_dim), dtype)
    slots = write_slots(num_tokens, num_blocks, pattern)
    num_bytes = 2 * key.numel() * key.element_size()
    src = random_values((2 * key.numel(),), dtype)
    dst = torch.zeros_like(src)
    timing = interleaved_medians(
        {
            "op": lambda: reference.write_kv(key, value, key_cache, value_cache, slots),
            "copy": lambda: dst.copy_(src),
        },
        repeats,
    )
    return row(
        f"write_kv ({pattern})", dtype, head_dim, num_tokens, num_bytes, timing, write_kv_impl(num_bytes)
    )


def bench_write_kv_step(dtype: torch.dtype, head_dim: int, num_tokens: int, repeats: int) -> dict:
    """`write_kv` of one decode step's layer (`num_tokens` scattered slots) per call, against
    one `copy_` of the same bytes between small contiguous tensors (in L2); each timing
    covers `calls` calls. Two slot patterns:

    * the same slots every call: the rows stay in L1/L2 as the copy's do, so what is left
      is the op's fixed cost (argument handling, two `index_copy_` dispatches);
    * fresh random slots every call in a pool of at most 16 MB (128 blocks), which stays in
      the L3 cache, as the blocks of a decode step do (the step before read them): every
      row write then misses L2.
    """
    calls = 64
    num_blocks = 128
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    key_cache, value_cache = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
    key = random_values((num_tokens, NUM_KV_HEADS, head_dim), dtype)
    value = random_values((num_tokens, NUM_KV_HEADS, head_dim), dtype)
    slot_sets = [write_slots(num_tokens, num_blocks, "decode") for _ in range(calls)]
    src = random_values((2 * key.numel(),), dtype)
    dst = torch.zeros_like(src)

    def same_slots() -> None:
        slots = slot_sets[0]
        for _ in range(calls):
            reference.write_kv(key, value, key_cache, value_cache, slots)

    def fresh_slots() -> None:
        for slots in slot_sets:
            reference.write_kv(key, value, key_cache, value_cache, slots)

    def copies() -> None:
        for _ in range(calls):
            dst.copy_(src)

    timing = interleaved_medians({"same": same_slots, "fresh": fresh_slots, "copy": copies}, repeats)
    same_us, fresh_us, copy_us = (1e6 * timing.seconds[name] / calls for name in ("same", "fresh", "copy"))
    num_bytes = 2 * key.numel() * key.element_size()
    return {
        "op": f"write_kv (decode step, {num_tokens} tokens)",
        "impl": write_kv_impl(num_bytes),
        "dtype": str(dtype).removeprefix("torch."),
        "head_dim": head_dim,
        "KB": f"{num_bytes / 1e3:.0f}",
        "copy us/call": f"{copy_us:.1f}",
        "op us/call, same slots": f"{same_us:.1f}",
        "op / copy, same slots": f"{copy_us / same_us:.2f}",
        "op us/call, fresh slots": f"{fresh_us:.1f}",
        "op / copy, fresh slots": f"{copy_us / fresh_us:.2f}",
    }


def bench_bandwidth(token_counts: tuple[int, ...], repeats: int) -> list[dict]:
    """The write and gather rows of the report, for every dtype, head_dim and size."""
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (64, 128):
            for num_tokens in token_counts:
                for pattern in ("prefill", "decode"):
                    rows.append(bench_write_kv(dtype, head_dim, num_tokens, pattern, repeats))
                rows.append(bench_gather(dtype, head_dim, num_tokens, repeats))
    return rows


def bench_write_kv_steps(repeats: int) -> list[dict]:
    return [
        bench_write_kv_step(dtype, head_dim, 32, repeats)
        for dtype in (torch.bfloat16, torch.float32)
        for head_dim in (64, 128)
    ]


def use_cpu_time() -> None:
    """Time with the calling thread's CPU time and one torch thread (`--cpu-time`)."""
    global clock
    clock = time.thread_time
    torch.set_num_threads(1)


def bench_gather(dtype: torch.dtype, head_dim: int, num_tokens: int, repeats: int) -> dict:
    seq_len = GATHER_SEQ_LEN
    num_seqs = num_tokens // seq_len
    blocks_per_seq = seq_len // BLOCK_SIZE
    num_blocks = 2 * num_seqs * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    key_cache, value_cache = random_values(cache_shape, dtype), random_values(cache_shape, dtype)
    block_tables = torch.randperm(num_blocks)[: num_seqs * blocks_per_seq].view(num_seqs, -1).int()
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    num_bytes = 2 * num_seqs * seq_len * NUM_KV_HEADS * head_dim * key_cache.element_size()
    src = random_values((num_bytes // key_cache.element_size(),), dtype)
    dst = torch.zeros_like(src)
    buffers = reference.GatherBuffers()  # reused across calls, as inside paged_attention
    timing = interleaved_medians(
        {
            "op": lambda: reference.gather_kv(key_cache, value_cache, block_tables, seq_lens, buffers),
            "copy": lambda: dst.copy_(src),
        },
        repeats,
    )
    return row("gather_kv", dtype, head_dim, num_seqs * seq_len, num_bytes, timing, "torch")


def write_kv_impl(num_bytes: int) -> str:
    """Which implementation `reference.write_kv` runs for a write of `num_bytes` (K and V) of
    the benchmark's tensors, which the native kernel always takes when it is loaded."""
    native = cpu_kernels.try_load()
    if native is None:
        return "torch"
    if native.has_streaming_stores and num_bytes >= cpu_kernels.STREAM_MIN_BYTES:
        return "C, streaming"
    return "C"


def describe_write_kv() -> str:
    """A line saying which `write_kv` implementation this process runs."""
    native = cpu_kernels.try_load()
    if native is None:
        return (
            'write_kv: torch (`index_copy_`; the setting cpu = "torch", or the native kernel did not build)'
        )
    if not native.has_streaming_stores:
        return f"write_kv: native C kernel ({native.library_path}), ordinary stores only on this architecture"
    return (
        f"write_kv: native C kernel ({native.library_path}), streaming stores from "
        f"{cpu_kernels.STREAM_MIN_BYTES / 2**20:g} MiB written"
    )


def describe_decode_attention() -> str:
    """A line saying which decode attention `paged_attention` runs in this process."""
    native = cpu_kernels.try_load()
    if native is None or not native.decode_attention_enabled:
        return "decode attention: torch (gather + SDPA); the decode tables time the native kernel too where it loads"
    return f"decode attention: native C kernel, {cpu_kernels.ISA_NAMES[native.attention_isa]} code path"


def row(
    op: str, dtype: torch.dtype, head_dim: int, num_tokens: int, num_bytes: int, timing: Timing, impl: str
) -> dict:
    op_seconds, copy_seconds = timing.seconds["op"], timing.seconds["copy"]
    return {
        "op": op,
        "impl": impl,
        "dtype": str(dtype).removeprefix("torch."),
        "head_dim": head_dim,
        "tokens": num_tokens,
        "MB": f"{num_bytes / 1e6:.0f}",
        "op GB/s": f"{num_bytes / op_seconds / 1e9:.1f}",
        "copy GB/s": f"{num_bytes / copy_seconds / 1e9:.1f}",
        "op / copy": f"{copy_seconds / op_seconds:.2f}",
    }


@dataclass(frozen=True)
class DecodeShape:
    """A decode batch: `num_seqs` sequences of `seq_len` tokens, heads over kv heads, head_dim."""

    num_seqs: int
    seq_len: int
    num_heads: int = NUM_HEADS
    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = 128


def decode_implementations() -> dict[str, cpu_kernels.CpuKernels | None]:
    """The decode attentions to compare, as this process's choice to run them with: the
    native kernel (where it is loaded) and torch's gather + SDPA."""
    loaded = cpu_kernels.try_load()
    if loaded is None:
        return {"torch (gather + SDPA)": None}
    native = cpu_kernels.CpuKernels(loaded.library_path, decode_attention=True)
    return {
        f"native C ({cpu_kernels.ISA_NAMES[native.attention_isa]})": native,
        "torch (gather + SDPA)": cpu_kernels.CpuKernels(loaded.library_path, decode_attention=False),
    }


def with_choice(kernels: cpu_kernels.CpuKernels | None, run: Callable[[], object]) -> Callable[[], None]:
    """`run` with `kernels` as the process's choice (restored after)."""

    def chosen() -> None:
        previous = cpu_kernels.use(kernels)
        try:
            run()
        finally:
            cpu_kernels.use(previous)

    return chosen


def bench_decode(dtype: torch.dtype, shape: DecodeShape, repeats: int) -> list[dict]:
    """`reference.paged_attention` of a decode batch (its plan built per call, as `ops` does) with
    each implementation, against SDPA over contiguous K/V; all interleaved. One row per
    implementation."""
    num_seqs, seq_len, num_kv_heads, head_dim = shape.num_seqs, shape.seq_len, shape.num_kv_heads, shape.head_dim
    group = shape.num_heads // num_kv_heads
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = 2 * num_seqs * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache, value_cache = random_values(cache_shape, dtype), random_values(cache_shape, dtype)
    block_tables = torch.randperm(num_blocks)[: num_seqs * blocks_per_seq].view(num_seqs, -1).int()
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    query = random_values((num_seqs, shape.num_heads, head_dim), dtype)
    out = torch.empty_like(query)
    # The contiguous baseline: K/V already [seqs, kv_heads, seq_len, head_dim], the
    # query heads of a kv group folded into the query-length dim as paged_attention does.
    keys = random_values((num_seqs, num_kv_heads, seq_len, head_dim), dtype)
    values = random_values((num_seqs, num_kv_heads, seq_len, head_dim), dtype)
    grouped_query = query.view(num_seqs, num_kv_heads, group, head_dim)
    scale = head_dim**-0.5

    def paged() -> None:
        reference.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)

    implementations = decode_implementations()
    contenders: dict[str, Callable[[], object]] = {
        name: with_choice(kernels, paged) for name, kernels in implementations.items()
    }
    contenders["sdpa"] = lambda: F.scaled_dot_product_attention(grouped_query, keys, values, scale=scale)
    timing = interleaved_medians(contenders, repeats)
    sdpa = timing.seconds["sdpa"]
    return [
        {
            "impl": name,
            "dtype": str(dtype).removeprefix("torch."),
            "seqs": num_seqs,
            "context": seq_len,
            "heads / kv heads": f"{shape.num_heads}/{num_kv_heads}",
            "head_dim": head_dim,
            "paged_attention ms": f"{timing.seconds[name] * 1e3:.3f}",
            "SDPA contiguous ms": f"{sdpa * 1e3:.3f}",
            "paged / SDPA": f"{timing.seconds[name] / sdpa:.2f}",
        }
        for name in implementations
    ]


def bench_decode_call(repeats: int) -> list[dict]:
    """The fixed cost of one layer's decode attention as the engine runs it (one plan per
    pass, `reference.run_attention` per layer): one sequence of 16 tokens, 4/2 heads of 64, float32,
    per call, with each implementation (the native one's plan and argument checks, and the
    ctypes call; the torch one's gathers and SDPA dispatch)."""
    calls = 200
    key_cache = random_values((4, BLOCK_SIZE, 2, 64), torch.float32)
    value_cache = random_values((4, BLOCK_SIZE, 2, 64), torch.float32)
    query = random_values((1, 4, 64), torch.float32)
    out = torch.empty_like(query)
    rows = []
    for name, kernels in decode_implementations().items():
        previous = cpu_kernels.use(kernels)
        try:
            plan = attention_plan.plan_attention(key_cache, [[2]], [16], [0, 1])
        finally:
            cpu_kernels.use(previous)

        def layers(plan: attention_plan.AttentionPlan = plan) -> None:
            for _ in range(calls):
                reference.run_attention(out, query, key_cache, value_cache, plan, 0.125)

        seconds = interleaved_medians({"layers": layers}, repeats).seconds["layers"]
        rows.append({"impl": name, "decode attention of 1 x 16 tokens, us per layer": f"{seconds / calls * 1e6:.1f}"})
    return rows


def markdown(rows: list[dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(r[column]) for column in header) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per measurement")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's); 1 is steadier on a machine other jobs share",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the calling thread's CPU time with one torch thread: steadier on a shared machine",
    )
    parser.add_argument(
        "--decode-only", action="store_true", help="only the decode attention tables (no bandwidth rows)"
    )
    parser.add_argument(
        "--cpu",
        choices=("native", "torch"),
        default="native",
        help="the kernels' `cpu` setting: the native C kernels where they build, or torch only",
    )
    args = parser.parse_args()
    configure(KernelSettings(cpu=args.cpu))
    if args.cpu_time:
        use_cpu_time()
    elif args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (5 if args.quick else 21)
    token_counts = (16384,) if args.quick else (16384, 65536)  # well past a 32 MB L3
    seq_len = 512 if args.quick else 1024

    clock_name = "thread CPU time" if args.cpu_time else "wall time"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {clock_name}, "
        f"medians of {repeats} interleaved rounds\n{describe_write_kv()}\n{describe_decode_attention()}\n"
    )
    if not args.decode_only:
        print(markdown(bench_bandwidth(token_counts, repeats)), end="\n\n")
        print(markdown(bench_write_kv_steps(repeats)), end="\n\n")

    decode = [
        row
        for dtype in (torch.bfloat16, torch.float32)
        for num_seqs in (1, 8, 32)
        for row in bench_decode(dtype, DecodeShape(num_seqs, seq_len), repeats)
    ]
    # The demo models' shapes at the engine benchmark's 32 sequences (contexts ~100-320).
    decode += [
        row
        for heads in ((4, 2), (8, 2), (12, 4))
        for row in bench_decode(torch.float32, DecodeShape(32, 160, *heads, 64), repeats)
    ]
    print(markdown(decode), end="\n\n")
    print(markdown(bench_decode_call(repeats)))


if __name__ == "__main__":
    main()
