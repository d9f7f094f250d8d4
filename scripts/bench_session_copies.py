"""Batched chunk copies between the KV pool and the host pool, against one contiguous copy.

    python scripts/bench_session_copies.py                  # the CPU twin (both pools in RAM)
    python scripts/bench_session_copies.py --device cuda    # GPU pool <-> pinned host pool
    python scripts/bench_session_copies.py --cpu-time       # CPU twin, thread CPU time, 1 thread

The session cache moves whole chunks (4 blocks) between the KV pool and the host pool: a
step's demotions in one `ops.swap_blocks` call, its copies back in another. Each row copies
`chunks` chunks whose blocks are scattered over both pools (as a pool in use hands them out)
and divides the time of ONE contiguous copy of the same number of bytes between the same two
memories (`dst.copy_(src)`, torch's copy: ordinary stores, one thread like the op's) by it:
1.0 means the scattered copy is as fast as a plain copy. A stricter second column divides
the time of `ops.swap_blocks` itself over two pools of exactly the moved blocks, each block
to its own place (one contiguous copy with the op's own streaming stores, which beat
torch's ordinary ones on large moves): what the scattering alone costs. Rows, alternated in each round, medians of the rounds:

* batched      one `ops.swap_blocks` call for every chunk (what the engine does)
* per chunk    one `ops.swap_blocks` call per chunk
* references   what a single-pass CPU implementation of the op could reach (CPU only):
               out: one `index_select` per (layer, K/V) plane and chunk, straight into
               the chunk's run of host blocks; in: one `ops.write_kv` per layer (the native
               C scatter with streaming stores) from the host pool into the pool's slots

Target: batched >= 0.8.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shoal.kernels import ops

BLOCK_SIZE = 16
BLOCKS_PER_CHUNK = 4
SHAPES = {
    # name: (layers, kv heads, head_dim, dtype)
    "llama-100m (demo)": (12, 4, 64, torch.float32),
    "8B-class (32 x 8 x 128, bf16)": (32, 8, 128, torch.bfloat16),
}


_clock: Callable[[], float] = time.perf_counter
"""Wall time, or (`--cpu-time`) the calling thread's CPU time: on a machine whose cores other
jobs share, a wall-clock median of a millisecond copy says more about the other jobs."""


def _time(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = _clock()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return _clock() - started


def bench_shape(
    name: str, shape: tuple[int, int, int, torch.dtype], num_chunks: int, device: torch.device, rounds: int
) -> list[tuple[str, str, str, int, float, float, float]]:
    layers, kv_heads, head_dim, dtype = shape
    block_bytes = BLOCK_SIZE * 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    num_moved = num_chunks * BLOCKS_PER_CHUNK
    num_pool_blocks = 2 * num_moved
    pool_shape = (layers, 2, num_pool_blocks, BLOCK_SIZE, kv_heads, head_dim)
    pool = torch.randn(pool_shape, dtype=torch.float32).to(dtype).to(device)
    host = torch.zeros(pool_shape, dtype=dtype, pin_memory=device.type == "cuda")
    generator = torch.Generator().manual_seed(0)
    pool_ids = torch.randperm(num_pool_blocks, generator=generator)[:num_moved]
    # The host pool hands a chunk a run of blocks at a random place.
    host_starts = torch.randperm(num_pool_blocks // BLOCKS_PER_CHUNK, generator=generator)[:num_chunks] * BLOCKS_PER_CHUNK
    host_ids = (host_starts[:, None] + torch.arange(BLOCKS_PER_CHUNK)).reshape(-1)
    out_pairs = torch.stack([pool_ids, host_ids], dim=1)
    in_pairs = torch.stack([host_ids, pool_ids], dim=1)
    num_bytes = num_moved * block_bytes
    contiguous_src = torch.randn(num_bytes // 4, dtype=torch.float32, device=device)
    contiguous_host = torch.empty(num_bytes // 4, dtype=torch.float32, pin_memory=device.type == "cuda")
    # The same copier over two pools of exactly the moved blocks, every block to its own
    # place: one contiguous copy of the same bytes, with swap_blocks' own stores (streaming).
    run_shape = (layers, 2, num_moved, BLOCK_SIZE, kv_heads, head_dim)
    run_src = torch.randn(run_shape, dtype=torch.float32).to(dtype).to(device)
    run_dst = torch.zeros(run_shape, dtype=dtype, pin_memory=device.type == "cuda")
    identity_pairs = torch.arange(num_moved)[:, None].expand(num_moved, 2).contiguous()
    pool_planes = pool.view(layers * 2, num_pool_blocks, -1)
    host_planes = host.view(layers * 2, num_pool_blocks, -1)

    def per_plane_out() -> None:  # reference only: contiguous host runs, one gather per plane per chunk
        for chunk in range(num_chunks):
            start = int(host_starts[chunk])
            src = pool_ids[chunk * BLOCKS_PER_CHUNK : (chunk + 1) * BLOCKS_PER_CHUNK].to(device)
            for plane in range(layers * 2):
                torch.index_select(pool_planes[plane], 0, src, out=host_planes[plane, start : start + BLOCKS_PER_CHUNK])

    cases: dict[str, Callable[[], None]] = {
        "both: contiguous swap_blocks": lambda: ops.swap_blocks(run_src, run_dst, identity_pairs),
        "out: copy": lambda: contiguous_host.copy_(contiguous_src),
        "out: batched": lambda: ops.swap_blocks(pool, host, out_pairs),
        "out: per chunk": lambda: [
            ops.swap_blocks(pool, host, out_pairs[i * BLOCKS_PER_CHUNK : (i + 1) * BLOCKS_PER_CHUNK])
            for i in range(num_chunks)
        ]
        and None,
        "in: copy": lambda: contiguous_src.copy_(contiguous_host),
        "in: batched": lambda: ops.swap_blocks(host, pool, in_pairs),
        "in: per chunk": lambda: [
            ops.swap_blocks(host, pool, in_pairs[i * BLOCKS_PER_CHUNK : (i + 1) * BLOCKS_PER_CHUNK])
            for i in range(num_chunks)
        ]
        and None,
    }
    host_tokens = torch.full((num_pool_blocks * BLOCK_SIZE,), -1, dtype=torch.int64)
    offsets = torch.arange(BLOCK_SIZE)
    host_tokens[(host_ids[:, None] * BLOCK_SIZE + offsets).reshape(-1)] = (
        pool_ids[:, None] * BLOCK_SIZE + offsets
    ).reshape(-1)

    def write_kv_in() -> None:  # reference only: slots of tokens not moved are -1 (skipped)
        for layer in range(layers):
            rows = host[layer].view(2, num_pool_blocks * BLOCK_SIZE, kv_heads, head_dim)
            ops.write_kv(rows[0], rows[1], pool[layer, 0], pool[layer, 1], host_tokens)

    if device.type == "cpu":
        cases["out: per plane (reference)"] = per_plane_out
        cases["in: write_kv (reference)"] = write_kv_in
    timings: dict[str, list[float]] = {case: [] for case in cases}
    for case_fn in cases.values():
        case_fn()  # warm up
    for _ in range(rounds):
        for case, case_fn in cases.items():
            timings[case].append(_time(case_fn, device))
    medians = {case: statistics.median(values) for case, values in timings.items()}
    rows = []
    contiguous_seconds = medians["both: contiguous swap_blocks"]
    for case, seconds in medians.items():
        direction, variant = case.split(": ")
        if variant == "copy" or direction == "both":
            continue
        copy_seconds = medians[f"{direction}: copy"]
        rows.append((name, direction, variant, num_bytes, seconds, copy_seconds / seconds, contiguous_seconds / seconds))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunks", default="16,64", help="chunks moved per call")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time with this thread's CPU time (CPU only; one torch thread)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.cpu_time:
        if device.type != "cpu":
            parser.error("--cpu-time measures the CPU twin only")
        global _clock
        _clock = time.thread_time
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    clock_name = "thread CPU time" if args.cpu_time else "wall time"
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, {clock_name}")
    print(
        "| shape | direction | call | MB | ms | copy / call | contiguous swap_blocks / call |\n"
        "|---|---|---|---|---|---|---|"
    )
    for num_chunks in (int(value) for value in args.chunks.split(",")):
        for name, shape in SHAPES.items():
            for row in bench_shape(name, shape, num_chunks, device, args.rounds):
                shape_name, direction, variant, num_bytes, seconds, fraction, strict_fraction = row
                print(
                    f"| {shape_name} | {direction} | {variant} ({num_chunks} chunks) | {num_bytes / 1e6:.0f} | "
                    f"{seconds * 1e3:.2f} | {fraction:.2f} | {strict_fraction:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
