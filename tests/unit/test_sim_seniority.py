"""A blocked waker keeps its place in line (`keep_place`), and requests wait out a block
(`timing.capacity_wait_s`), on scenarios worked out by hand.

The timing model is test_sim_engine's: one 80 GiB GPU; every model serves from 60 GiB, so
only one fits; a create takes 5 s, a park 1 s; a request's first token comes 0.1 s after it
starts. Fairness is the catalog's default: 10 s minimum runtime, 5 s fairness wait. a is
created by its request at 0 and ready at 5, so it may be preempted from 15 on.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest

from shoal.shared.placement.fairness import NOT_SERVING_RECHECK_S
from shoal.sim.engine import Simulator
from shoal.sim.policies import POLICIES
from shoal.sim.scenario import Scenario
from tests.unit.test_sim_causality import SPLIT_S, busy_scenario, decisions_before, diverging_traces
from tests.unit.test_sim_engine import kinds, make_trace, run, two_models

KEYS = ("a", "c", "d")


def three_models(**timing: Any) -> Scenario:
    """a, c and d, 60 GiB each, on one 80 GiB GPU."""
    model = {"params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0}
    return two_models(models=[{"name": key, **model} for key in KEYS], timing=timing)


def blocks(sim: Simulator) -> list[tuple[float, str, str]]:
    return [e for e in kinds(sim) if e[1] in ("blocked", "held", "resumed", "lapsed", "preempt", "claimed")]


@pytest.mark.parametrize("keep_place", [True, False])
def test_an_older_blocked_waker_gets_the_memory_before_a_newer_one(keep_place: bool) -> None:
    """c at 6 finds only a, inside its minimum runtime: blocked until 15. d at 8 too, behind c's
    place: blocked 5 s (`behind_older_wakers`), until 13. d asks again first, at 15.5; c at 16.

    keep_place: c's wake held its place (an intent since 6), d's too (since 8) until its block
    ended at 13 and nobody asked by 13 + 2: its place lapses at 15. d's request at 15.5 starts
    a new wake, which sees c's older intent keep 60 of the GPU's 80 GiB: preempting a would not
    free enough; d fails and holds a place behind c for 5 s (lapsing at 22.5). c's wake runs
    again at 16 (asked), preempts a at once (its fairness wait ended at 11); a parks by 17, c
    claims at its 17.0 poll, is created by 22: ttft 6.1.

    Without: d's request at 15.5 starts a new wake, which preempts a; a parks by 16.5, d
    claims and is created by 21.5 (ttft 6.1). c at 16 starts a wake younger than d's: d's
    intent keeps the memory and a, leaving, is no victim: c fails, refused for 2 s (a replica
    leaving or loading is looked at again soon, `NOT_SERVING_RECHECK_S`)."""
    trace = make_trace([(0.0, "a"), (6.0, "c"), (8.0, "d"), (15.5, "d"), (16.0, "c")], KEYS)
    sim, ttft = run(three_models(), trace, "shoal", keep_place=keep_place)
    assert ttft[0] == pytest.approx(5.1)
    assert all(math.isinf(t) for t in ttft[1:3])
    if keep_place:
        assert math.isinf(ttft[3]) and ttft[4] == pytest.approx(6.1)
        assert blocks(sim) == [
            (6.0, "blocked", "c"), (6.0, "held", "c"), (8.0, "blocked", "d"), (8.0, "held", "d"),
            (15.0, "lapsed", "d"), (15.5, "blocked", "d"), (15.5, "held", "d"), (16.0, "resumed", "c"),
            (16.0, "preempt", "c"), (17.0, "claimed", "c"), (22.5, "lapsed", "d")]
        assert sim.models[2].blocked_until == pytest.approx(20.5)
        assert sim.metrics.counters["places_kept"] == 3
    else:
        assert ttft[3] == pytest.approx(6.1) and math.isinf(ttft[4])
        assert blocks(sim) == [
            (6.0, "blocked", "c"), (8.0, "blocked", "d"), (15.5, "preempt", "d"), (16.0, "blocked", "c"),
            (16.5, "claimed", "d")]
        assert sim.models[1].blocked_until == pytest.approx(16.0 + NOT_SERVING_RECHECK_S)
        assert "places_kept" not in sim.metrics.counters
    assert sim.metrics.counters["failed_no_victim"] == 3


@pytest.mark.parametrize(("d_at", "d_served"), [(16.0, False), (18.0, True)])
def test_a_held_place_lapses_when_no_request_comes_back_in_time(d_at: float, d_served: bool) -> None:
    """c at 6 is blocked until 15 and holds its place; c at 12 is refused (a 503 its client
    took: no interest), and nobody asks for c after 15. Until 15 + 2 = 17 c's intent keeps 60
    GiB of the GPU: d at 16 could preempt a (eligible since 15) but not free enough with c's
    place kept, and fails (it holds a place behind c's for 5 s, lapsing at 23). At 17 c's place
    lapses (its intent goes); d at 18 preempts a at once, a parks by 19, d claims at its 19.0
    poll and is created by 24."""
    trace = make_trace([(0.0, "a"), (6.0, "c"), (12.0, "c"), (d_at, "d")], KEYS)
    sim, ttft = run(three_models(), trace, "shoal")
    assert (17.0, "lapsed", "c") in kinds(sim)
    if d_served:
        assert ttft[3] == pytest.approx(6.1)
        assert [e for e in blocks(sim) if e[2] == "d"] == [(18.0, "preempt", "d"), (19.0, "claimed", "d")]
        assert sim.metrics.counters["places_lapsed"] == 1
    else:
        assert math.isinf(ttft[3])
        assert [e for e in blocks(sim) if e[2] == "d"] == [(16.0, "blocked", "d"), (16.0, "held", "d"),
                                                           (23.0, "lapsed", "d")]
        assert sim.metrics.counters["places_lapsed"] == 2
    assert not sim.wakes.held and not sim.state.gpus[0].intents


def test_a_request_after_the_block_runs_the_held_wake_again_at_once() -> None:
    """c at 6 is blocked until 15; c at 12 is refused. c at 16 (its place held until 20) runs
    the wake again at once, as old as it was (since 6): its fairness wait over, it preempts a,
    which parks by 17; c claims at its 17.0 poll and is created by 22 (ttft 6.1)."""
    trace = make_trace([(0.0, "a"), (6.0, "c"), (12.0, "c"), (16.0, "c")], KEYS)
    sim, ttft = run(three_models(), trace, "shoal")
    assert math.isinf(ttft[1]) and math.isinf(ttft[2]) and ttft[3] == pytest.approx(6.1)
    assert blocks(sim) == [
        (6.0, "blocked", "c"), (6.0, "held", "c"), (16.0, "resumed", "c"), (16.0, "preempt", "c"),
        (17.0, "claimed", "c")]
    assert sim.metrics.counters["wakes"] == 1
    assert sim.events is not None
    assert [e.detail for e in sim.events if e.kind == "claimed"] == ["after 11.000 s"]


@pytest.mark.parametrize(("capacity_wait_s", "expected_ttft", "expected_waits"), [
    # b at 6 asks again at 15, within 6 + 20: both wait; b's wake runs again at 15 (its
    # requests ask), preempts a, claims at 16, is created by 21: first tokens at 21.1 and,
    # after the first's prefill, 21.2. b waited from 6 to 21.
    (20.0, [5.1, 15.1, 11.2], [5.0, 15.0]),
    # b at 6 would ask again at 15, after 6 + 5: a 503 at once (its wait, 0 s, ends); b at 10
    # may wait until 15 (10 + 5): it is answered at 21.1.
    (5.0, [5.1, math.inf, 11.1], [5.0, 0.0, 11.0]),
    # No capacity wait: both fail at once; nobody asks after the block, b's place lapses at 17.
    (0.0, [5.1, math.inf, math.inf], [5.0, 0.0]),
])
def test_with_capacity_wait_a_blocked_request_waits_and_is_answered_after_the_block(
        capacity_wait_s: float, expected_ttft: list[float], expected_waits: list[float]) -> None:
    scenario = two_models(timing={"capacity_wait_s": capacity_wait_s})
    sim, ttft = run(scenario, make_trace([(0.0, "a"), (6.0, "b"), (10.0, "b")]), "shoal")
    assert ttft == pytest.approx(expected_ttft)
    assert sim.metrics.waits_s == pytest.approx(expected_waits)
    assert ((16.0, "claimed", "b") in kinds(sim)) == (capacity_wait_s > 0)
    assert ((17.0, "lapsed", "b") in kinds(sim)) == (capacity_wait_s == 0)
    assert sim.metrics.counters["failed_no_victim"] == sum(math.isinf(t) for t in expected_ttft)


def test_a_waiting_request_fails_with_the_blocks_reason_when_the_next_block_ends_too_late() -> None:
    """Capacity wait 10 s. c at 6 is blocked until 15, d at 8 behind c's place for 5 s, until 13;
    both wait (15 <= 16, 13 <= 18). d's wake runs again at 13 (its request asks) and is blocked
    again until 15 (a's minimum runtime). At 15 c's wake runs again first (its place is older),
    preempts a, claims at 16, is created by 21: c's request is answered at 21.1. d's wake, with
    a leaving, is blocked again for 2 s (`NOT_SERVING_RECHECK_S`); at 17 it finds c loading and
    is blocked until 19: past 8 + 10, so d's request fails with the block's reason at 17, and
    d's place lapses at 21."""
    trace = make_trace([(0.0, "a"), (6.0, "c"), (8.0, "d")], KEYS)
    sim, ttft = run(three_models(capacity_wait_s=10.0), trace, "shoal")
    assert ttft[1] == pytest.approx(15.1) and math.isinf(ttft[2])
    assert [e for e in blocks(sim) if e[0] >= 13.0] == [
        (13.0, "resumed", "d"), (13.0, "blocked", "d"), (13.0, "held", "d"),
        (15.0, "resumed", "c"), (15.0, "preempt", "c"), (15.0, "resumed", "d"), (15.0, "blocked", "d"),
        (15.0, "held", "d"), (16.0, "claimed", "c"), (17.0, "resumed", "d"), (17.0, "blocked", "d"),
        (17.0, "held", "d"), (21.0, "lapsed", "d")]
    assert sim.metrics.counters["failed_no_victim"] == 1
    assert sim.metrics.waits_s == pytest.approx([5.0, 9.0, 15.0])  # a, d (8 to 17), c (6 to 21)


def test_capacity_wait_must_be_a_number_of_seconds() -> None:
    with pytest.raises(ValueError, match="capacity_wait_s"):
        two_models(timing={"capacity_wait_s": -1.0})


@pytest.mark.parametrize("keep_place", [True, False])
def test_decisions_with_held_places_and_capacity_wait_do_not_depend_on_later_requests(keep_place: bool) -> None:
    scenario = busy_scenario()
    scenario = msgspec.structs.replace(scenario, timing=msgspec.structs.replace(scenario.timing,
                                                                                capacity_wait_s=60.0))
    first, second = diverging_traces(scenario)
    runs = [decisions_before(Simulator(scenario, trace, POLICIES["shoal"], record_events=True, keep_place=keep_place),
                             trace, SPLIT_S) for trace in (first, second)]
    (first_events, first_tokens), (second_events, second_tokens) = runs
    assert first_events == second_events
    assert np.array_equal(first_tokens, second_tokens)
    assert ("held" in {e.kind for e in first_events}) == keep_place, "the prefix exercises held places"
