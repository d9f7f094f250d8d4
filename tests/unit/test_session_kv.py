"""The batch scheduler with the session cache, as pure policies on a tiny pool: exact plans,
block tables, copies and holes, no model. (test_engine_sessions.py runs the same paths on
real models and checks the answers.)"""

from __future__ import annotations

from shoal.services.worker.engine.batch_scheduler import BatchScheduler, BatchSchedulerConfig, StepPlan
from shoal.services.worker.engine.sequence import Sequence
from shoal.services.worker.engine.session_kv import SessionKV
from shoal.shared.kv_cache.block_pool import BlockPool
from shoal.shared.kv_cache.cost_model import CostModel
from shoal.shared.kv_cache.manager import KVCacheManager
from shoal.shared.kv_cache.session_cache import SessionCache, SessionCacheConfig, Tier

BLOCK_SIZE = 4
COSTS = CostModel(seconds_per_token=1e-4, seconds_per_token_pair=1e-6, swap_seconds_per_block=1e-7)
_arrivals = iter(range(1_000_000))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _setup(
    num_blocks: int = 24, *, gpu: int = 24, cpu: int = 0, budget: int = 16, caching: bool = True
) -> tuple[BatchScheduler, SessionKV, Clock]:
    clock = Clock()
    kv = KVCacheManager(BlockPool(num_blocks, BLOCK_SIZE), enable_prefix_caching=caching)
    cache = SessionCache(
        SessionCacheConfig(block_size=BLOCK_SIZE, blocks_per_chunk=2, gpu_budget_blocks=gpu, cpu_budget_blocks=cpu),
        COSTS,
        clock,
    )
    sessions = SessionKV(cache, kv, block_bytes=100)
    return BatchScheduler(BatchSchedulerConfig(4, budget), kv, sessions), sessions, clock


def _seq(seq_id: str, prompt: list[int], session_id: str | None = "s", max_new: int = 2) -> Sequence:
    return Sequence(seq_id, list(prompt), len(prompt), len(prompt) + max_new, next(_arrivals), session_id=session_id)


def _shape(plan: StepPlan) -> list[tuple[str, int, int, bool, bool]]:
    return [(c.seq.seq_id, c.num_computed_tokens, c.num_new_tokens, c.samples, c.recomputes) for c in plan.chunks]


def _run(scheduler: BatchScheduler, token_id: int = 7) -> StepPlan:
    plan = scheduler.schedule()
    scheduler.update(plan, [token_id for chunk in plan.chunks if chunk.samples])
    return plan


def _finish(scheduler: BatchScheduler) -> list[StepPlan]:
    plans = []
    while scheduler.get_num_unfinished():
        plans.append(_run(scheduler))
        if scheduler.sessions is not None:
            scheduler.sessions.end_step()  # type: ignore[attr-defined]
    return plans


def test_a_finished_turn_leaves_its_full_computed_blocks_to_its_session() -> None:
    scheduler, sessions, _ = _setup()
    scheduler.add(_seq("t1", list(range(100, 110))))  # 10 tokens + 2 generated: 11 computed
    _finish(scheduler)
    info = sessions.cache.get_session("s")
    assert info is not None and info.num_blocks == 2  # 11 computed tokens: 2 full blocks
    assert scheduler.kv_cache.pool.get_stats().num_used_blocks == 2
    assert (sessions.get_stats().num_hits, sessions.get_stats().num_misses) == (0, 1)


def test_a_returning_turn_starts_after_its_cached_blocks() -> None:
    scheduler, sessions, _ = _setup()
    first = list(range(100, 110))
    scheduler.add(_seq("t1", first))
    _finish(scheduler)
    held = scheduler.kv_cache.pool.get_free_block_ids()
    second = [*first, 7, 7, 50, 51, 52]  # the answer was 7, 7
    scheduler.add(_seq("t2", second))
    plan = _run(scheduler)
    assert _shape(plan) == [("t2", 8, 7, True, False)]  # tokens 0-7 reused on the GPU
    assert scheduler.kv_cache.get_block_ids("t2")[:2] == [0, 1]
    assert (plan.swap_out_pairs, plan.swap_in_pairs) == ([], [])
    assert sessions.get_stats().num_gpu_reused_tokens == 8
    assert "s" not in sessions.cache  # the turn holds the blocks now
    assert held  # (the pool had free blocks all along)


