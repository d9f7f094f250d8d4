"""Properties of the session cache over random sessions and turns (hypothesis).

A harness plays the engine: it hands the cache fresh GPU block ids labelled with what they
hold, applies the copies the cache asks for at the end of each step (as the engine's step
does: every swap-out, then the reads of the swap-ins), and checks that every block a
returning session gets back holds that session's data at that position.
"""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.shared.kv_cache.cost_model import CostModel
from shoal.shared.kv_cache.retention_index import RetentionIndex
from shoal.shared.kv_cache.session_cache import SessionActions, SessionCache, SessionCacheConfig, Tier

# ---------------------------------------------------------------------- the index


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(
        st.tuples(st.floats(0.0, 1e3), st.floats(0.0, 1e4)), min_size=1, max_size=40
    ),
    now_offset=st.floats(0.0, 1e4),
    removed=st.sets(st.integers(0, 39)),
)
def test_get_min_is_within_the_bucket_ratio_of_the_exact_minimum(
    entries: list[tuple[float, float]], now_offset: float, removed: set[int]
) -> None:
    index = RetentionIndex(min_idle_s=1.0)
    for key, (cost, last_active) in enumerate(entries):
        index.set(str(key), cost, last_active, key)
        index.set(str(key), cost, last_active, key)  # a repeated set changes nothing
    live = {key: entry for key, entry in enumerate(entries) if key not in removed}
    for key in removed:
        index.discard(str(key))
    now = max(last_active for _, last_active in entries) + now_offset
    chosen = index.get_min(now)
    if not live:
        assert chosen is None and len(index) == 0
        return

    def value(key: int) -> float:
        cost, last_active = live[key]
        return 0.0 if cost <= 0 else cost / (now - last_active + 1.0)

    assert chosen is not None and int(chosen) in live
    exact = min(value(key) for key in live)
    assert value(int(chosen)) <= exact * index.bucket_ratio * (1 + 1e-12)
    assert math.isclose(index.get_value(chosen, now), value(int(chosen)))


def test_equal_costs_are_ordered_exactly_by_idle_time_then_order() -> None:
    index = RetentionIndex(min_idle_s=1.0)
    index.set("b", 5.0, 10.0, 1)
    index.set("a", 5.0, 10.0, 0)
    index.set("c", 5.0, 9.0, 2)
    assert index.get_min(20.0) == "c"
    index.discard("c")
    assert index.get_min(20.0) == "a"
    index.set("a", 5.0, 11.0, 0)  # a was active again
    assert index.get_min(20.0) == "b"


def test_compaction_keeps_the_live_entries() -> None:
    index = RetentionIndex(min_idle_s=1.0)
    for round_ in range(50):
        for key in range(10):
            index.set(str(key), 1.0 + key + round_, 0.0, key)
    assert len(index) == 10
    assert index.get_min(100.0) == "0"


# ---------------------------------------------------------------------- the cache

BLOCK_SIZE = 4
COSTS = CostModel(seconds_per_token=1e-4, seconds_per_token_pair=1e-6, swap_seconds_per_block=3e-5)

operations = st.lists(
    st.one_of(
        st.tuples(st.just("turn"), st.integers(0, 7), st.integers(0, 24), st.integers(0, 30)),
        st.tuples(st.just("reclaim"), st.integers(0, 7), st.integers(1, 12), st.integers(0, 1)),
        st.tuples(st.just("copy_ahead"), st.integers(0, 7), st.integers(0, 12), st.integers(0, 1)),
        st.tuples(st.just("wait"), st.integers(0, 7), st.integers(0, 400), st.integers(0, 1)),
        st.tuples(st.just("drop"), st.integers(0, 7), st.integers(0, 1), st.integers(0, 1)),
        st.tuples(st.just("end_step"), st.integers(0, 7), st.integers(0, 1), st.integers(0, 1)),
    ),
    max_size=60,
)


