"""Per-sequence block tables over a `BlockPool`: growth, prefix reuse, fork and copy-on-write.

A sequence's token at position `p` lives in block `block_ids[p // block_size]` at offset
`p % block_size` (its slot is `block_id * block_size + offset`). Full blocks are
identified by a hash chained over their prefix::

    tokens   | t0 .. t15 | t16 .. t31 | t32 .. t40 (partial)
    blocks   |    b7     |    b2      |    b9
    hashes   |  h0 = H(-, t0..15) | h1 = H(h0, t16..31) | (none until full)

so equal hashes mean equal prefixes, and a new sequence whose prompt starts with known
blocks reuses them (ref count + 1) instead of recomputing their K/V. Only full blocks
before the prompt's last token are reused: the last token is always computed (its logits
are needed), so no sequence ever writes into a shared cached block.

Copy-on-write: after `fork` two sequences share their blocks, including a partial last
block. The first of them to write into a shared block gets a fresh copy; the (src, dst)
pairs leave through `take_copy_pairs` for the engine's `copy_blocks` kernel, which must run
before the step's forward pass.

Pure and synchronous: no torch, no I/O.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from shoal.shared.kv_cache.block_pool import BlockHash, BlockPool


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of a full block: 128-bit BLAKE2b over the parent's hash and the block's tokens.

    Stable across processes and runs (unlike Python's `hash`), and wide enough that two
    different prefixes never collide in practice (a collision would silently reuse wrong K/V).
    """
    digest = hashlib.blake2b(parent_hash or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, num_blocks: int, parent_hash: BlockHash | None = None
) -> list[BlockHash]:
    """Chained hashes of the first `num_blocks` full blocks of `token_ids` (after `parent_hash`)."""
    block_hashes: list[BlockHash] = []
    for index in range(num_blocks):
        parent_hash = hash_block_tokens(parent_hash, token_ids[index * block_size : (index + 1) * block_size])
        block_hashes.append(parent_hash)
    return block_hashes