def test_a_dropped_prefix_is_recomputed_in_the_same_pass_as_the_new_tokens() -> None:
    scheduler, sessions, _ = _setup(gpu=2, caching=False)  # sessions keep 2 blocks: 1 chunk
    first = list(range(100, 117))  # 17 tokens + 2: 18 computed, 4 full blocks = 2 chunks
    scheduler.add(_seq("t1", first))
    _finish(scheduler)
    assert sessions.cache.get_tiers("s") == [Tier.DROPPED, Tier.GPU]
    second = [*first, 7, 7, 60, 61]
    scheduler.add(_seq("t2", second))
    plan = _run(scheduler)
    # blocks 0-1 (tokens 0-7) dropped, 2-3 (8-15) on the GPU; new tokens 16-20
    assert _shape(plan) == [("t2", 0, 8, False, True), ("t2", 16, 5, True, False)]
    stats = sessions.get_stats()
    assert (stats.num_recomputed_tokens, stats.num_gpu_reused_tokens, stats.num_new_tokens) == (8, 8, 5)
    t2 = scheduler.get_sequence("t2")
    assert t2 is not None and (t2.hole_start, t2.hole_end, t2.num_computed_tokens) == (0, 0, 21)


def test_a_hole_over_the_budget_is_filled_before_new_tokens_run() -> None:
    scheduler, _, _ = _setup(gpu=2, budget=6, caching=False)
    first = list(range(100, 117))
    scheduler.add(_seq("t1", first))
    _finish(scheduler)
    scheduler.add(_seq("t2", [*first, 7, 7, 60, 61]))
    shapes = [_shape(_run(scheduler)) for _ in range(3)]
    assert shapes == [
        [("t2", 0, 6, False, True)],
        [("t2", 6, 2, False, True), ("t2", 16, 4, False, False)],
        [("t2", 20, 1, True, False)],
    ]


def test_cpu_chunks_come_back_with_one_batch_of_copies() -> None:
    scheduler, sessions, _ = _setup(gpu=0, cpu=8, caching=False)
    first = list(range(100, 117))
    scheduler.add(_seq("t1", first))
    _finish(scheduler)
    assert sessions.cache.get_tiers("s") == [Tier.CPU, Tier.CPU]
    scheduler.add(_seq("t2", [*first, 7, 7, 60]))
    plan = _run(scheduler)
    block_ids = scheduler.kv_cache.get_block_ids("t2")
    assert plan.swap_in_pairs == [(0, block_ids[0]), (1, block_ids[1]), (2, block_ids[2]), (3, block_ids[3])]
    assert _shape(plan) == [("t2", 16, 4, True, False)]
    assert sessions.get_stats().swap_in_bytes == 4 * 100


def test_demotions_are_copied_before_the_pass_that_may_reuse_the_blocks() -> None:
    scheduler, sessions, _ = _setup(num_blocks=8, gpu=8, cpu=8, budget=24, caching=False)
    scheduler.add(_seq("t1", list(range(100, 117)), session_id="a"))
    _finish(scheduler)  # a holds 4 of the 8 blocks
    scheduler.add(_seq("big", list(range(200, 220)), session_id=None))  # 20 tokens: 5+ blocks
    plan = scheduler.schedule()
    assert plan.swap_out_pairs == [(0, 0), (1, 1)]  # a's first chunk went to the host pool...
    assert scheduler.kv_cache.get_block_ids("big") == [1, 0, 4, 5, 6]  # ...and its blocks to big
    assert sessions.cache.get_tiers("a") == [Tier.CPU, Tier.GPU]
    assert scheduler.get_num_preemptions() == 0