class Harness:
    """Plays the engine around a `SessionCache` and checks what comes back."""

    def __init__(self, cache: SessionCache) -> None:
        self.cache = cache
        self.labels = itertools.count()
        self.gpu: dict[int, tuple[str, int, int]] = {}  # GPU block -> (session, turn, position)
        self.host: dict[int, tuple[str, int, int]] = {}
        self.turns: dict[str, int] = {}
        self.held: set[int] = set()  # GPU blocks the cache holds references to
        self.step_swaps: list[tuple[int, int]] = []
        self.step_reads: list[tuple[int, tuple[str, int, int]]] = []

    def apply(self, actions: SessionActions) -> None:
        self.step_swaps += actions.swap_out
        for block_id in actions.freed_gpu_block_ids:
            self.held.remove(block_id)
        destinations = [host_id for _, host_id in actions.swap_out]
        assert len(destinations) == len(set(destinations)), "one call never copies into a host block twice"

    def end_step(self) -> None:
        for gpu_id, host_id in self.step_swaps:  # the step's copies, in order, before its reads
            self.host[host_id] = self.gpu[gpu_id]
        for host_id, expected in self.step_reads:
            assert self.host[host_id] == expected, "a block copied back holds another block's data"
        self.step_swaps, self.step_reads = [], []
        self.cache.end_step()

    def turn(self, session_id: str, num_blocks: int, num_matching: int) -> None:
        turn = self.turns.get(session_id, 0)
        info = self.cache.get_session(session_id)
        if info is not None:
            restore = self.cache.check_out(session_id, num_matching)
            assert restore is not None
            plan = restore.plan
            assert plan.num_blocks == min(num_matching, info.num_blocks)
            position = plan.num_dropped_blocks
            for host_id in restore.host_block_ids:
                self.step_reads.append((host_id, (session_id, turn - 1, position)))
                position += 1
            for gpu_id in restore.gpu_block_ids:
                assert self.gpu[gpu_id] == (session_id, turn - 1, position)
                self.held.remove(gpu_id)
                position += 1
            assert position == plan.num_blocks
            for gpu_id in restore.freed_gpu_block_ids:
                self.held.remove(gpu_id)
        # The turn ran: its blocks hold this turn's data (fresh ids: no GPU block is reused).
        block_ids = []
        for position in range(num_blocks):
            block_id = next(self.labels)
            self.gpu[block_id] = (session_id, turn, position)
            block_ids.append(block_id)
        self.turns[session_id] = turn + 1
        self.held.update(block_ids)
        self.apply(self.cache.check_in(session_id, block_ids))

    def check(self) -> None:
        cache, config = self.cache, self.cache.config
        stats = cache.get_stats()
        assert stats.num_gpu_blocks == len(self.held) <= config.gpu_budget_blocks
        assert stats.num_cpu_blocks + stats.num_copied_ahead_blocks <= config.cpu_budget_blocks
        assert cache.get_num_free_host_blocks() <= config.cpu_budget_blocks - stats.num_cpu_blocks
        for info in cache.get_sessions():
            tiers = cache.get_tiers(info.session_id)
            # every chunk in exactly one tier, in the order dropped | cpu | gpu
            order = [Tier.DROPPED, Tier.CPU, Tier.GPU]
            assert [order.index(t) for t in tiers] == sorted(order.index(t) for t in tiers)
            assert Tier.DROPPED not in tiers or tiers[0] is Tier.DROPPED
            assert tiers.count(Tier.DROPPED) < len(tiers), "a session with every chunk dropped is forgotten"
            # the reusable part is [recomputed prefix | cached rest], from token 0
            plan = cache.plan_restore(info.session_id, info.num_blocks)
            assert plan is not None
            assert plan.num_dropped_blocks >= info.num_dropped_blocks
            assert plan.num_dropped_blocks + plan.num_host_blocks + plan.num_gpu_blocks == info.num_blocks
            assert plan.num_gpu_blocks == info.num_gpu_blocks
            assert info.num_dropped_blocks + info.num_cpu_blocks + info.num_gpu_blocks == info.num_blocks


@settings(max_examples=150, deadline=None)
@given(
    ops=operations,
    gpu_budget=st.integers(0, 30),
    cpu_budget=st.integers(0, 20),
    blocks_per_chunk=st.integers(1, 4),
    copy_ahead=st.integers(0, 8),
)
def test_random_sessions_keep_every_invariant(
    ops: list[tuple[str, int, int, int]], gpu_budget: int, cpu_budget: int, blocks_per_chunk: int, copy_ahead: int
) -> None:
    now = [0.0]
    cache = SessionCache(
        SessionCacheConfig(
            block_size=BLOCK_SIZE,
            blocks_per_chunk=blocks_per_chunk,
            gpu_budget_blocks=gpu_budget,
            cpu_budget_blocks=cpu_budget,
            idle_timeout_s=600.0,
            copy_ahead_free_blocks=copy_ahead,
        ),
        COSTS,
        lambda: now[0],
    )
    harness = Harness(cache)
    for kind, session, a, b in ops:
        session_id = f"s{session}"
        if kind == "turn":
            harness.turn(session_id, a, b)
        elif kind == "reclaim":
            freed, actions = cache.reclaim_gpu(a, keep_session_id=session_id if b else None)
            harness.apply(actions)
            assert freed >= a or cache.get_stats().num_gpu_blocks == (
                0 if not b or session_id not in cache else cache.get_session(session_id).num_gpu_blocks  # type: ignore[union-attr]
            )
        elif kind == "copy_ahead":
            pairs = cache.copy_ahead(a)
            harness.apply(SessionActions(swap_out=pairs))
        elif kind == "wait":
            now[0] += a
            harness.apply(cache.expire())
        elif kind == "drop":
            actions = cache.drop_session(session_id)
            if actions is not None:
                harness.apply(actions)
        else:
            harness.end_step()
        harness.check()
    harness.end_step()
    harness.check()
