"""BlockPool on an 11-block pool, with exact block ids (as vLLM's block pool tests do)."""

from __future__ import annotations

import pytest

from shoal.shared.kv_cache.block_pool import BlockPool


def _hash(name: str) -> bytes:
    return name.encode().ljust(16, b".")


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_blocks=11, block_size=4, block_bytes=1000)


def _allocate(pool: BlockPool, num_blocks: int) -> list[int]:
    block_ids: list[int] = []
    assert pool.try_allocate_n(num_blocks, block_ids)
    return block_ids


def test_fresh_pool_hands_out_ascending_ids(pool: BlockPool) -> None:
    assert _allocate(pool, 3) == [0, 1, 2]
    assert pool.try_allocate() == 3
    assert _allocate(pool, 2) == [4, 5]
    assert [pool.get_ref_count(block_id) for block_id in range(11)] == [1] * 6 + [0] * 5
    assert pool.get_free_block_ids() == [6, 7, 8, 9, 10]


def test_allocate_n_is_all_or_nothing(pool: BlockPool) -> None:
    assert _allocate(pool, 10) == list(range(10))
    out = [99]
    assert not pool.try_allocate_n(2, out)
    assert out == [99]
    assert pool.get_stats().num_allocations == 10
    assert pool.try_allocate_n(1, out)
    assert out == [99, 10]
    assert pool.try_allocate() is None
    assert not pool.try_allocate_n(1, out)
    assert pool.try_allocate_n(0, out)
    assert out == [99, 10]


def test_free_returns_blocks_last_in_first_out(pool: BlockPool) -> None:
    _allocate(pool, 4)
    pool.free_n([0, 2])
    assert pool.get_free_block_ids() == [2, 0, 4, 5, 6, 7, 8, 9, 10]
    assert _allocate(pool, 3) == [2, 0, 4]
    pool.free(3)
    assert pool.try_allocate() == 3


def test_double_free_is_a_bug(pool: BlockPool) -> None:
    (block_id,) = _allocate(pool, 1)
    pool.free(block_id)
    with pytest.raises(AssertionError, match="double free: block 0"):
        pool.free(block_id)
    with pytest.raises(AssertionError, match="double free: block 7"):
        pool.free_n([7])


def test_shared_blocks_are_freed_by_their_last_reference(pool: BlockPool) -> None:
    block_ids = _allocate(pool, 2)
    pool.share(block_ids)
    pool.share([1])
    assert [pool.get_ref_count(0), pool.get_ref_count(1)] == [2, 3]
    pool.free_n(block_ids)
    assert pool.get_stats().num_used_blocks == 2
    pool.free_n(block_ids)
    assert pool.get_ref_count(0) == 0
    assert pool.get_ref_count(1) == 1
    pool.free(1)
    stats = pool.get_stats()
    assert (stats.num_used_blocks, stats.num_frees, stats.num_free_blocks) == (0, 2, 11)
    with pytest.raises(AssertionError, match="only used blocks can be shared"):
        pool.share([5])


def test_copy_on_write_gives_a_private_block_to_the_writer(pool: BlockPool) -> None:
    (block_id,) = _allocate(pool, 1)
    assert pool.try_copy_on_write(block_id) == block_id  # unshared: write in place
    pool.share([block_id])
    assert pool.try_copy_on_write(block_id) == 1
    assert [pool.get_ref_count(0), pool.get_ref_count(1)] == [1, 1]


def test_copy_on_write_with_an_exhausted_pool_changes_nothing(pool: BlockPool) -> None:
    _allocate(pool, 11)
    pool.share([4])
    assert pool.try_copy_on_write(4) is None
    assert pool.get_ref_count(4) == 2


def test_cached_free_blocks_are_evicted_least_recently_used_first(pool: BlockPool) -> None:
    _allocate(pool, 11)
    for block_id in (3, 5, 7):
        assert pool.try_cache_block(block_id, _hash(f"h{block_id}"))
    pool.free_n([7, 3, 0, 5, 1])
    stats = pool.get_stats()
    assert (stats.num_free_blocks, stats.num_cached_free_blocks, stats.num_cached_blocks) == (5, 3, 3)
    # Uncached blocks go first; then cached ones in the order they were freed.
    assert pool.get_free_block_ids() == [1, 0, 7, 3, 5]
    assert _allocate(pool, 3) == [1, 0, 7]
    assert pool.get_cached_block(_hash("h7")) is None
    assert pool.get_block_hash(7) is None
    assert pool.get_cached_block(_hash("h3")) == 3
    stats = pool.get_stats()
    assert (stats.num_evictions, stats.num_cached_blocks, stats.num_free_blocks) == (1, 2, 2)


