"""KVCacheManager: block tables, prefix reuse, fork and copy-on-write, on small pools."""

from __future__ import annotations

import pytest

from shoal.shared.kv_cache.block_pool import BlockPool
from shoal.shared.kv_cache.manager import KVCacheManager, hash_block_tokens, hash_full_blocks


def _manager(num_blocks: int = 11, *, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, block_size=4), enable_prefix_caching=caching)


def _prefill(kv: KVCacheManager, seq_id: str, token_ids: list[int]) -> int:
    """Admit a sequence and compute its whole prompt; returns the reused token count."""
    num_cached = kv.start_sequence(seq_id, token_ids)
    assert kv.try_allocate_slots(seq_id, num_cached, len(token_ids) - num_cached)
    kv.register_computed_blocks(seq_id, token_ids, len(token_ids))
    return num_cached


def test_block_hashes_chain_over_the_prefix() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(first) == 16
    assert hash_block_tokens(None, [1, 2, 3, 4]) == first
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_full_blocks(list(range(1, 11)), 4, 2) == [first, hash_block_tokens(first, [5, 6, 7, 8])]


def test_slots_grow_block_by_block() -> None:
    kv = _manager()
    assert kv.start_sequence("a", [1, 2, 3, 4, 5]) == 0
    assert kv.try_allocate_slots("a", 0, 5)
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.try_allocate_slots("a", 5, 3)  # fills block 1: nothing new
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.try_allocate_slots("a", 8, 1)
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.get_num_new_blocks("a", 9, 4) == 1
    assert kv.take_copy_pairs() == []


def test_allocation_is_all_or_nothing() -> None:
    kv = _manager(num_blocks=3)
    kv.start_sequence("a", [1] * 9)
    assert not kv.try_allocate_slots("a", 0, 13)
    assert kv.get_block_ids("a") == []
    assert kv.get_num_free_blocks() == 3
    assert kv.try_allocate_slots("a", 0, 12)


def test_a_known_prefix_reuses_cached_blocks() -> None:
    kv = _manager()
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    assert _prefill(kv, "a", prompt) == 0
    assert kv.get_block_ids("a") == [0, 1, 2]
    # Same first 8 tokens, different tail: both full blocks are reused.
    assert _prefill(kv, "b", [*prompt[:8], 99, 98, 97]) == 8
    assert kv.get_block_ids("b") == [0, 1, 3]
    stats = kv.pool.get_stats()
    # "a" looked up 2 blocks and missed both; "b" hit both.
    assert (stats.num_cache_hits, stats.num_cache_misses, stats.num_allocations) == (2, 2, 4)
    assert [kv.pool.get_ref_count(block_id) for block_id in (0, 1, 2, 3)] == [2, 2, 1, 1]


def test_the_last_prompt_token_is_always_computed() -> None:
    kv = _manager()
    prompt = list(range(1, 9))  # exactly 2 full blocks
    _prefill(kv, "a", prompt)
    # The second block holds the last token, whose logits are needed: only block 0 is reused.
    assert kv.start_sequence("b", prompt) == 4
    assert kv.try_allocate_slots("b", 4, 4)
    assert kv.get_block_ids("b") == [0, 2]


def test_freed_blocks_stay_reusable_until_evicted() -> None:
    kv = _manager(num_blocks=4)
    prompt = list(range(1, 10))  # 2 full blocks + 1
    _prefill(kv, "a", prompt)
    kv.free("a")
    assert kv.pool.get_stats().num_cached_free_blocks == 2
    assert _prefill(kv, "b", prompt) == 8
    assert kv.get_block_ids("b") == [0, 1, 2]
    kv.free("b")
    # A prompt needing the whole pool evicts the cached blocks (tail of the chain first).
    assert _prefill(kv, "c", list(range(50, 66))) == 0
    assert kv.get_block_ids("c") == [2, 3, 1, 0]
    assert kv.pool.get_stats().num_evictions == 2
    kv.free("c")
    assert kv.start_sequence("d", prompt) == 0


def test_prefix_caching_off_reuses_nothing() -> None:
    kv = _manager(caching=False)
    prompt = list(range(1, 11))
    _prefill(kv, "a", prompt)
    assert _prefill(kv, "b", prompt) == 0
    assert kv.get_block_ids("b") == [3, 4, 5]
    assert kv.pool.get_stats().num_cached_blocks == 0