def test_a_stale_session_is_forgotten_and_the_turn_starts_fresh() -> None:
    scheduler, sessions, _ = _setup()
    scheduler.add(_seq("t1", list(range(100, 110))))
    _finish(scheduler)
    scheduler.add(_seq("t2", list(range(300, 312))))  # nothing in common
    assert _shape(_run(scheduler)) == [("t2", 0, 12, True, False)]
    stats = sessions.get_stats()
    assert (stats.num_hits, stats.num_misses, stats.num_sessions) == (0, 2, 0)


def test_copied_out_blocks_still_cached_are_taken_before_the_hole_evicts_them() -> None:
    """A returning turn whose hole needs fresh blocks while the free stack is short: that
    allocation evicts cached-free blocks, least recently used first, which may be the GPU
    copies of the session's CPU chunks the plan means to take back. They are taken first.
    (Found by scripts/bench_sessions_live.py: the step failed, and with it every request.)"""
    scheduler, sessions, _ = _setup(num_blocks=10, gpu=0, cpu=2, budget=64)
    pool = scheduler.kv_cache.pool
    first = list(range(100, 117))  # 4 full blocks: chunk 0 (blocks 0, 1) dropped, chunk 1 (2, 3) to the CPU
    scheduler.add(_seq("t1", first))
    _finish(scheduler)
    assert sessions.cache.get_tiers("s") == [Tier.DROPPED, Tier.CPU]
    scheduler.add(_seq("o1", list(range(300, 331)), session_id=None, max_new=1))  # evicts 0 and 1, frees 8
    _finish(scheduler)
    assert pool.get_free_block_ids() == [1, 2, 3, 0, 9, 8, 7, 6, 5, 4]  # the stack, then the LRU: 2 and 3 first
    scheduler.add(_seq("t2", [*first, 7, 7, 60, 61]))
    plan = _run(scheduler)
    assert _shape(plan) == [("t2", 0, 8, False, True), ("t2", 16, 5, True, False)]
    assert scheduler.kv_cache.get_block_ids("t2") == [1, 0, 2, 3, 9, 8]  # hole: 1, 0; chunk 1 taken back: 2, 3
    assert plan.swap_in_pairs == [], "the GPU copies were still there: nothing is copied back"
    stats = sessions.get_stats()
    assert (stats.num_recomputed_tokens, stats.num_prefix_cached_tokens, stats.num_cpu_restored_tokens) == (8, 8, 0)


def test_reclaiming_gives_up_enough_chunks_to_free_blocks_that_sessions_share() -> None:
    """Two sessions with the same first 8 tokens share those blocks (by hash): giving up one
    session's reference frees no block, so a reclaim of pool blocks goes on to the next."""
    scheduler, sessions, _ = _setup(num_blocks=8, gpu=8)
    pool = scheduler.kv_cache.pool
    shared = list(range(100, 108))  # 2 blocks, one chunk
    scheduler.add(_seq("a", [*shared, 1, 2, 3, 4, 5], session_id="a"))  # 13 + 2 computed: 3 full blocks
    _finish(scheduler)
    scheduler.add(_seq("b", [*shared, 6, 7, 8, 9, 10], session_id="b"))  # its first 2 blocks: a's
    _finish(scheduler)
    assert sessions.get_num_gpu_blocks() == 6 and pool.get_stats().num_used_blocks == 4
    assert pool.get_num_free_blocks() == 4
    num_freed = sessions.reclaim(3)
    assert num_freed >= 3 and pool.get_num_free_blocks() == 4 + num_freed, "the pool gained what was asked"
    assert sessions.reclaim(100) == 8 - 4 - num_freed, "then everything, and no more than there is"
    assert sessions.get_num_gpu_blocks() == 0
