"""The session cache policy, case by case, with an injected clock and cost model: exact tiers,
exact block ids, exact eviction order."""

from __future__ import annotations

import pytest

from shoal.shared.kv_cache.cost_model import CostModel
from shoal.shared.kv_cache.session_cache import (
    RestorePlan,
    SessionCache,
    SessionCacheConfig,
    Tier,
)

G, C, D = Tier.GPU, Tier.CPU, Tier.DROPPED
BLOCK_SIZE = 16

# Rebuilding a chunk of 2 blocks (32 tokens) at context ctx costs 32e-4 + 1e-6 * (32 ctx + 528):
# linear in the context, so a session's leading chunks are its cheapest. Copying it back
# costs 2e-5, far less than any rebuild.
COSTS = CostModel(seconds_per_token=1e-4, seconds_per_token_pair=1e-6, swap_seconds_per_block=1e-5)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _cache(
    clock: Clock, *, gpu: int = 100, cpu: int = 0, chunk: int = 2, costs: CostModel = COSTS, **config: float
) -> SessionCache:
    return SessionCache(
        SessionCacheConfig(
            block_size=BLOCK_SIZE, blocks_per_chunk=chunk, gpu_budget_blocks=gpu, cpu_budget_blocks=cpu, **config  # type: ignore[arg-type]
        ),
        costs,
        clock,
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        SessionCacheConfig(block_size=16, blocks_per_chunk=0)
    with pytest.raises(ValueError, match="budgets"):
        SessionCacheConfig(block_size=16, gpu_budget_blocks=-1)
    with pytest.raises(ValueError, match="idle_timeout_s"):
        SessionCacheConfig(block_size=16, idle_timeout_s=0)


def test_check_in_chunks_blocks_and_keeps_them_on_the_gpu(clock: Clock) -> None:
    cache = _cache(clock)
    actions = cache.check_in("a", [7, 3, 9, 4, 8])
    assert (actions.swap_out, actions.freed_gpu_block_ids) == ([], [])
    assert cache.get_tiers("a") == [G, G, G]  # chunks of 2, 2 and 1 blocks
    info = cache.get_session("a")
    assert info is not None
    assert (info.num_blocks, info.num_gpu_blocks, info.num_cpu_blocks, info.num_dropped_blocks) == (5, 5, 0, 0)
    assert cache.get_stats().num_gpu_blocks == 5


def test_over_the_gpu_budget_leading_chunks_go_to_the_cpu_with_exact_copies(clock: Clock) -> None:
    cache = _cache(clock, gpu=2, cpu=8)
    actions = cache.check_in("a", [10, 11, 12, 13, 14, 15])
    assert cache.get_tiers("a") == [C, C, G]
    assert actions.swap_out == [(10, 0), (11, 1), (12, 2), (13, 3)]
    assert actions.freed_gpu_block_ids == [10, 11, 12, 13]
    stats = cache.get_stats()
    assert (stats.num_gpu_blocks, stats.num_cpu_blocks, stats.num_swapped_out_blocks) == (2, 4, 4)


def test_without_a_cpu_tier_leading_chunks_are_dropped(clock: Clock) -> None:
    cache = _cache(clock, gpu=3, cpu=0)
    actions = cache.check_in("a", [10, 11, 12, 13, 14, 15])
    assert cache.get_tiers("a") == [D, D, G]
    assert (actions.swap_out, actions.freed_gpu_block_ids) == ([], [10, 11, 12, 13])
    assert cache.plan_restore("a", 6) == RestorePlan(6, 4, 0, 2)


def test_when_the_cpu_fills_the_cheapest_leading_chunks_are_dropped(clock: Clock) -> None:
    cache = _cache(clock, gpu=2, cpu=4)
    cache.check_in("a", list(range(10, 18)))  # 4 chunks; GPU takes 1, CPU 2, one is dropped
    assert cache.get_tiers("a") == [D, C, C, G]
    assert cache.plan_restore("a", 8) == RestorePlan(8, 2, 4, 2)


def test_the_least_valuable_session_is_evicted_first(clock: Clock) -> None:
    # Same chunks, same costs: the longer idle session goes first (LRU as a special case).
    cache = _cache(clock, gpu=8, cpu=0)
    cache.check_in("old", [0, 1, 2, 3])
    clock.now += 30
    cache.check_in("new", [4, 5, 6, 7])
    clock.now += 1
    freed, actions = cache.reclaim_gpu(2)
    assert (freed, actions.freed_gpu_block_ids) == (2, [0, 1])
    assert cache.get_tiers("old") == [D, G]
    # old: rebuild(chunk 1) / 32 s idle = (32e-4 + 1e-6 * (32*32 + 528)) / 32 = 1.485e-4
    # new: rebuild(chunk 0) / 2 s = (32e-4 + 528e-6) / 2 = 1.864e-3: old's chunk 1 goes next.
    freed, actions = cache.reclaim_gpu(1)
    assert actions.freed_gpu_block_ids == [2, 3]
    assert "old" not in cache and actions.removed_session_ids == ["old"]


def test_an_expensive_session_outlives_a_cheap_idle_one_only_while_value_says_so(clock: Clock) -> None:
    # a: a 2-block session (cheap); b: its leading chunk is the same, so compare two sessions
    # whose next victims cost the same but whose idle times differ by 10x, then a long
    # session whose next victim is dear.
    cache = _cache(clock, gpu=100, cpu=0, chunk=1)
    cache.check_in("long", list(range(0, 40)))
    cache.reclaim_gpu(30)  # long keeps its 10 last (most expensive) chunks
    assert cache.get_tiers("long") == [D] * 30 + [G] * 10
    clock.now += 100
    cache.check_in("short", [50, 51])
    clock.now += 5
    # long's next victim: 16 tokens at context 480: 16e-4 + 1e-6 * (16*480 + 136) = 9.416e-3
    # over 106 s idle = 8.9e-5; short's: 16e-4 + 136e-6 = 1.736e-3 over 6 s = 2.9e-4.
    _, actions = cache.reclaim_gpu(1)
    assert actions.freed_gpu_block_ids == [30]
    # 200 s later short has been idle long enough: 1.736e-3 / 206 = 8.4e-6 < 9.5e-3 / 306.
    clock.now += 200
    _, actions = cache.reclaim_gpu(1)
    assert actions.freed_gpu_block_ids == [50]


def test_ties_go_to_the_older_activity_then_the_older_session(clock: Clock) -> None:
    free = CostModel(seconds_per_token=0.0, seconds_per_token_pair=0.0)  # every value is 0
    cache = _cache(clock, gpu=100, cpu=0, costs=free)
    cache.check_in("first", [0, 1])
    cache.check_in("second", [2, 3])  # same clock reading: order decides
    clock.now += 1
    cache.check_in("third", [4, 5])
    victims = [cache.reclaim_gpu(1)[1].removed_session_ids for _ in range(3)]
    assert victims == [["first"], ["second"], ["third"]]


def test_a_session_active_now_has_a_finite_value(clock: Clock) -> None:
    cache = _cache(clock, gpu=2, cpu=0, min_idle_s=0.5)
    cache.check_in("now", [0, 1, 2, 3])  # no division by zero: idle 0 + 0.5 s
    assert cache.get_tiers("now") == [D, G]


def test_drop_directly_when_cheaper_than_making_room_on_the_cpu(clock: Clock) -> None:
    # CPU holds "kept"'s expensive chunk; "cheap" is idle and its chunk cheap to rebuild:
    # dropping it beats demoting it (which would drop kept's CPU chunk).
    cache = _cache(clock, gpu=100, cpu=2)
    cache.check_in("kept", list(range(0, 12)))
    cache.reclaim_gpu(12)  # kept: 5 chunks dropped... then its last one demoted into the CPU
    assert cache.get_tiers("kept") == [D, D, D, D, D, C]
    clock.now += 1
    cache.check_in("cheap", [20, 21])
    clock.now += 50
    _, actions = cache.reclaim_gpu(2)
    assert actions.removed_session_ids == ["cheap"] and actions.swap_out == []
    assert cache.get_tiers("kept") == [D, D, D, D, D, C]


def test_demote_and_drop_a_cpu_chunk_when_that_is_cheaper(clock: Clock) -> None:
    # Now the CPU chunk is cheap (leading, long idle) and the GPU chunk dear (recent).
    cache = _cache(clock, gpu=100, cpu=2)
    cache.check_in("idle", [0, 1])
    cache.reclaim_gpu(2)  # its only chunk -> CPU, filling the host pool
    assert cache.get_tiers("idle") == [C]
    clock.now += 500
    cache.check_in("dear", list(range(10, 20)))
    clock.now += 1
    freed, actions = cache.reclaim_gpu(2)
    # dear's chunk 0 is the only demotion victim and the host is full. Demoting it and
    # dropping idle's chunk: 2e-5 / 2 s + (3.728e-3 - 2e-5) / 502 s = 1.7e-5; dropping it
    # directly: 3.728e-3 / 2 s. So idle's CPU chunk goes, dear's chunk takes its host blocks.
    assert freed == 2
    assert actions.removed_session_ids == ["idle"]
    assert actions.swap_out == [(10, 0), (11, 1)]
    assert cache.get_tiers("dear") == [C, G, G, G, G]


def test_copy_ahead_makes_the_next_eviction_a_discard(clock: Clock) -> None:
    cache = _cache(clock, gpu=100, cpu=8, copy_ahead_free_blocks=4)
    cache.check_in("a", [0, 1, 2, 3, 4, 5])
    clock.now += 10
    cache.check_in("b", [6, 7, 8, 9])
    assert cache.copy_ahead(num_free_gpu_blocks=10) == []  # above the threshold
    pairs = cache.copy_ahead(num_free_gpu_blocks=1)  # 3 short: copy a's first two chunks
    assert pairs == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert cache.get_num_copied_ahead_chunks("a") == 2
    assert cache.copy_ahead(num_free_gpu_blocks=1) == []  # the copies already count
    _, actions = cache.reclaim_gpu(4)
    assert actions.swap_out == [] and actions.freed_gpu_block_ids == [0, 1, 2, 3]
    assert cache.get_tiers("a") == [C, C, G]
    stats = cache.get_stats()
    assert (stats.num_cpu_blocks, stats.num_copied_ahead_blocks, stats.num_swapped_out_blocks) == (4, 0, 4)


def test_copies_ahead_are_discarded_first_when_the_cpu_needs_room(clock: Clock) -> None:
    cache = _cache(clock, gpu=100, cpu=2, copy_ahead_free_blocks=2)
    cache.check_in("a", [0, 1])
    clock.now += 100
    cache.check_in("b", [2, 3])
    assert cache.copy_ahead(num_free_gpu_blocks=0) == [(0, 0), (1, 1)]
    # The eviction order changed: b goes idle far longer than a was.
    clock.now += 1000
    cache.check_in("c", [4, 5])
    clock.now += 1
    cache.check_in("a", [0, 1, 6, 7])  # a returns: its copy goes back to the free host pool
    assert cache.get_stats().num_copied_ahead_blocks == 0
    _, actions = cache.reclaim_gpu(2)
    assert actions.swap_out == [(2, 1), (3, 0)] or actions.swap_out == [(2, 0), (3, 1)]


def test_check_out_returns_each_block_from_its_tier(clock: Clock) -> None:
    cache = _cache(clock, gpu=4, cpu=4)
    cache.check_in("a", list(range(20, 30)))  # 5 chunks: D, C, C, G, G
    assert cache.get_tiers("a") == [D, C, C, G, G]
    # The new prompt matches the first 9 blocks only: block 9 is discarded.
    restore = cache.check_out("a", 9)
    assert restore is not None
    assert restore.plan == RestorePlan(9, 2, 4, 3)
    # Blocks 20, 21 went to host blocks 0, 1, then 22..25 to 2, 3 and, once chunk 0 was
    # dropped to make room, to 0, 1 again.
    assert restore.host_block_ids == [2, 3, 0, 1]
    assert restore.gpu_block_ids == [26, 27, 28]
    assert restore.freed_gpu_block_ids == [29]
    assert "a" not in cache
    # Host blocks being copied back this step are not handed out before the step ends.
    assert cache.get_num_free_host_blocks() == 0
    cache.end_step()
    assert cache.get_num_free_host_blocks() == 4
    assert cache.get_stats().num_gpu_blocks == 0
    assert cache.get_stats().num_cpu_blocks == 0


def test_a_cpu_chunk_cheaper_to_rebuild_than_to_copy_is_recomputed(clock: Clock) -> None:
    slow_copies = CostModel(seconds_per_token=1e-4, seconds_per_token_pair=1e-6, swap_seconds_per_block=2e-3)
    # chunk 0 rebuild: 32e-4 + 528e-6 = 3.7e-3 <= 2 blocks x 2e-3; chunk 1: 4.8e-3 > 4e-3.
    cache = _cache(clock, gpu=2, cpu=8, costs=slow_copies)
    cache.check_in("a", list(range(6)))
    assert cache.get_tiers("a") == [C, C, G]
    assert cache.plan_restore("a", 6) == RestorePlan(6, 2, 2, 2)
    restore = cache.check_out("a", 6)
    assert restore is not None and restore.host_block_ids == [2, 3]
    assert cache.get_num_free_host_blocks() == 6  # chunk 0's copy freed now, chunk 1's after the step


def test_sessions_expire_after_the_idle_timeout(clock: Clock) -> None:
    cache = _cache(clock, gpu=100, cpu=4, idle_timeout_s=60)
    cache.check_in("a", [0, 1, 2])
    clock.now += 30
    cache.check_in("b", [3, 4])
    clock.now += 30
    actions = cache.expire()
    assert actions.removed_session_ids == ["a"] and actions.freed_gpu_block_ids == [0, 1, 2]
    assert cache.expire().removed_session_ids == []
    clock.now += 30
    assert cache.expire().removed_session_ids == ["b"]
    assert cache.get_stats().num_expired_sessions == 2


def test_drop_session_and_check_in_replace(clock: Clock) -> None:
    cache = _cache(clock, gpu=100)
    cache.check_in("a", [0, 1, 2])
    actions = cache.check_in("a", [5, 6])  # a concurrent turn finished later: it replaces
    assert actions.freed_gpu_block_ids == [0, 1, 2] and actions.removed_session_ids == []
    assert [info.session_id for info in cache.get_sessions()] == ["a"]
    dropped = cache.drop_session("a")
    assert dropped is not None and dropped.freed_gpu_block_ids == [5, 6]
    assert cache.drop_session("a") is None
    assert cache.check_out("a", 2) is None


def test_the_seed_example_under_whole_chunk_eviction(clock: Clock) -> None:
    """The seed's 2-layer, 2-chunk session (32-token chunks, 1 chunk of room).

    Its own formula, cost = layer_weight x position_weight x (0.001 ctx + 0.01 + 0.005),
    gives L1C0 0.00375 < L0C0 0.0075 < L1C1 0.0235 < L0C1 0.047: it would evict layer 1 of
    chunk 0, then layer 0 of chunk 0, then chunk 1 (not the order the seed states,
    L1C0 -> L1C1 -> L0C1 -> L0C0). Shoal never splits a chunk by layer: dropping layer 1
    alone saves nothing (rebuilding it runs layer 0 over the same tokens), so the unit is the
    chunk, and the leading chunk goes first: chunk 0 (both layers), then chunk 1.
    """
    seed = {}
    for layer in (0, 1):
        for chunk, ctx in ((0, 0), (1, 32)):
            seed[f"L{layer}C{chunk}"] = (2 - layer) / 2 * (chunk + 1) / 2 * (0.001 * ctx + 0.01 + 0.005)
    assert sorted(seed, key=seed.__getitem__) == ["L1C0", "L0C0", "L1C1", "L0C1"]
    assert [round(seed[k], 5) for k in ("L1C0", "L0C0", "L1C1", "L0C1")] == [0.00375, 0.0075, 0.0235, 0.047]

    # Shoal: block_size 32 and one block per chunk = the seed's 32-token chunks.
    cache = SessionCache(
        SessionCacheConfig(block_size=32, blocks_per_chunk=1, gpu_budget_blocks=1, cpu_budget_blocks=0),
        COSTS,
        clock,
    )
    actions = cache.check_in("s1", [100, 101])
    assert cache.get_tiers("s1") == [D, G] and actions.freed_gpu_block_ids == [100]
    _, actions = cache.reclaim_gpu(1)
    assert actions.freed_gpu_block_ids == [101] and "s1" not in cache