def test_generated_tokens_fill_blocks_that_become_cacheable() -> None:
    kv = _manager()
    token_ids = [1, 2, 3]
    _prefill(kv, "a", token_ids)
    for token_id in (4, 5, 6):  # decode one by one
        token_ids.append(token_id)
        num_computed = len(token_ids) - 1
        assert kv.try_allocate_slots("a", num_computed, 1)
        kv.register_computed_blocks("a", token_ids, num_computed + 1)
    assert kv.pool.get_stats().num_cached_blocks == 1
    assert kv.start_sequence("b", [1, 2, 3, 4, 7]) == 4


def test_fork_shares_blocks_and_copies_the_partial_block_on_first_write() -> None:
    kv = _manager()
    prompt = [1, 2, 3, 4, 5, 6]
    _prefill(kv, "parent", prompt)
    kv.fork("parent", "child", num_computed_tokens=6)
    assert kv.get_block_ids("child") == [0, 1]
    assert kv.pool.get_ref_count(1) == 2
    # The child writes token 7 into the shared partial block: it gets a copy.
    assert kv.try_allocate_slots("child", 6, 1)
    assert kv.get_block_ids("child") == [0, 2]
    assert kv.take_copy_pairs() == [(1, 2)]
    assert kv.take_copy_pairs() == []
    # The parent is now the only owner of block 1 and writes in place.
    assert kv.try_allocate_slots("parent", 6, 1)
    assert kv.get_block_ids("parent") == [0, 1]
    assert kv.take_copy_pairs() == []
    assert [kv.pool.get_ref_count(block_id) for block_id in (0, 1, 2)] == [2, 1, 1]


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    kv = _manager()
    _prefill(kv, "parent", [1, 2, 3, 4])
    kv.fork("parent", "child", num_computed_tokens=4)
    assert kv.try_allocate_slots("child", 4, 1)
    assert kv.get_block_ids("child") == [0, 1]
    assert kv.take_copy_pairs() == []


def test_copy_on_write_counts_the_copy_in_all_or_nothing() -> None:
    kv = _manager(num_blocks=3)
    _prefill(kv, "parent", [1, 2, 3, 4, 5, 6])
    kv.fork("parent", "child", 6)
    # 1 copy + 1 new block needed, 1 free: nothing changes.
    assert kv.get_num_new_blocks("child", 6, 3) == 2
    assert not kv.try_allocate_slots("child", 6, 3)
    assert kv.get_block_ids("child") == [0, 1]
    assert kv.take_copy_pairs() == []
    assert kv.try_allocate_slots("child", 6, 2)
    assert kv.take_copy_pairs() == [(1, 2)]


def test_free_releases_every_reference() -> None:
    kv = _manager()
    _prefill(kv, "a", [1, 2, 3, 4, 5])
    kv.fork("a", "b", 5)
    kv.free("a")
    assert kv.pool.get_stats().num_used_blocks == 2
    kv.free("b")
    assert kv.pool.get_stats().num_used_blocks == 0
    assert not kv.has_sequence("a")
    with pytest.raises(KeyError):
        kv.free("a")


def test_try_start_takes_the_prefix_only_when_the_chunk_fits() -> None:
    kv = _manager(num_blocks=5)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    _prefill(kv, "a", prompt)
    kv.free("a")  # blocks 1, 0 cached-free (in that eviction order), 2 free
    assert kv.try_allocate_slots(_open(kv, "filler"), 0, 8)  # takes the free blocks 2, 3
    before = kv.pool.get_stats()
    hashes: list[bytes] = []
    # 14 tokens: 2 cached blocks, 2 more needed, but reviving the 2 leaves only block 4.
    assert kv.try_start_sequence("b", [*prompt[:8], 5, 6, 7, 8, 9, 10], 16, hashes) is None
    assert not kv.has_sequence("b") and kv.pool.get_stats() == before
    assert hashes == [*hash_full_blocks(prompt, 4, 2), hash_block_tokens(hashes[1], [5, 6, 7, 8])]
    # A budget of 4 needs only block 4 after the reused 8 tokens.
    assert kv.try_start_sequence("b", [*prompt[:8], 5, 6, 7, 8, 9, 10], 4, hashes) == 8
    assert kv.get_block_ids("b") == [0, 1, 4]
    stats = kv.pool.get_stats()
    assert (
        stats.num_cache_hits - before.num_cache_hits,
        stats.num_cache_misses - before.num_cache_misses,
    ) == (2, 1)
    assert stats.num_allocations - before.num_allocations == 1
    kv.register_computed_blocks("b", [*prompt[:8], 5, 6, 7, 8, 9, 10], 12)
    assert kv.pool.get_cached_block(hashes[2]) == 4, "the precomputed hash registers block 4"


def _open(kv: KVCacheManager, seq_id: str) -> str:
    kv.start_sequence(seq_id, [])
    return seq_id
