"""The engine's batch scheduler as a pure policy: exact plans on tiny pools, no model."""

from __future__ import annotations

import pytest

from shoal.services.worker.engine.batch_scheduler import BatchScheduler, BatchSchedulerConfig, StepPlan
from shoal.services.worker.engine.sequence import Sequence, SequenceStatus
from shoal.shared.kv_cache.block_pool import BlockPool
from shoal.shared.kv_cache.manager import KVCacheManager

BLOCK_SIZE = 4


def _scheduler(
    num_blocks: int = 11, *, max_num_seqs: int = 4, budget: int = 8, caching: bool = True
) -> BatchScheduler:
    kv = KVCacheManager(BlockPool(num_blocks, BLOCK_SIZE), enable_prefix_caching=caching)
    return BatchScheduler(BatchSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), kv)


_arrivals = iter(range(1_000_000))


def _seq(seq_id: str, prompt: list[int], max_new: int = 100, eos: frozenset[int] = frozenset()) -> Sequence:
    return Sequence(seq_id, list(prompt), len(prompt), len(prompt) + max_new, next(_arrivals), eos)


def _shape(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.seq.seq_id, c.num_computed_tokens, c.num_new_tokens, c.samples) for c in plan.chunks]


def _run(scheduler: BatchScheduler, token_id: int = 7) -> StepPlan:
    """One step that samples `token_id` for every sampling chunk."""
    plan = scheduler.schedule()
    scheduler.update(plan, [token_id for chunk in plan.chunks if chunk.samples])
    return plan


def test_decode_joins_prefill_in_one_step_under_the_token_budget() -> None:
    scheduler = _scheduler()
    scheduler.add(_seq("a", [1, 2, 3]))
    assert _shape(_run(scheduler)) == [("a", 0, 3, True)]
    scheduler.add(_seq("b", list(range(10, 22))))  # 12 tokens, budget 8: chunked
    plan = _run(scheduler)
    assert _shape(plan) == [("a", 3, 1, True), ("b", 0, 7, False)]
    assert plan.num_batched_tokens == 8
    assert _shape(_run(scheduler)) == [("a", 4, 1, True), ("b", 7, 5, True)]
    assert _shape(_run(scheduler)) == [("a", 5, 1, True), ("b", 12, 1, True)]
    a = scheduler.get_sequence("a")
    assert a is not None and a.token_ids == [1, 2, 3, 7, 7, 7, 7] and a.num_computed_tokens == 6


def test_blocks_are_allocated_as_sequences_grow() -> None:
    scheduler = _scheduler()
    scheduler.add(_seq("a", [1, 2, 3]))
    _run(scheduler)
    kv = scheduler.kv_cache
    assert kv.get_block_ids("a") == [0]
    _run(scheduler)  # computes token 4 of 4: still one block
    assert kv.get_block_ids("a") == [0]
    _run(scheduler)  # position 4 starts block 2
    assert kv.get_block_ids("a") == [0, 1]


def test_max_num_seqs_bounds_admission() -> None:
    scheduler = _scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add(_seq(name, [1, 2]))
    assert [c.seq.seq_id for c in _run(scheduler).chunks] == ["a", "b"]
    assert scheduler.get_num_waiting() == 1
    assert scheduler.get_num_running() == 2


def test_finish_by_eos_and_by_length_frees_blocks() -> None:
    scheduler = _scheduler()
    scheduler.add(_seq("eos", [1, 2], eos=frozenset({9})))
    scheduler.add(_seq("len", [1, 2, 3], max_new=2))
    plan = scheduler.schedule()
    updates = scheduler.update(plan, [9, 5])
    assert [(u.seq.seq_id, u.token_id, u.finish_reason) for u in updates] == [
        ("eos", 9, "stop"),
        ("len", 5, None),
    ]
    updates = scheduler.update(scheduler.schedule(), [6])
    assert [(u.seq.seq_id, u.finish_reason) for u in updates] == [("len", "length")]
    assert scheduler.get_num_unfinished() == 0
    assert scheduler.kv_cache.pool.get_stats().num_used_blocks == 0