class KVCacheManager:
    """Block tables of the sequences of one model replica.

    Args:
        pool: the blocks to allocate from.
        enable_prefix_caching: reuse cached full blocks across sequences (and keep freed
            full blocks reusable until evicted).
    """

    def __init__(self, pool: BlockPool, *, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._block_tables: dict[str, list[int]] = {}
        # Hashes of each sequence's leading full blocks, as far as known.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of each sequence are registered in the prefix cache (or
        # were offered and turned down as duplicates): registration resumes from here.
        self._num_registered_blocks: dict[str, int] = {}
        self._copy_pairs: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ queries

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._block_tables

    def get_block_ids(self, seq_id: str) -> list[int]:
        """The sequence's block table (the live list: read it, do not change it)."""
        return self._block_tables[seq_id]

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def get_num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def get_num_new_blocks(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Blocks `try_allocate_slots` would take from the pool for these arguments."""
        block_ids = self._block_tables[seq_id]
        num_needed = self.get_num_blocks_for(num_computed_tokens + num_new_tokens) - len(block_ids)
        return max(0, num_needed) + int(self._needs_copy(block_ids, num_computed_tokens, num_new_tokens))

    # ------------------------------------------------------------------ lifecycle

    def start_sequence(
        self, seq_id: str, token_ids: Sequence[int], block_hashes: list[BlockHash] | None = None
    ) -> int:
        """Open an empty block table for `seq_id`, reusing the longest cached prefix of `token_ids`.

        Args:
            block_hashes: the sequence's own list of its full blocks' hashes, as far as
                known (see `try_start_sequence`); None for a fresh one.

        Returns:
            The number of leading tokens whose K/V is already in the reused blocks (a
            multiple of `block_size`, always less than `len(token_ids)`).
        """
        assert seq_id not in self._block_tables, f"sequence {seq_id!r} already has a block table"
        if block_hashes is None:
            block_hashes = []
        block_ids: list[int] = []
        if self.enable_prefix_caching and token_ids:
            self.pool.take_cached_prefix(self._get_prompt_hashes(token_ids, block_hashes), block_ids)
        self._open(seq_id, block_ids, block_hashes)
        return len(block_ids) * self.block_size

    def try_start_sequence(
        self, seq_id: str, token_ids: Sequence[int], max_num_new_tokens: int, block_hashes: list[BlockHash],
        *, reuse_prefix: bool = True,
    ) -> int | None:
        """`start_sequence` plus room for its first chunk, all or nothing.

        Looks the prompt up without taking anything first (`BlockPool.get_cached_prefix`),
        so a sequence that does not fit yet changes nothing and counts nothing: it may be
        tried again every step without inflating the cache's hit, miss or free counts.

        Args:
            token_ids: the sequence's tokens (prompt, and generated ones after preemption).
            max_num_new_tokens: most tokens to make room for after the reused prefix (the
                step's remaining budget); positive.
            block_hashes: the sequence's own list of its full blocks' hashes; extended in
                place as far as the prompt's reusable blocks and, while the sequence runs,
                as blocks fill, so a prompt is hashed once however often it is tried and
                however often it is preempted. Its entries must be hashes of these
                `token_ids`: a sequence's tokens only ever grow at the end.
            reuse_prefix: False computes every token (a request that scores its prompt
                needs every prompt row); its blocks still join the cache as they fill.

        Returns:
            The number of reused leading tokens (room is made for the next
            ``min(len(token_ids) - that, max_num_new_tokens)`` tokens), or None when the
            pool cannot supply the blocks.
        """
        assert seq_id not in self._block_tables, f"sequence {seq_id!r} already has a block table"
        prompt_hashes, num_cached_blocks, num_new_blocks, num_needed = self._plan_start(
            token_ids, max_num_new_tokens, block_hashes, reuse_prefix
        )
        num_computed_tokens = num_cached_blocks * self.block_size
        if num_needed > self.pool.get_num_free_blocks():
            return None
        block_ids: list[int] = []
        if prompt_hashes:
            num_hits = self.pool.take_cached_prefix(prompt_hashes, block_ids)
            assert num_hits == num_cached_blocks, "a prefix lookup and the take right after it must agree"
        allocated = self.pool.try_allocate_n(num_new_blocks, block_ids)
        assert allocated, "allocation must succeed when free blocks were counted"
        self._open(seq_id, block_ids, block_hashes, num_registered_blocks=num_cached_blocks)
        return num_computed_tokens

    def get_num_blocks_to_start(
        self, token_ids: Sequence[int], max_num_new_tokens: int, block_hashes: list[BlockHash],
        *, reuse_prefix: bool = True,
    ) -> int:
        """Free blocks `try_start_sequence` with these arguments needs (cached-free blocks
        it would revive included); extends `block_hashes` as that would."""
        return self._plan_start(token_ids, max_num_new_tokens, block_hashes, reuse_prefix)[3]

    def adopt_sequence(
        self, seq_id: str, block_ids: list[int], block_hashes: list[BlockHash], num_registered_blocks: int
    ) -> None:
        """Open a block table made of blocks the caller already holds references to (a chat
        session's KV restored by the engine's session cache).

        Args:
            block_hashes: the sequence's own list of its full blocks' hashes, as far as known.
            num_registered_blocks: leading blocks registration resumes after: blocks before it
                are registered by the caller (`register_blocks`), or left out.
        """
        assert seq_id not in self._block_tables, f"sequence {seq_id!r} already has a block table"
        self._open(seq_id, block_ids, block_hashes, num_registered_blocks)

    def register_blocks(self, seq_id: str, start: int, end: int) -> None:
        """Put blocks `start`..`end` - 1 of the sequence into the prefix cache, where their
        hash is known and they are not cached already (their K/V must be, or be about to be,
        written before any forward pass reads them)."""
        if not self.enable_prefix_caching:
            return
        block_ids = self._block_tables[seq_id]
        block_hashes = self._block_hashes[seq_id]
        pool = self.pool
        for index in range(start, min(end, len(block_hashes))):
            block_id = block_ids[index]
            if pool.get_block_hash(block_id) is None:
                pool.try_cache_block(block_id, block_hashes[index])

    def detach(self, seq_id: str) -> list[int]:
        """Close the sequence's block table without freeing: its references pass to the caller."""
        del self._block_hashes[seq_id]
        del self._num_registered_blocks[seq_id]
        return self._block_tables.pop(seq_id)

    def try_allocate_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` K/V entries after the first `num_computed_tokens`.

        Appends blocks as needed and replaces a shared block about to be written by a
        private copy (the pair leaves through `take_copy_pairs`). All or nothing.

        Returns:
            False (nothing changed) when the pool cannot supply the blocks.
        """
        block_ids = self._block_tables[seq_id]
        num_needed = self.get_num_blocks_for(num_computed_tokens + num_new_tokens) - len(block_ids)
        needs_copy = self._needs_copy(block_ids, num_computed_tokens, num_new_tokens)
        if max(0, num_needed) + needs_copy > self.pool.get_num_free_blocks():
            return False
        if needs_copy:
            index = num_computed_tokens // self.block_size
            src_block_id = block_ids[index]
            dst_block_id = self.pool.try_copy_on_write(src_block_id)
            assert dst_block_id is not None and dst_block_id != src_block_id, (
                "copy-on-write of a shared block must yield a new block when free blocks were counted"
            )
            block_ids[index] = dst_block_id
            self._copy_pairs.append((src_block_id, dst_block_id))
        if num_needed > 0:
            allocated = self.pool.try_allocate_n(num_needed, block_ids)
            assert allocated, "allocation must succeed when free blocks were counted"
        return True

    def register_computed_blocks(
        self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Put the sequence's blocks that are now full and computed into the prefix cache.

        Args:
            token_ids: the sequence's tokens (at least `num_computed_tokens` of them).
            num_computed_tokens: tokens whose K/V is now written.
        """
        if not self.enable_prefix_caching:
            return
        num_full_blocks = num_computed_tokens // self.block_size
        num_registered = self._num_registered_blocks[seq_id]
        if num_full_blocks <= num_registered:
            return
        block_ids = self._block_tables[seq_id]
        block_hashes = self._block_hashes[seq_id]
        if len(block_hashes) < num_full_blocks:
            start = len(block_hashes)
            parent_hash = block_hashes[-1] if block_hashes else None
            block_hashes += hash_full_blocks(
                token_ids[start * self.block_size :], self.block_size, num_full_blocks - start, parent_hash
            )
        for index in range(num_registered, num_full_blocks):
            self.pool.try_cache_block(block_ids[index], block_hashes[index])
        self._num_registered_blocks[seq_id] = num_full_blocks

    def fork(self, parent_seq_id: str, child_seq_id: str, num_computed_tokens: int) -> None:
        """Give `child_seq_id` the parent's blocks for its first `num_computed_tokens` tokens, shared."""
        assert child_seq_id not in self._block_tables, f"sequence {child_seq_id!r} already has a block table"
        shared_block_ids = self._block_tables[parent_seq_id][: self.get_num_blocks_for(num_computed_tokens)]
        self.pool.share(shared_block_ids)
        num_registered = min(self._num_registered_blocks[parent_seq_id], len(shared_block_ids))
        self._block_tables[child_seq_id] = shared_block_ids
        self._block_hashes[child_seq_id] = self._block_hashes[parent_seq_id][:num_registered]
        self._num_registered_blocks[child_seq_id] = num_registered

    def free(self, seq_id: str) -> None:
        """Drop the sequence's block table and its references (last block first, so a freed
        chain is evicted from its tail: its head is the part other prompts most often share)."""
        block_ids = self._block_tables.pop(seq_id)
        del self._block_hashes[seq_id]
        del self._num_registered_blocks[seq_id]
        self.pool.free_n(block_ids[::-1])

    def take_copy_pairs(self) -> list[tuple[int, int]]:
        """(src, dst) block pairs to copy before the next forward pass; drains them."""
        copy_pairs = self._copy_pairs
        self._copy_pairs = []
        return copy_pairs

    # ------------------------------------------------------------------ internals

    def _open(
        self,
        seq_id: str,
        block_ids: list[int],
        block_hashes: list[BlockHash],
        num_registered_blocks: int | None = None,
    ) -> None:
        self._block_tables[seq_id] = block_ids
        self._block_hashes[seq_id] = block_hashes
        self._num_registered_blocks[seq_id] = (
            len(block_ids) if num_registered_blocks is None else num_registered_blocks
        )

    def _plan_start(
        self, token_ids: Sequence[int], max_num_new_tokens: int, block_hashes: list[BlockHash], reuse_prefix: bool
    ) -> tuple[Sequence[BlockHash], int, int, int]:
        """(prompt hashes, cached leading blocks, new blocks, free blocks needed) of a start."""
        assert max_num_new_tokens > 0, f"max_num_new_tokens must be positive, got {max_num_new_tokens}"
        prompt_hashes: Sequence[BlockHash] = ()
        num_cached_blocks = num_cached_free = 0
        if self.enable_prefix_caching and reuse_prefix:
            prompt_hashes = self._get_prompt_hashes(token_ids, block_hashes)
            num_cached_blocks, num_cached_free = self.pool.get_cached_prefix(prompt_hashes)
        num_computed_tokens = num_cached_blocks * self.block_size
        num_new_tokens = min(len(token_ids) - num_computed_tokens, max_num_new_tokens)
        # The new chunk starts at a block boundary, so it never writes into a shared block.
        num_new_blocks = self.get_num_blocks_for(num_computed_tokens + num_new_tokens) - num_cached_blocks
        return prompt_hashes, num_cached_blocks, num_new_blocks, num_new_blocks + num_cached_free

    def _get_prompt_hashes(self, token_ids: Sequence[int], block_hashes: list[BlockHash]) -> list[BlockHash]:
        """Hashes of the full blocks of `token_ids` a new sequence may reuse (all but the one
        holding its last token), extending `block_hashes` in place where it is short."""
        num_reusable_blocks = max(0, len(token_ids) - 1) // self.block_size
        num_known = len(block_hashes)
        if num_known < num_reusable_blocks:
            block_hashes += hash_full_blocks(
                token_ids[num_known * self.block_size :],
                self.block_size,
                num_reusable_blocks - num_known,
                block_hashes[-1] if block_hashes else None,
            )
        return block_hashes if num_known <= num_reusable_blocks else block_hashes[:num_reusable_blocks]

    def _needs_copy(self, block_ids: list[int], num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Whether the first write lands in a partially filled block someone else shares."""
        if num_new_tokens <= 0 or num_computed_tokens % self.block_size == 0:
            return False
        index = num_computed_tokens // self.block_size
        return index < len(block_ids) and self.pool.get_ref_count(block_ids[index]) > 1
