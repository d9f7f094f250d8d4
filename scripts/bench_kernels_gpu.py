"""Shoal's CUDA attention on a real GPU: decode bandwidth against the GPU's own copy bandwidth,
and prefill against PyTorch's SDPA (FlashAttention / memory-efficient backends).

    python scripts/bench_kernels_gpu.py [--quick] [--dtype bfloat16] [--repeats N] [--json PATH]

Needs a CUDA device (exits with a message otherwise); builds the kernels on first use.

Decode: ``ops.paged_attention`` over batches of 1, 8, 64 and 256 decode rows, each with a
context of 1K, 8K or 32K tokens (16-token blocks scattered over the pool, Llama-3-8B's
heads: 32 query heads, 8 kv heads, head_dim 128). Each cell reports the kernel's time and
its achieved bandwidth (the K/V bytes it must read, ``rows x context x kv_heads x head_dim x
2 x element size``, over its time), as a fraction of the bandwidth of ``dst.copy_(src)``
between two 1 GiB device tensors measured in the same run: a memory-bound kernel's
ceiling on this GPU, whatever its datasheet says. Cells whose pool does not fit in free
memory are reported as skipped.

Prefill: one fresh sequence of 512, 2K and 8K tokens through ``ops.paged_attention`` (every
row on the paged kernel) and through ``torch.nn.functional.scaled_dot_product_attention``
(causal, GQA, contiguous K/V), and their ratio. The engine routes prefill rows to SDPA
(docs/kernels.md, "Prefill on SDPA"); this measures what that routing saves.

Timing: CUDA events around ``--repeats`` calls after warm-up calls; medians of 5 rounds.
Prints markdown tables (the layout of docs/benchmarks.md's "CUDA kernels" section).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shoal.kernels import ops

BLOCK_SIZE = 16
NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (1024, 8192, 32768)
PREFILL_LENGTHS = (512, 2048, 8192)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def time_cuda(fn: Callable[[], Any], repeats: int, rounds: int = 5) -> float:
    """Median seconds per call of `fn` over `rounds` rounds of `repeats` calls (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1000.0 / repeats)
    return statistics.median(samples)


def copy_bandwidth(repeats: int) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write counted)."""
    num_bytes = 1 << 30
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), repeats)
    return 2 * num_bytes / seconds


def decode_cell(num_rows: int, context: int, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """One decode cell: the kernel's seconds and the K/V bytes it reads."""
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = num_rows * blocks_per_seq + 1
    element = torch.tensor([], dtype=dtype).element_size()
    cache_bytes = 2 * num_blocks * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * element
    free_bytes, _ = torch.cuda.mem_get_info()
    if cache_bytes > 0.85 * free_bytes:
        return {"rows": num_rows, "context": context, "skipped": f"needs {cache_bytes / 2**30:.1f} GiB"}
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=dtype, device="cuda")
    value_cache = torch.randn(shape, dtype=dtype, device="cuda")
    block_tables = torch.randperm(num_blocks - 1, device="cuda")[: num_rows * blocks_per_seq].to(torch.int32)
    block_tables = (block_tables + 1).view(num_rows, blocks_per_seq).contiguous()
    seq_lens = torch.full((num_rows,), context, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(num_rows + 1, dtype=torch.int32, device="cuda")
    query = torch.randn((num_rows, NUM_HEADS, HEAD_DIM), dtype=dtype, device="cuda")
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5

    def run() -> None:
        ops.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)

    seconds = time_cuda(run, repeats)
    kv_bytes = 2 * num_rows * context * NUM_KV_HEADS * HEAD_DIM * element
    return {"rows": num_rows, "context": context, "seconds": seconds, "kv_bytes": kv_bytes}


def prefill_cell(length: int, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """One fresh prefill of `length` tokens: the paged kernel against SDPA."""
    num_blocks = length // BLOCK_SIZE + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=dtype, device="cuda")
    value_cache = torch.randn(shape, dtype=dtype, device="cuda")
    block_tables = torch.arange(1, num_blocks, dtype=torch.int32, device="cuda").view(1, -1)
    seq_lens = torch.tensor([length], dtype=torch.int32, device="cuda")
    query_start_loc = torch.tensor([0, length], dtype=torch.int32, device="cuda")
    query = torch.randn((length, NUM_HEADS, HEAD_DIM), dtype=dtype, device="cuda")
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    paged = time_cuda(
        lambda: ops.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                    scale),
        repeats,
    )
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    k = key_cache[1:].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:length].transpose(0, 1).unsqueeze(0).contiguous()
    v = value_cache[1:].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:length].transpose(0, 1).unsqueeze(0).contiguous()
    sdpa = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
                     repeats)
    return {"length": length, "paged_seconds": paged, "sdpa_seconds": sdpa}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batches 1 and 64, contexts 1K and 8K, prefill 2K")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels_gpu: no CUDA device; nothing measured", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    backend = ops.prepare(torch.device("cuda"))
    if backend != "cuda":
        print(f"bench_kernels_gpu: the kernels setting runs {backend!r} on CUDA, not Shoal's kernels", file=sys.stderr)
        return 2
    batches = (1, 64) if args.quick else DECODE_BATCHES
    contexts = (1024, 8192) if args.quick else DECODE_CONTEXTS
    lengths = (2048,) if args.quick else PREFILL_LENGTHS
    name = torch.cuda.get_device_name()
    copy_bytes_per_s = copy_bandwidth(args.repeats)
    torch.cuda.empty_cache()
    print(f"# {name}, {args.dtype}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"device-to-device copy: {copy_bytes_per_s / 1e9:.0f} GB/s (the baseline)\n")

    print("| rows | context | time (ms) | GB/s | fraction of copy |")
    print("| --- | --- | --- | --- | --- |")
    decode = []
    for num_rows in batches:
        for context in contexts:
            cell = decode_cell(num_rows, context, dtype, args.repeats)
            torch.cuda.empty_cache()  # the cell's pool, freed on return
            decode.append(cell)
            if "skipped" in cell:
                print(f"| {num_rows} | {context} | skipped: {cell['skipped']} | | |")
                continue
            bytes_per_s = cell["kv_bytes"] / cell["seconds"]
            print(f"| {num_rows} | {context} | {cell['seconds'] * 1e3:.3f} | {bytes_per_s / 1e9:.0f} | "
                  f"{bytes_per_s / copy_bytes_per_s:.2f} |")

    print("\n| prefill tokens | paged kernel (ms) | SDPA (ms) | paged / SDPA |")
    print("| --- | --- | --- | --- |")
    prefill = []
    for length in lengths:
        cell = prefill_cell(length, dtype, max(1, args.repeats // 4))
        prefill.append(cell)
        print(f"| {length} | {cell['paged_seconds'] * 1e3:.2f} | {cell['sdpa_seconds'] * 1e3:.2f} | "
              f"{cell['paged_seconds'] / cell['sdpa_seconds']:.1f} |")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"device": name, "dtype": args.dtype, "copy_bytes_per_s": copy_bytes_per_s,
                       "decode": decode, "prefill": prefill}, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
