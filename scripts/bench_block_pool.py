"""Block pool allocate+free throughput: Shoal's BlockPool vs a re-creation of vLLM v1's free list.

One operation = one block allocated (ref count set to 1) and freed again (ref count back to
0, block back on the free list). "single" allocates and frees one block per call; "batched"
128 blocks per call. The baseline re-creates vLLM v1's `FreeKVCacheBlockQueue`
(vllm/v1/core/kv_cache_utils.py): a doubly linked list threaded through `KVCacheBlock`
dataclass objects with fake head and tail nodes, `popleft`/`append` and
`popleft_n`/`append_n`, with the ref-count updates `BlockPool.get_new_blocks` /
`free_blocks` do around them. vLLM itself is not installed; both run in this process.

    python scripts/bench_block_pool.py [--quick] [--num-blocks 4096]
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal.shared.kv_cache.block_pool import BlockPool

BATCH = 128
VLLM_QUEUE = "vLLM v1 FreeKVCacheBlockQueue, bare (re-created)"
VLLM_POOL = "vLLM v1 BlockPool get_new_blocks/free_blocks (re-created)"
SHOAL = "Shoal BlockPool try_allocate(_n)/free(_n)"


# ---------------------------------------------------------------------- the vLLM baseline


@dataclass
class KVCacheBlock:
    """vLLM v1's block metadata (same fields, same plain dataclass)."""

    block_id: int
    ref_cnt: int = 0
    _block_hash: bytes | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> bytes | None:
        return self._block_hash


class FreeKVCacheBlockQueue:
    """vLLM v1's doubly linked free list with fake head and tail (the same operations)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for i in range(self.num_free_blocks):
            if i > 0:
                blocks[i].prev_free_block = blocks[i - 1]
            if i < self.num_free_blocks - 1:
                blocks[i].next_free_block = blocks[i + 1]
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        self.fake_free_list_head.next_free_block = blocks[0]
        blocks[0].prev_free_block = self.fake_free_list_head
        self.fake_free_list_tail.prev_free_block = blocks[-1]
        blocks[-1].next_free_block = self.fake_free_list_tail

    def popleft(self) -> KVCacheBlock:
        if (
            self.fake_free_list_head.next_free_block is self.fake_free_list_tail
            or self.fake_free_list_head.next_free_block is None
        ):
            raise ValueError("No free blocks available")
        first_block = self.fake_free_list_head.next_free_block
        if first_block.next_free_block is None:
            raise RuntimeError("Invalid block found in popleft()")
        self.fake_free_list_head.next_free_block = first_block.next_free_block
        first_block.next_free_block.prev_free_block = self.fake_free_list_head
        first_block.prev_free_block = first_block.next_free_block = None
        self.num_free_blocks -= 1
        return first_block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        self.num_free_blocks -= n
        curr_block = self.fake_free_list_head.next_free_block
        ret = []
        for _ in range(n):
            assert curr_block is not None
            ret.append(curr_block)
            last_block = curr_block
            curr_block = curr_block.next_free_block
            last_block.prev_free_block = None
            last_block.next_free_block = None
        if curr_block is not None:
            self.fake_free_list_head.next_free_block = curr_block
            curr_block.prev_free_block = self.fake_free_list_head
        return ret

    def append(self, block: KVCacheBlock) -> None:
        if self.fake_free_list_tail.prev_free_block is None:
            raise RuntimeError("prev_free_block of fake_free_list_tail should always exist")
        last_block = self.fake_free_list_tail.prev_free_block
        last_block.next_free_block = block
        block.prev_free_block = last_block
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        if len(blocks) == 0:
            return
        last_block = self.fake_free_list_tail.prev_free_block
        assert last_block is not None
        for block in blocks:
            block.prev_free_block = last_block
            last_block.next_free_block = block
            last_block = block
        last_block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last_block
        self.num_free_blocks += len(blocks)


class VllmBlockPool:
    """vLLM v1 `BlockPool`'s allocation path: `get_new_blocks` and `free_blocks`, prefix
    caching enabled (vLLM's default), no metrics collector."""

    def __init__(self, num_gpu_blocks: int) -> None:
        self.blocks = [KVCacheBlock(idx) for idx in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_caching = True
        self.metrics_collector = None

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            for block in ret:
                self._maybe_evict_cached_block(block)
                assert block.ref_cnt == 0
                block.ref_cnt += 1
        else:
            for block in ret:
                assert block.ref_cnt == 0
                block.ref_cnt += 1
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        del self.cached_block_hash_to_block[block_hash]
        block._block_hash = None
        return True

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        blocks_list = list(ordered_blocks)
        for block in blocks_list:
            block.ref_cnt -= 1
        self.free_block_queue.append_n(
            [block for block in blocks_list if block.ref_cnt == 0 and not block.is_null]
        )


def vllm_pool_single(num_blocks: int, num_ops: int) -> Callable[[], None]:
    pool = VllmBlockPool(num_blocks)

    def run() -> None:
        get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks
        for _ in range(num_ops):
            free_blocks(get_new_blocks(1))

    return run


def vllm_pool_batched(num_blocks: int, num_ops: int) -> Callable[[], None]:
    pool = VllmBlockPool(num_blocks)

    def run() -> None:
        get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks
        for _ in range(num_ops // BATCH):
            free_blocks(get_new_blocks(BATCH))

    return run


def vllm_single(num_blocks: int, num_ops: int) -> Callable[[], None]:
    queue = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(num_blocks)])

    def run() -> None:
        for _ in range(num_ops):
            block = queue.popleft()
            block.ref_cnt += 1
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)

    return run