def test_pool_exhaustion_preempts_the_newest_and_resumes_it() -> None:
    scheduler = _scheduler(num_blocks=3, budget=16)
    scheduler.add(_seq("old", [1, 2, 3, 4]))
    scheduler.add(_seq("new", [5, 6, 7, 8]))
    assert _shape(_run(scheduler)) == [("old", 0, 4, True), ("new", 0, 4, True)]
    # Both need a second block; one is free: "old" takes it, then "new", the newest left
    # to schedule, preempts itself.
    plan = _run(scheduler)
    assert _shape(plan) == [("old", 4, 1, True)]
    assert plan.preempted_seq_ids == ["new"]
    new = scheduler.get_sequence("new")
    assert new is not None and new.status is SequenceStatus.WAITING and new.num_preemptions == 1
    assert new.token_ids == [5, 6, 7, 8, 7]
    # It waits while "old" holds the blocks; once "old" ends it is recomputed: its freed
    # full block is still cached, so only the tail is computed again.
    scheduler.finish("old", "cancelled")
    plan = _run(scheduler)
    assert _shape(plan) == [("new", 4, 1, True)]
    assert new.token_ids == [5, 6, 7, 8, 7, 7]
    assert scheduler.kv_cache.pool.get_stats().num_cache_hits == 1
    assert new.num_cached_tokens == 0, "its usage counts what it found when it first started"


def test_preemption_without_prefix_caching_recomputes_everything() -> None:
    scheduler = _scheduler(num_blocks=3, budget=16, caching=False)
    scheduler.add(_seq("old", [1, 2, 3, 4]))
    scheduler.add(_seq("new", [5, 6, 7, 8]))
    _run(scheduler)
    assert _run(scheduler).preempted_seq_ids == ["new"]
    scheduler.finish("old", "cancelled")
    assert _shape(_run(scheduler)) == [("new", 0, 5, True)]


def test_the_oldest_takes_the_blocks_of_the_newest() -> None:
    scheduler = _scheduler(num_blocks=2, budget=16)
    scheduler.add(_seq("a", [1, 2, 3, 4]))
    scheduler.add(_seq("b", [5, 6, 7, 8]))
    _run(scheduler)
    # "a" needs a block and none is free: "b", not yet scheduled, is preempted for it.
    plan = _run(scheduler)
    assert plan.preempted_seq_ids == ["b"]
    assert _shape(plan) == [("a", 4, 1, True)]


def test_no_admission_in_a_step_that_preempted() -> None:
    scheduler = _scheduler(num_blocks=3, budget=16)
    scheduler.add(_seq("a", [1, 2, 3, 4]))
    scheduler.add(_seq("b", [5, 6, 7, 8]))
    _run(scheduler)
    scheduler.add(_seq("c", [9]))
    plan = _run(scheduler)
    assert plan.preempted_seq_ids == ["b"]
    assert [c.seq.seq_id for c in plan.chunks] == ["a"]
    assert [s.seq_id for s in scheduler._waiting] == ["b", "c"]


def test_admission_waits_when_the_pool_cannot_take_the_first_chunk() -> None:
    scheduler = _scheduler(num_blocks=2, budget=16)
    scheduler.add(_seq("a", [1, 2, 3, 4, 5]))
    scheduler.add(_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    plan = _run(scheduler)
    assert [c.seq.seq_id for c in plan.chunks] == ["a"]
    assert scheduler.get_num_waiting() == 1
    assert not scheduler.kv_cache.has_sequence("b")


def test_a_shared_prefix_is_not_recomputed() -> None:
    scheduler = _scheduler(budget=16)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    scheduler.add(_seq("a", prompt))
    _run(scheduler)
    scheduler.add(_seq("b", [*prompt[:8], 42]))
    plan = _run(scheduler)
    assert _shape(plan) == [("a", 9, 1, True), ("b", 8, 1, True)]
    b = scheduler.get_sequence("b")
    assert b is not None and b.num_cached_tokens == 8
    kv = scheduler.kv_cache
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]


