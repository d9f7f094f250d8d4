"""Property tests: random alloc / free / fork / write / prefix-cache sequences keep the pool sound.

The state machine drives a `KVCacheManager` (and the pool directly) and models what each
block holds: a write puts the token id into the block's slot, copy pairs copy contents. After
every step it checks that

* no block is both free and referenced, every block is in exactly one place, and each ref
  count equals the references a recount finds (never negative);
* every sequence reads back exactly its own tokens through its block table, so neither a
  write nor copy-on-write ever changed a block another sequence still shares, and a
  prefix-cache hit really holds the prompt's tokens;
* every statistic equals a recount.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shoal.shared.policy.block_pool import BlockPool
from shoal.shared.policy.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 4
# A few shared prompt heads so that prefixes repeat and the cache gets hits.
PROMPT_HEADS = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5])


class BlockPoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 24), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.pool = BlockPool(num_blocks, block_size=BLOCK_SIZE)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching=caching)
        self.tokens: dict[str, list[int]] = {}
        """Each sequence's tokens; all of them are computed (written) after every rule."""
        self.raw_blocks: list[int] = []
        """Blocks allocated from the pool directly, one reference each."""
        self.contents: dict[int, list[int | None]] = {}
        self.peak_used = 0
        self.next_seq = 0

    # ------------------------------------------------------------------ rules

    @rule(head=st.sampled_from(PROMPT_HEADS), tail=st.lists(st.integers(10, 13), max_size=9))
    def admit(self, head: list[int], tail: list[int]) -> None:
        seq_id = f"s{self.next_seq}"
        self.next_seq += 1
        prompt = head + tail
        before = self.pool.get_stats()
        num_cached = self.kv.start_sequence(seq_id, prompt)
        after_lookup = self.pool.get_stats()
        num_hits = num_cached // BLOCK_SIZE
        assert num_cached % BLOCK_SIZE == 0 and num_cached < len(prompt)
        assert after_lookup.num_cache_hits - before.num_cache_hits == num_hits
        if self.kv.enable_prefix_caching:
            num_lookups = (len(prompt) - 1) // BLOCK_SIZE
            assert after_lookup.num_cache_misses - before.num_cache_misses == num_lookups - num_hits
        # A hit must hold exactly the prompt's tokens.
        assert self._read(self.kv.get_block_ids(seq_id), num_cached) == prompt[:num_cached]
        self.tokens[seq_id] = prompt[:num_cached]
        if not self._write(seq_id, prompt[num_cached:]):
            self.kv.free(seq_id)
            del self.tokens[seq_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(20, 23), min_size=1, max_size=6))
    def append(self, data: st.DataObject, new_tokens: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self._write(seq_id, new_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = f"s{self.next_seq}"
        self.next_seq += 1
        self.kv.fork(parent, child, len(self.tokens[parent]))
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        block_ids = self.kv.get_block_ids(seq_id)
        num_released = sum(self.pool.get_ref_count(block_id) == 1 for block_id in block_ids)
        before = self.pool.get_stats().num_frees
        self.kv.free(seq_id)
        del self.tokens[seq_id]
        assert self.pool.get_stats().num_frees - before == num_released

    @rule(num_blocks=st.integers(0, 6))
    def raw_allocate(self, num_blocks: int) -> None:
        before = self.pool.get_stats()
        fits = num_blocks <= before.num_free_blocks
        assert self.pool.try_allocate_n(num_blocks, self.raw_blocks) == fits
        after = self.pool.get_stats()
        assert after.num_allocations - before.num_allocations == (num_blocks if fits else 0)
        for block_id in self.raw_blocks[len(self.raw_blocks) - (num_blocks if fits else 0) :]:
            self.contents[block_id] = [None] * BLOCK_SIZE

    @precondition(lambda self: self.raw_blocks)
    @rule(data=st.data())
    def raw_free(self, data: st.DataObject) -> None:
        num_blocks = data.draw(st.integers(1, len(self.raw_blocks)))
        released, self.raw_blocks = self.raw_blocks[:num_blocks], self.raw_blocks[num_blocks:]
        before = self.pool.get_stats().num_frees
        self.pool.free_n(released)
        assert self.pool.get_stats().num_frees - before == num_blocks

    # ------------------------------------------------------------------ invariants

    @invariant()
    def blocks_are_in_exactly_one_place(self) -> None:
        if not hasattr(self, "pool"):
            return
        references = Counter(self.raw_blocks)
        for seq_id in self.tokens:
            references.update(self.kv.get_block_ids(seq_id))
        free_block_ids = self.pool.get_free_block_ids()
        assert len(free_block_ids) == len(set(free_block_ids)), "a block is on a free list twice"
        assert not set(free_block_ids) & set(references), "a block is both free and referenced"
        assert set(free_block_ids) | set(references) == set(range(self.pool.num_blocks))
        for block_id in range(self.pool.num_blocks):
            ref_count = self.pool.get_ref_count(block_id)
            assert ref_count >= 0
            assert ref_count == references[block_id], f"block {block_id}: ref count vs recount"

    @invariant()
    def sequences_read_their_own_tokens(self) -> None:
        if not hasattr(self, "pool"):
            return
        for seq_id, token_ids in self.tokens.items():
            assert self._read(self.kv.get_block_ids(seq_id), len(token_ids)) == token_ids, seq_id

    @invariant()
    def stats_match_a_recount(self) -> None:
        if not hasattr(self, "pool"):
            return
        stats = self.pool.get_stats()
        ref_counts = [self.pool.get_ref_count(block_id) for block_id in range(self.pool.num_blocks)]
        hashed = [self.pool.get_block_hash(block_id) is not None for block_id in range(self.pool.num_blocks)]
        num_used = sum(ref_count > 0 for ref_count in ref_counts)
        self.peak_used = max(self.peak_used, num_used)
        assert stats.num_used_blocks == num_used
        assert stats.num_free_blocks == self.pool.num_blocks - num_used
        assert stats.num_cached_blocks == sum(hashed)
        assert stats.num_cached_free_blocks == sum(
            ref_count == 0 and is_hashed for ref_count, is_hashed in zip(ref_counts, hashed, strict=True)
        )
        assert stats.num_peak_used_blocks >= self.peak_used
        assert stats.num_peak_used_blocks <= self.pool.num_blocks
        assert stats.num_frees <= stats.num_allocations + stats.num_cache_hits
        assert stats.utilization == num_used / self.pool.num_blocks

    # ------------------------------------------------------------------ model of block contents

    def _write(self, seq_id: str, new_tokens: list[int]) -> bool:
        """Compute `new_tokens` of a sequence: allocate, apply copies, write, register."""
        token_ids = self.tokens[seq_id]
        num_computed = len(token_ids)
        table_before = list(self.kv.get_block_ids(seq_id))
        allocations_before = self.pool.get_stats().num_allocations
        if not self.kv.try_allocate_slots(seq_id, num_computed, len(new_tokens)):
            assert self.kv.get_block_ids(seq_id) == table_before, "a failed allocation changed the table"
            return False
        block_ids = self.kv.get_block_ids(seq_id)
        copy_pairs = self.kv.take_copy_pairs()
        for src, dst in copy_pairs:
            self.contents[dst] = list(self.contents[src])
        num_new_blocks = len(block_ids) - len(table_before) + len(copy_pairs)
        assert self.pool.get_stats().num_allocations - allocations_before == num_new_blocks
        for block_id in block_ids[len(table_before) :]:
            self.contents[block_id] = [None] * BLOCK_SIZE
        for position, token_id in enumerate(new_tokens, start=num_computed):
            block_id = block_ids[position // BLOCK_SIZE]
            assert self.pool.get_ref_count(block_id) == 1, f"write into shared block {block_id}"
            assert self.pool.get_block_hash(block_id) is None, f"write into cached block {block_id}"
            self.contents[block_id][position % BLOCK_SIZE] = token_id
        token_ids += new_tokens
        self.kv.register_computed_blocks(seq_id, token_ids, len(token_ids))
        return True

    def _read(self, block_ids: list[int], num_tokens: int) -> list[int | None]:
        return [self.contents[block_ids[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(num_tokens)]


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
