"""Property tests: random alloc / free / fork / write / prefix-cache sequences keep the pool sound.

The state machine drives a `KVCacheManager` (and the pool directly) and models what each
block holds: a write puts the token id into the block's slot, copy pairs copy contents. After
every step it checks that

* no block is both free and referenced, every block is in exactly one place, and each ref
  count equals the references a recount finds (never negative);
* every sequence reads back exactly its own tokens through its block table, so neither a
  write nor copy-on-write ever changed a block another sequence still shares, and a
  prefix-cache hit really holds the prompt's tokens;
* every statistic equals a recount: used, free and cached blocks from the blocks' states;
  the peak, allocations, frees, cache hits and misses from a model that counts what each
  rule did (the peak sampled after every change inside a rule, so a transient peak counts).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shoal.shared.kv_cache.block_pool import BlockPool
from shoal.shared.kv_cache.manager import KVCacheManager

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
        self.hashes: dict[str, list[bytes]] = {}
        """Each sequence's own block-hash list (what the engine keeps on its Sequence)."""
        self.peak_used = 0
        self.num_allocations = self.num_frees = self.num_hits = self.num_misses = 0
        self.next_seq = 0

    # ------------------------------------------------------------------ rules

    @rule(head=st.sampled_from(PROMPT_HEADS), tail=st.lists(st.integers(10, 13), max_size=9))
    def admit(self, head: list[int], tail: list[int]) -> None:
        seq_id = f"s{self.next_seq}"
        self.next_seq += 1
        prompt = head + tail
        before = self.pool.get_stats()
        num_cached = self.kv.start_sequence(seq_id, prompt)
        self._observe_peak()
        after_lookup = self.pool.get_stats()
        num_hits = num_cached // BLOCK_SIZE
        assert num_cached % BLOCK_SIZE == 0 and num_cached < len(prompt)
        assert after_lookup.num_cache_hits - before.num_cache_hits == num_hits
        self._count_lookup(prompt, num_hits)
        # A hit must hold exactly the prompt's tokens.
        assert self._read(self.kv.get_block_ids(seq_id), num_cached) == prompt[:num_cached]
        self.tokens[seq_id] = prompt[:num_cached]
        if not self._write(seq_id, prompt[num_cached:]):
            self._free_sequence(seq_id)

    @rule(
        head=st.sampled_from(PROMPT_HEADS),
        tail=st.lists(st.integers(10, 13), max_size=9),
        budget=st.integers(1, 12),
        num_tries=st.integers(1, 3),
    )
    def try_admit(self, head: list[int], tail: list[int], budget: int, num_tries: int) -> None:
        """The scheduler's admission: look up, and take the prefix only if the chunk fits."""
        seq_id = f"s{self.next_seq}"
        self.next_seq += 1
        prompt = head + tail
        block_hashes: list[bytes] = []
        for _ in range(num_tries):  # a sequence that does not fit is tried again each step
            before = self.pool.get_stats()
            num_cached = self.kv.try_start_sequence(seq_id, prompt, budget, block_hashes)
            if num_cached is None:
                assert self.pool.get_stats() == before, "a sequence that does not fit changed the pool"
                assert not self.kv.has_sequence(seq_id)
                continue
            self._observe_peak()
            num_new = min(len(prompt) - num_cached, budget)
            block_ids = self.kv.get_block_ids(seq_id)
            assert len(block_ids) == -(-(num_cached + num_new) // BLOCK_SIZE)
            assert self._read(block_ids, num_cached) == prompt[:num_cached]
            self._count_lookup(prompt, num_cached // BLOCK_SIZE)
            self.num_allocations += len(block_ids) - num_cached // BLOCK_SIZE
            for block_id in block_ids[num_cached // BLOCK_SIZE :]:
                self.contents[block_id] = [None] * BLOCK_SIZE
            self.tokens[seq_id] = prompt[:num_cached]
            self.hashes[seq_id] = block_hashes
            self._write_allocated(seq_id, prompt[num_cached : num_cached + num_new])
            # The rest of the prompt in chunks (its hashes were taken from these tokens).
            for start in range(num_cached + num_new, len(prompt), budget):
                if not self._write(seq_id, prompt[start : start + budget]):
                    self._free_sequence(seq_id)
                    return
            return

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
        self._free_sequence(seq_id)

    @rule(num_blocks=st.integers(0, 6))
    def raw_allocate(self, num_blocks: int) -> None:
        before = self.pool.get_stats()
        fits = num_blocks <= before.num_free_blocks
        assert self.pool.try_allocate_n(num_blocks, self.raw_blocks) == fits
        self._observe_peak()
        after = self.pool.get_stats()
        assert after.num_allocations - before.num_allocations == (num_blocks if fits else 0)
        self.num_allocations += num_blocks if fits else 0
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
        self.num_frees += num_blocks

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
        assert stats.num_used_blocks == num_used
        assert stats.num_free_blocks == self.pool.num_blocks - num_used
        assert stats.num_cached_blocks == sum(hashed)
        assert stats.num_cached_free_blocks == sum(
            ref_count == 0 and is_hashed for ref_count, is_hashed in zip(ref_counts, hashed, strict=True)
        )
        assert stats.num_peak_used_blocks == self.peak_used
        assert stats.num_allocations == self.num_allocations
        assert stats.num_frees == self.num_frees
        assert (stats.num_cache_hits, stats.num_cache_misses) == (self.num_hits, self.num_misses)
        assert stats.utilization == num_used / self.pool.num_blocks

    # ------------------------------------------------------------------ the model's counters

    def _observe_peak(self) -> None:
        """Sample the used blocks after a change that may raise them (the pool's peak must
        be the exact maximum, not just at least what the invariants happened to see)."""
        num_used = sum(self.pool.get_ref_count(block_id) > 0 for block_id in range(self.pool.num_blocks))
        self.peak_used = max(self.peak_used, num_used)

    def _count_lookup(self, prompt: list[int], num_hits: int) -> None:
        if self.kv.enable_prefix_caching:
            num_lookups = (len(prompt) - 1) // BLOCK_SIZE
            self.num_hits += num_hits
            self.num_misses += num_lookups - num_hits

    def _free_sequence(self, seq_id: str) -> None:
        block_ids = self.kv.get_block_ids(seq_id)
        num_released = sum(self.pool.get_ref_count(block_id) == 1 for block_id in block_ids)
        before = self.pool.get_stats().num_frees
        self.kv.free(seq_id)
        del self.tokens[seq_id]
        self.hashes.pop(seq_id, None)
        assert self.pool.get_stats().num_frees - before == num_released
        self.num_frees += num_released

    # ------------------------------------------------------------------ model of block contents

    def _write(self, seq_id: str, new_tokens: list[int]) -> bool:
        """Compute `new_tokens` of a sequence: allocate, apply copies, write, register."""
        num_computed = len(self.tokens[seq_id])
        table_before = list(self.kv.get_block_ids(seq_id))
        allocations_before = self.pool.get_stats().num_allocations
        if not self.kv.try_allocate_slots(seq_id, num_computed, len(new_tokens)):
            assert self.kv.get_block_ids(seq_id) == table_before, "a failed allocation changed the table"
            return False
        self._observe_peak()
        block_ids = self.kv.get_block_ids(seq_id)
        copy_pairs = self.kv.take_copy_pairs()
        for src, dst in copy_pairs:
            self.contents[dst] = list(self.contents[src])
        num_new_blocks = len(block_ids) - len(table_before) + len(copy_pairs)
        assert self.pool.get_stats().num_allocations - allocations_before == num_new_blocks
        self.num_allocations += num_new_blocks
        # A copy-on-write dropped this sequence's reference to a shared block: never to zero.
        for block_id in block_ids[len(table_before) :]:
            self.contents[block_id] = [None] * BLOCK_SIZE
        self._write_allocated(seq_id, new_tokens)
        return True

    def _write_allocated(self, seq_id: str, new_tokens: list[int]) -> None:
        """Write `new_tokens` into slots already allocated, then register full blocks."""
        token_ids = self.tokens[seq_id]
        block_ids = self.kv.get_block_ids(seq_id)
        for position, token_id in enumerate(new_tokens, start=len(token_ids)):
            block_id = block_ids[position // BLOCK_SIZE]
            assert self.pool.get_ref_count(block_id) == 1, f"write into shared block {block_id}"
            assert self.pool.get_block_hash(block_id) is None, f"write into cached block {block_id}"
            self.contents[block_id][position % BLOCK_SIZE] = token_id
        token_ids += new_tokens
        self.kv.register_computed_blocks(seq_id, token_ids, len(token_ids))
        block_hashes = self.hashes.get(seq_id)
        if block_hashes is not None and self.kv.enable_prefix_caching:
            # The caller's list is the manager's: extended in place as blocks fill.
            assert len(block_hashes) >= len(token_ids) // BLOCK_SIZE

    def _read(self, block_ids: list[int], num_tokens: int) -> list[int | None]:
        return [self.contents[block_ids[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(num_tokens)]


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
