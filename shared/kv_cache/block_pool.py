"""The KV block pool: fixed-size blocks, reference counts, and a prefix cache with LRU eviction.

Pure bookkeeping over block ids (ints): no torch, no locks, no I/O. The tensor the ids index
is allocated by the engine (`services/worker/engine/model_runner.py`); this module only
decides which block is whose.

Every block is in exactly one of three states::

    state          ref count   hash     where it lives
    -------------  ---------   ------   ------------------------------------------------
    used           > 0         any      in the block tables of the sequences that share it
    free           0           none     the free stack (LIFO)
    cached-free    0           set      the LRU list: still reusable by a prefix-cache hit,
                                        evicted least recently used first when the free
                                        stack runs dry

    free stack        [ 7 | 3 | 9 ]  <- pop / push here (top)
    LRU list   head <-> 4 <-> 12 <-> 5 <-> head     head.next is evicted first, frees append
                                                    before head (most recently used)

Operations are O(1) per block and make no Python object per block (no node objects, no
per-block containers): the free stack is a list of ints used with pop/append, the LRU is
doubly linked through two preallocated int lists indexed by block id (index `num_blocks` is
the sentinel), and ref counts live in a preallocated list. Running out is an expected
outcome (`try_*` returns False/None); a double free or a touch of a block in the wrong
state is a bug (an assert naming the invariant).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes
"""Identity of a full block's contents: chained over its prefix (see `kv_cache_manager`)."""