def test_cancel_frees_blocks_at_once_and_skips_its_pending_output() -> None:
    scheduler = _scheduler()
    scheduler.add(_seq("a", [1, 2, 3]))
    scheduler.add(_seq("b", [4, 5, 6]))
    plan = scheduler.schedule()
    cancelled = scheduler.finish("a", "cancelled")
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    assert not scheduler.kv_cache.has_sequence("a")
    updates = scheduler.update(plan, [7, 8])
    assert [(u.seq.seq_id, u.token_id) for u in updates] == [("b", 8)]
    assert scheduler.finish("a", "cancelled") is None
    waiting = _seq("w", [1])
    scheduler.add(waiting)
    assert scheduler.finish("w", "cancelled") is waiting


def test_config_rejects_a_budget_below_max_num_seqs() -> None:
    with pytest.raises(AssertionError, match="at least max_num_seqs"):
        BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)


def test_many_sequences_on_a_small_pool_all_finish() -> None:
    scheduler = _scheduler(num_blocks=6, max_num_seqs=8, budget=16)
    for index in range(12):
        scheduler.add(_seq(f"s{index}", [index + 1] * (1 + index % 6), max_new=6))
    finished: dict[str, list[int]] = {}
    for _ in range(500):
        if not scheduler.get_num_unfinished():
            break
        plan = scheduler.schedule()
        for update in scheduler.update(plan, [3 for chunk in plan.chunks if chunk.samples]):
            if update.finish_reason is not None:
                finished[update.seq.seq_id] = update.seq.token_ids
    assert len(finished) == 12
    for index in range(12):
        assert finished[f"s{index}"] == [index + 1] * (1 + index % 6) + [3] * 6
    stats = scheduler.kv_cache.pool.get_stats()
    assert stats.num_used_blocks == 0
    assert stats.num_peak_used_blocks == 6


def test_a_sequence_left_waiting_counts_its_cache_hits_once() -> None:
    """A prompt whose cached prefix is found but whose chunk does not fit is looked up, not
    taken: hits, misses and frees count only the admission that happens, and the prompt is
    hashed once however many steps it waits."""
    scheduler = _scheduler(num_blocks=6, budget=16)
    kv = scheduler.kv_cache
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    scheduler.add(_seq("x", prompt))
    _run(scheduler)
    scheduler.finish("x", "cancelled")  # blocks 0, 1 cached-free; block 2 free
    stats = kv.pool.get_stats()
    assert (stats.num_cache_hits, stats.num_cache_misses, stats.num_frees) == (0, 2, 3)
    scheduler.add(_seq("big", list(range(20, 32))))  # 3 blocks (2 misses), a 4th at its 13th token
    _run(scheduler)
    _run(scheduler)
    assert kv.get_num_free_blocks() == 2 and kv.pool.get_stats().num_cached_free_blocks == 2
    # Two of its three full blocks are cached, but reviving them leaves no block for the rest.
    waiting = _seq("y", [*prompt[:8], 50, 51, 52, 53, 54])
    scheduler.add(waiting)
    for _ in range(3):  # big's 4th block takes its 14th to 16th tokens: no eviction
        assert [c.seq.seq_id for c in _run(scheduler).chunks] == ["big"]
        assert not kv.has_sequence("y")
    stats = kv.pool.get_stats()
    assert (stats.num_cache_hits, stats.num_cache_misses, stats.num_frees) == (0, 4, 3), (
        "waiting counts nothing"
    )
    hashes = waiting.block_hashes
    assert len(hashes) == 3
    scheduler.finish("big", "cancelled")
    assert _shape(_run(scheduler)) == [("y", 8, 5, True)]
    assert waiting.block_hashes is hashes and len(hashes) == 3, "hashed once, extended in place"
    stats = kv.pool.get_stats()
    assert (stats.num_cache_hits, stats.num_cache_misses) == (2, 5)
    assert stats.num_frees == 3 + 4  # x's blocks, then big's: nothing for y's waiting steps
    assert kv.get_block_ids("y")[:2] == [0, 1]