def vllm_batched(num_blocks: int, num_ops: int) -> Callable[[], None]:
    queue = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(num_blocks)])

    def run() -> None:
        for _ in range(num_ops // BATCH):
            blocks = queue.popleft_n(BATCH)
            for block in blocks:
                block.ref_cnt += 1
            for block in blocks:
                block.ref_cnt -= 1
            queue.append_n([block for block in blocks if block.ref_cnt == 0])

    return run


# ---------------------------------------------------------------------- Shoal


def shoal_single(num_blocks: int, num_ops: int) -> Callable[[], None]:
    pool = BlockPool(num_blocks)

    def run() -> None:
        try_allocate, free = pool.try_allocate, pool.free
        for _ in range(num_ops):
            free(try_allocate())  # type: ignore[arg-type]

    return run


def shoal_batched(num_blocks: int, num_ops: int) -> Callable[[], None]:
    pool = BlockPool(num_blocks)

    def run() -> None:
        block_ids: list[int] = []
        try_allocate_n, free_n = pool.try_allocate_n, pool.free_n
        for _ in range(num_ops // BATCH):
            try_allocate_n(BATCH, block_ids)
            free_n(block_ids)
            block_ids.clear()

    return run


# ---------------------------------------------------------------------- measurement


def measure(
    makers: list[Callable[[int, int], Callable[[], None]]], num_blocks: int, num_ops: int, repeats: int
) -> list[tuple[float, float]]:
    """(best ops/s, net Python memory blocks left allocated per op) of each maker.

    Repeats are interleaved (every implementation once per round), so load that drifts on a
    shared machine affects all alike; the best round of each is kept.
    """
    runs = [make(num_blocks, num_ops) for make in makers]
    for run in runs:
        run()  # warm up
    best = [float("inf")] * len(runs)
    net_blocks = [0.0] * len(runs)
    gc.disable()
    try:
        for _ in range(repeats):
            for index, run in enumerate(runs):
                start = time.perf_counter()
                run()
                best[index] = min(best[index], time.perf_counter() - start)
        for index, run in enumerate(runs):
            before = sys.getallocatedblocks()
            run()
            net_blocks[index] = (sys.getallocatedblocks() - before) / num_ops
    finally:
        gc.enable()
    return [(num_ops / seconds, blocks) for seconds, blocks in zip(best, net_blocks, strict=True)]


VLLM_REPORTED_M_OPS = {"single": 1.0, f"batched {BATCH}": 5.9}
"""vLLM's own allocate+free figures (M ops/s) the issue compares against, measured elsewhere."""

ROWS = [
    ("single", VLLM_QUEUE, vllm_single),
    ("single", VLLM_POOL, vllm_pool_single),
    ("single", SHOAL, shoal_single),
    (f"batched {BATCH}", VLLM_QUEUE, vllm_batched),
    (f"batched {BATCH}", VLLM_POOL, vllm_pool_batched),
    (f"batched {BATCH}", SHOAL, shoal_batched),
]


def bench_block_pools(num_blocks: int, num_ops: int, repeats: int) -> list[dict[str, object]]:
    """One row per (mode, implementation): M ops/s and net allocations per op."""
    measured = measure([make for _, _, make in ROWS], num_blocks, num_ops, repeats)
    return [
        {"mode": mode, "implementation": name, "M ops/s": ops_per_s / 1e6, "net allocs/op": net_blocks}
        for (mode, name, _), (ops_per_s, net_blocks) in zip(ROWS, measured, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer operations and repeats")
    parser.add_argument("--num-blocks", type=int, default=4096)
    args = parser.parse_args()
    num_ops = 200_000 if args.quick else 1_000_000
    repeats = 3 if args.quick else 7
    print(
        f"python {platform.python_version()} on {platform.machine()}, {args.num_blocks} blocks, "
        f"{num_ops} allocate+free ops per run, best of {repeats} interleaved rounds"
    )
    rows = bench_block_pools(args.num_blocks, num_ops, repeats)
    print(f"{'mode':<12} {'implementation':<58} {'M ops/s':>8} {'net allocs/op':>14}")
    results: dict[tuple[object, object], float] = {}
    for row in rows:
        results[(row["mode"], row["implementation"])] = float(row["M ops/s"])  # type: ignore[arg-type]
        print(
            f"{row['mode']:<12} {row['implementation']:<58} {row['M ops/s']:>8.2f} {row['net allocs/op']:>14.4f}"
        )
    for mode in ("single", f"batched {BATCH}"):
        shoal = results[(mode, SHOAL)]
        print(
            f"{mode}: Shoal / vLLM BlockPool = {shoal / results[(mode, VLLM_POOL)]:.2f}x, "
            f"Shoal / vLLM bare queue = {shoal / results[(mode, VLLM_QUEUE)]:.2f}x, "
            f"Shoal / vLLM's reported {VLLM_REPORTED_M_OPS[mode]} M ops/s = "
            f"{shoal / VLLM_REPORTED_M_OPS[mode]:.2f}x"
        )


if __name__ == "__main__":
    main()