@dataclass(frozen=True)
class BlockPoolStats:
    """A snapshot of the pool's statistics: counters kept incrementally, or derived from them
    in O(1) (never by scanning the blocks)."""

    num_blocks: int
    block_size: int
    """Tokens per block."""
    block_bytes: int
    """Bytes of K and V for one block across all layers (0 when the pool was not told)."""
    num_used_blocks: int
    """Blocks with a ref count above zero."""
    num_peak_used_blocks: int
    num_free_blocks: int
    """Blocks an allocation may take: free plus cached-free."""
    num_cached_blocks: int
    """Blocks registered in the prefix cache (used or cached-free)."""
    num_cached_free_blocks: int
    num_allocations: int
    """Blocks handed out by allocation (fresh or evicted), since the pool was made."""
    num_frees: int
    """Blocks whose ref count dropped to zero."""
    num_cache_hits: int
    """Full blocks a new sequence reused from the prefix cache."""
    num_cache_misses: int
    """Full blocks looked up in the prefix cache and not found."""
    num_evictions: int
    """Cached-free blocks whose cache entry was dropped so they could be allocated."""

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def used_bytes(self) -> int:
        return self.num_used_blocks * self.block_bytes

    @property
    def peak_used_bytes(self) -> int:
        return self.num_peak_used_blocks * self.block_bytes

    @property
    def utilization(self) -> float:
        """Fraction of blocks in use (0.0 to 1.0)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def cache_hit_rate(self) -> float:
        num_lookups = self.num_cache_hits + self.num_cache_misses
        return self.num_cache_hits / num_lookups if num_lookups else 0.0


class BlockPool:
    """Allocates fixed-size KV blocks by id, with ref counts and an LRU prefix cache.

    Args:
        num_blocks: blocks in the pool (ids 0 .. num_blocks - 1).
        block_size: tokens per block (kept for callers and stats; the pool counts blocks).
        block_bytes: bytes one block takes, for byte figures in `get_stats` (optional).
    """

    __slots__ = (
        "_block_hashes",
        "_free_stack",
        "_hash_to_block",
        "_lru_next",
        "_lru_prev",
        "_min_num_free",
        "_num_cache_hits",
        "_num_cache_misses",
        "_num_cached_free",
        "_num_evictions",
        "_num_frees",
        "_num_revivals",
        "_ref_counts",
        "block_bytes",
        "block_size",
        "num_blocks",
    )

    def __init__(self, num_blocks: int, block_size: int = 16, block_bytes: int = 0) -> None:
        assert num_blocks > 0, f"a block pool needs at least one block, got {num_blocks}"
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_bytes = block_bytes
        self._ref_counts: list[int] = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        # Reversed so that a fresh pool hands out 0, 1, 2, ... (readable tests and traces).
        self._free_stack: list[int] = list(range(num_blocks - 1, -1, -1))
        # Index-linked LRU of cached-free blocks; index num_blocks is the sentinel.
        self._lru_prev: list[int] = [num_blocks] * (num_blocks + 1)
        self._lru_next: list[int] = [num_blocks] * (num_blocks + 1)
        self._num_cached_free = 0
        # Counters are kept so the hot paths touch as few as possible: used blocks are
        # the blocks on neither free structure, the peak is the low-water mark of free
        # blocks, and every block that became used was allocated or revived by a cache
        # hit, so allocations = frees + used - revivals.
        self._min_num_free = num_blocks
        self._num_frees = 0
        self._num_revivals = 0
        self._num_cache_hits = 0
        self._num_cache_misses = 0
        self._num_evictions = 0

    # ------------------------------------------------------------------ queries

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached-free)."""
        return len(self._free_stack) + self._num_cached_free

    def get_ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def get_block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hashes[block_id]

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`'s contents, if cached (no stats, no state change)."""
        return self._hash_to_block.get(block_hash)

    def get_free_block_ids(self) -> list[int]:
        """Free blocks (next allocated first), then cached-free blocks in eviction order. O(n)."""
        free_block_ids = self._free_stack[::-1]
        sentinel = self.num_blocks
        block_id = self._lru_next[sentinel]
        while block_id != sentinel:
            free_block_ids.append(block_id)
            block_id = self._lru_next[block_id]
        return free_block_ids

    def get_stats(self) -> BlockPoolStats:
        num_free = len(self._free_stack) + self._num_cached_free
        num_used = self.num_blocks - num_free
        return BlockPoolStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            block_bytes=self.block_bytes,
            num_used_blocks=num_used,
            num_peak_used_blocks=self.num_blocks - self._min_num_free,
            num_free_blocks=num_free,
            num_cached_blocks=len(self._hash_to_block),
            num_cached_free_blocks=self._num_cached_free,
            num_allocations=self._num_frees + num_used - self._num_revivals,
            num_frees=self._num_frees,
            num_cache_hits=self._num_cache_hits,
            num_cache_misses=self._num_cache_misses,
            num_evictions=self._num_evictions,
        )

    # ------------------------------------------------------------------ allocation

    def try_allocate(self) -> int | None:
        """One block with ref count 1, or None when the pool is exhausted."""
        stack = self._free_stack
        if stack:
            block_id = stack.pop()
        elif self._num_cached_free:
            block_id = self._evict_lru()
        else:
            return None
        self._ref_counts[block_id] = 1
        num_free = len(stack) + self._num_cached_free
        if num_free < self._min_num_free:
            self._min_num_free = num_free
        return block_id

    def try_allocate_n(self, num_blocks: int, out: list[int]) -> bool:
        """Append `num_blocks` new blocks (ref count 1) to `out`, or change nothing.

        Free blocks go first; cached-free blocks are evicted (least recently used first)
        only when the free stack cannot cover the request.

        Returns:
            True when all blocks were allocated, False (and `out` untouched) when the pool
            cannot supply them all.
        """
        stack = self._free_stack
        num_from_stack = len(stack)
        if num_blocks > num_from_stack + self._num_cached_free:
            return False
        if num_blocks <= num_from_stack:
            num_from_stack = num_blocks
        if num_from_stack:
            new_block_ids = stack[: -num_from_stack - 1 : -1]
            del stack[-num_from_stack:]
        else:
            new_block_ids = []
        for _ in range(num_blocks - num_from_stack):
            new_block_ids.append(self._evict_lru())
        ref_counts = self._ref_counts
        for block_id in new_block_ids:
            ref_counts[block_id] = 1
        out += new_block_ids
        num_free = len(stack) + self._num_cached_free
        if num_free < self._min_num_free:
            self._min_num_free = num_free
        return True

    def share(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (fork, parallel sampling). Each must be in use."""
        ref_counts = self._ref_counts
        for block_id in block_ids:
            assert ref_counts[block_id] > 0, f"share of block {block_id}: only used blocks can be shared"
            ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes free, or cached-free if it has a hash."""
        ref_counts = self._ref_counts
        ref_count = ref_counts[block_id]
        assert ref_count > 0, (
            f"double free: block {block_id} has ref count 0 (free blocks hold no references)"
        )
        ref_counts[block_id] = ref_count - 1
        if ref_count == 1:
            self._num_frees += 1
            if self._block_hashes[block_id] is None:
                self._free_stack.append(block_id)
            else:
                self._lru_append(block_id)

    def free_n(self, block_ids: Sequence[int]) -> None:
        """`free` each block, in order: of blocks reaching zero, the first is evicted first."""
        ref_counts = self._ref_counts
        block_hashes = self._block_hashes
        stack = self._free_stack
        num_frees = 0
        for block_id in block_ids:
            ref_count = ref_counts[block_id]
            assert ref_count > 0, (
                f"double free: block {block_id} has ref count 0 (free blocks hold no references)"
            )
            ref_counts[block_id] = ref_count - 1
            if ref_count == 1:
                num_frees += 1
                if block_hashes[block_id] is None:
                    stack.append(block_id)
                else:
                    self._lru_append(block_id)
        self._num_frees += num_frees

    def try_copy_on_write(self, block_id: int) -> int | None:
        """The block a sequence may write into in place of `block_id`.

        An unshared block is returned as is. A shared one loses this reference and a new
        block (ref count 1) is returned: the caller copies `block_id` into it before writing.

        Returns:
            The block to write into, or None when a copy is needed and the pool is exhausted
            (nothing changed).
        """
        ref_count = self._ref_counts[block_id]
        assert ref_count > 0, f"copy-on-write of block {block_id}: only used blocks are written"
        if ref_count == 1:
            assert self._block_hashes[block_id] is None, (
                f"write into block {block_id}: a block in the prefix cache is immutable"
            )
            return block_id
        new_block_id = self.try_allocate()
        if new_block_id is not None:
            self._ref_counts[block_id] = ref_count - 1
        return new_block_id

    # ------------------------------------------------------------------ prefix cache

    def get_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """What `take_cached_prefix` would reuse, without taking it: no stats, no state change.

        Returns:
            (leading blocks found, how many of them are cached-free): taking them removes
            the cached-free ones from the blocks an allocation can use.
        """
        hash_to_block = self._hash_to_block
        ref_counts = self._ref_counts
        num_hits = num_cached_free = 0
        for block_hash in block_hashes:
            block_id = hash_to_block.get(block_hash)
            if block_id is None:
                break
            num_hits += 1
            if not ref_counts[block_id]:
                num_cached_free += 1
        return num_hits, num_cached_free

    def take_cached_prefix(self, block_hashes: Sequence[BlockHash], out: list[int]) -> int:
        """Reuse the longest cached prefix of `block_hashes`: add a reference to each hit.

        Args:
            block_hashes: hashes of a sequence's full blocks, in order.
            out: receives the hit block ids.

        Returns:
            The number of leading blocks found (each counts a hit, every other block a miss).
        """
        hash_to_block = self._hash_to_block
        ref_counts = self._ref_counts
        num_hits = 0
        for block_hash in block_hashes:
            block_id = hash_to_block.get(block_hash)
            if block_id is None:
                break
            ref_count = ref_counts[block_id]
            if ref_count == 0:
                self._lru_unlink(block_id)
                self._num_cached_free -= 1
                self._num_revivals += 1
            ref_counts[block_id] = ref_count + 1
            out.append(block_id)
            num_hits += 1
        num_free = len(self._free_stack) + self._num_cached_free
        if num_free < self._min_num_free:
            self._min_num_free = num_free
        self._num_cache_hits += num_hits
        self._num_cache_misses += len(block_hashes) - num_hits
        return num_hits

    def try_cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, computed block under `block_hash` so later sequences can reuse it.

        Returns:
            False when another block already holds these contents (the first one stays the
            cache entry; this block stays uncached and is freed normally).
        """
        assert self._ref_counts[block_id] > 0, f"cache of block {block_id}: only used blocks hold computed KV"
        assert self._block_hashes[block_id] is None, f"cache of block {block_id}: it is cached already"
        if block_hash in self._hash_to_block:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_hashes[block_id] = block_hash
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after new weights); cached-free blocks become free."""
        sentinel = self.num_blocks
        while self._lru_next[sentinel] != sentinel:
            block_id = self._lru_next[sentinel]
            self._lru_unlink(block_id)
            self._free_stack.append(block_id)
        self._num_cached_free = 0
        for block_id in self._hash_to_block.values():
            self._block_hashes[block_id] = None
        self._hash_to_block.clear()

    # ------------------------------------------------------------------ internals

    def _lru_append(self, block_id: int) -> None:
        """Make a block that just became cached-free the most recently used."""
        sentinel = self.num_blocks
        last = self._lru_prev[sentinel]
        self._lru_next[last] = block_id
        self._lru_prev[block_id] = last
        self._lru_next[block_id] = sentinel
        self._lru_prev[sentinel] = block_id
        self._num_cached_free += 1

    def _evict_lru(self) -> int:
        """Take the least recently used cached-free block, dropping its cache entry."""
        block_id = self._lru_next[self.num_blocks]
        assert block_id != self.num_blocks, "eviction from an empty LRU list: callers check the count first"
        self._lru_unlink(block_id)
        self._num_cached_free -= 1
        block_hash = self._block_hashes[block_id]
        assert block_hash is not None, f"block {block_id} in the LRU list has no hash"
        del self._hash_to_block[block_hash]
        self._block_hashes[block_id] = None
        self._num_evictions += 1
        return block_id

    def _lru_unlink(self, block_id: int) -> None:
        prev_id = self._lru_prev[block_id]
        next_id = self._lru_next[block_id]
        self._lru_next[prev_id] = next_id
        self._lru_prev[next_id] = prev_id