def test_prefix_hits_revive_cached_free_blocks_and_count_misses(pool: BlockPool) -> None:
    block_ids = _allocate(pool, 3)
    hashes = [_hash("a"), _hash("ab"), _hash("abc")]
    for block_id, block_hash in zip(block_ids, hashes, strict=True):
        assert pool.try_cache_block(block_id, block_hash)
    pool.free_n(block_ids[::-1])
    assert pool.get_stats().num_used_blocks == 0

    out: list[int] = []
    assert pool.take_cached_prefix([_hash("a"), _hash("ab"), _hash("abX"), _hash("abXd")], out) == 2
    assert out == [0, 1]
    assert pool.get_free_block_ids()[-1] == 2  # the only cached-free block left
    stats = pool.get_stats()
    assert (stats.num_cache_hits, stats.num_cache_misses, stats.num_used_blocks) == (2, 2, 2)
    assert stats.cache_hit_rate == 0.5

    # A hit on a block in use just adds a reference.
    assert pool.take_cached_prefix([_hash("a")], out) == 1
    assert pool.get_ref_count(0) == 2


def test_a_prefix_lookup_changes_nothing(pool: BlockPool) -> None:
    block_ids = _allocate(pool, 3)
    for block_id, name in zip(block_ids, ["a", "ab", "abc"], strict=True):
        assert pool.try_cache_block(block_id, _hash(name))
    pool.free_n([2, 1])  # blocks 1, 2 cached-free; block 0 still used
    before = pool.get_stats()
    free_before = pool.get_free_block_ids()
    assert pool.get_cached_prefix([_hash("a"), _hash("ab"), _hash("abX")]) == (2, 1)
    assert pool.get_cached_prefix([_hash("X"), _hash("ab")]) == (0, 0)
    assert pool.get_cached_prefix([]) == (0, 0)
    assert pool.get_stats() == before
    assert pool.get_free_block_ids() == free_before
    assert [pool.get_ref_count(block_id) for block_id in range(3)] == [1, 0, 0]


def test_duplicate_contents_keep_the_first_cache_entry(pool: BlockPool) -> None:
    first, second = _allocate(pool, 2)
    assert pool.try_cache_block(first, _hash("x"))
    assert not pool.try_cache_block(second, _hash("x"))
    pool.free_n([first, second])
    assert pool.get_free_block_ids() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0]
    with pytest.raises(AssertionError, match="only used blocks"):
        pool.try_cache_block(1, _hash("y"))


def test_a_cached_block_is_never_written_in_place(pool: BlockPool) -> None:
    (block_id,) = _allocate(pool, 1)
    pool.try_cache_block(block_id, _hash("x"))
    with pytest.raises(AssertionError, match="immutable"):
        pool.try_copy_on_write(block_id)


def test_reset_prefix_cache_frees_cached_free_blocks(pool: BlockPool) -> None:
    block_ids = _allocate(pool, 2)
    pool.try_cache_block(0, _hash("a"))
    pool.try_cache_block(1, _hash("b"))
    pool.free(0)
    pool.reset_prefix_cache()
    stats = pool.get_stats()
    assert (stats.num_cached_blocks, stats.num_cached_free_blocks, stats.num_free_blocks) == (0, 0, 10)
    assert pool.get_block_hash(1) is None
    pool.free(block_ids[1])
    assert pool.get_free_block_ids()[:2] == [1, 0]


def test_stats_are_real(pool: BlockPool) -> None:
    first = _allocate(pool, 6)
    pool.free_n(first[:4])
    second = _allocate(pool, 7)
    pool.free_n(second + first[4:])
    stats = pool.get_stats()
    assert stats.num_blocks == 11
    assert stats.num_used_blocks == 0
    assert stats.num_peak_used_blocks == 9
    assert stats.num_allocations == 13
    assert stats.num_frees == 13
    assert stats.peak_used_bytes == 9000
    assert stats.total_bytes == 11000
    assert stats.utilization == 0.0
    _allocate(pool, 4)
    assert pool.get_stats().utilization == pytest.approx(4 / 11)
    assert pool.get_stats().used_bytes == 4000
