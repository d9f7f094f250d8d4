"""The simulator on scenarios small enough to work out by hand: two models, one GPU, fixed arrivals.

The timing model is chosen so that every duration is exact: a model's 30 GiB of weights
take 1 s to copy to the GPU and 0.5 s back, 1 s to read from disk; a restore costs
1 + 1 = 2 s, a create 4 + 1 = 5 s, a park 0.5 + 0.5 = 1 s, a stop 0.5 s; a request of
100 prompt and 11 output tokens takes 0.1 s to its first token and 0.1 s more to end.
Each model serves from 60 of the GPU's 80 GiB, so the two never fit together.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from shoal.shared.placement.node_state import NodeWork
from shoal.sim.engine import Simulator
from shoal.sim.policies import POLICIES
from shoal.sim.scenario import Scenario, parse_scenario
from shoal.sim.state import WARM
from shoal.sim.traces import Trace

GiB = 1 << 30


def two_models(**overrides: Any) -> Scenario:
    raw: dict[str, Any] = {
        "seed": 3,
        "cluster": {"num_nodes": 1, "gpus_per_node": 1, "gpu_memory_bytes": "80GiB", "cpu_ram_bytes": "1TiB"},
        "models": [
            {"name": name, "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0}
            for name in ("a", "b")
        ],
        "timing": {
            "scheduler_latency_s": 0.0, "restore_fixed_s": 1.0, "host_to_device_bytes_per_s": 30 * GiB,
            "create_fixed_s": 4.0, "disk_bytes_per_s": 30 * GiB, "park_fixed_s": 0.5,
            "device_to_host_bytes_per_s": 60 * GiB, "stop_s": 0.5, "prefill_s_per_token_per_b": 0.001,
            "decode_s_per_token_per_b": 0.01, "interference": 0.0,
        },
        "trace": {"duration_s": 100.0, "popularity": {"interleave": False}},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return parse_scenario(raw)


def make_trace(requests: list[tuple[float, str]], keys: tuple[str, ...] = ("a", "b"), *, prompt: int = 100,
               output: int = 11, duration_s: float = 100.0) -> Trace:
    index = {key: i for i, key in enumerate(keys)}
    return Trace(keys, np.array([t for t, _ in requests], dtype=np.float64),
                 np.array([index[m] for _, m in requests], dtype=np.int32),
                 np.full(len(requests), prompt, dtype=np.int32), np.full(len(requests), output, dtype=np.int32),
                 duration_s)


def run(scenario: Scenario, trace: Trace, policy: str, *, keep_place: bool | None = None
        ) -> tuple[Simulator, list[float]]:
    sim = Simulator(scenario, trace, POLICIES[policy], record_events=True,  # type: ignore[index]
                    keep_place=keep_place)
    sim.run()
    return sim, list(np.frombuffer(sim.metrics.ttft))


def kinds(sim: Simulator) -> list[tuple[float, str, str]]:
    assert sim.events is not None
    return [(round(e.time_s, 6), e.kind, e.model) for e in sim.events]


SWAP_TRACE = [(0.0, "a"), (16.0, "b"), (40.0, "a")]


def test_shoal_preempts_at_once_when_no_occupant_would_sleep_by_itself() -> None:
    """a is created at 0 (ready at 5). b at 16: a has served 11 s (past its 10 s minimum
    runtime) and has no idle timeout, so waiting max_wait for it to sleep is pointless: b
    preempts a at once; a parks for 1 s, b claims at the 0.5 s poll of 17 and is created by
    22. a at 40 preempts b the same way and is restored from CPU RAM in 2 s: ready at 43."""
    sim, ttft = run(two_models(), make_trace(SWAP_TRACE), "shoal")
    assert ttft == pytest.approx([5.1, 6.1, 3.1])
    assert kinds(sim) == [
        (0.0, "load", "a"), (5.0, "ready", "a"),
        (16.0, "wake", "b"), (16.0, "preempt", "b"), (16.0, "evict", "a"), (17.0, "released", "a"),
        (17.0, "load", "b"), (17.0, "claimed", "b"), (22.0, "ready", "b"),
        (40.0, "wake", "a"), (40.0, "preempt", "a"), (40.0, "evict", "b"), (41.0, "released", "b"),
        (41.0, "load", "a"), (41.0, "claimed", "a"), (43.0, "ready", "a"),
    ]
    counters = sim.metrics.counters
    assert (counters["loads_from_disk"], counters["loads_from_cpu"], counters["evicted_preempted"]) == (2, 1, 2)
    assert sim.metrics.waits_s == pytest.approx([5.0, 6.0, 3.0])


def test_shoal_waits_out_the_fairness_wait_while_an_occupant_may_sleep_within_it() -> None:
    """a sleeps after 5 idle seconds; its last request ends at 15.7, so it may sleep by itself
    at 20.7, inside the 5 s wait of b (from 16 to 21): b waits. The reconciler's round that
    would put a to sleep comes only at 25, so b preempts a at 21; a parks by 22, b claims at
    the 22.0 poll and is created by 27."""
    scenario = two_models(models=[
        {"name": "a", "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0,
         "sleep": {"idle_timeout_s": 5.0}},
        {"name": "b", "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0},
    ])
    trace = make_trace([(0.0, "a"), (8.0, "a"), (12.0, "a"), (15.5, "a"), (16.0, "b")])
    sim, ttft = run(scenario, trace, "shoal")
    assert ttft == pytest.approx([5.1, 0.1, 0.1, 0.1, 11.1])
    assert [e for e in kinds(sim) if e[0] >= 16.0] == [
        (16.0, "wake", "b"), (21.0, "preempt", "b"), (21.0, "evict", "a"), (22.0, "released", "a"),
        (22.0, "load", "b"), (22.0, "claimed", "b"), (27.0, "ready", "b")]
    assert sim.metrics.counters["evicted_preempted"] == 1


@pytest.mark.parametrize("level", ["warm", "cold"])
def test_lru_swaps_at_once_and_reloads_from_disk(level: str) -> None:
    """No fairness wait, no minimum runtime: the victim stops (0.5 s) the moment the other
    model asks, and comes back from disk (5 s), whatever the catalog's sleep level (plain
    LRU swapping stops processes; only Shoal's cold sleep keeps them)."""
    scenario = two_models(models=[
        {"name": name, "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0,
         "sleep": {"level": level}} for name in ("a", "b")])
    sim, ttft = run(scenario, make_trace(SWAP_TRACE), "lru")
    assert ttft == pytest.approx([5.1, 5.6, 5.6])
    counters = sim.metrics.counters
    assert (counters["loads_from_disk"], counters["loads_from_cpu"], counters["reloads_in_place"]) == (3, 0, 0)
    assert [e for e in kinds(sim) if e[1] == "evict"] == [(16.0, "evict", "a"), (40.0, "evict", "b")]
    assert sim.events is not None
    assert [e.detail for e in sim.events if e.kind == "released"] == ["COLD", "COLD"]
    assert not any(r.state == WARM for r in sim.state.replicas.values())


def test_seed_heuristic_reserves_the_whole_gpu_and_parks() -> None:
    """3 x 30 GiB does not fit in 80% of the GPU: seed 000 reserves the whole GPU. No fairness:
    b preempts a at once; a parks (1 s), so its return is a 2 s restore."""
    sim, ttft = run(two_models(), make_trace(SWAP_TRACE), "seed")
    assert ttft == pytest.approx([5.1, 6.1, 3.1])
    assert sim.state.gpus[0].hot_bytes == 80 * GiB


def test_one_model_per_gpu_serves_the_model_it_placed_and_refuses_the_other() -> None:
    sim, ttft = run(two_models(), make_trace(SWAP_TRACE), "dedicated")
    assert ttft[0] == pytest.approx(0.1) and ttft[2] == pytest.approx(0.1)
    assert math.isinf(ttft[1])
    assert sim.metrics.counters["failed_unplaceable"] == 1


def test_a_victim_inside_its_minimum_runtime_makes_the_waker_fail_until_it_is_eligible() -> None:
    """a is ready at 5; b at 6 finds only a, which has served 1 s of its 10: no victim, b's
    request fails (503) and b is refused until a is eligible at 15; b at 10 fails at once; b at
    16 wakes normally: preempts at once (a never sleeps by itself), created by 22."""
    trace = make_trace([(0.0, "a"), (6.0, "b"), (10.0, "b"), (16.0, "b")])
    sim, ttft = run(two_models(), trace, "shoal")
    assert ttft[0] == pytest.approx(5.1)
    assert math.isinf(ttft[1]) and math.isinf(ttft[2])
    assert ttft[3] == pytest.approx(6.1)
    assert sim.metrics.counters["failed_no_victim"] == 2
    blocked = [e for e in sim.events or [] if e.kind == "blocked"]
    assert [(e.time_s, e.model) for e in blocked] == [(6.0, "b")]
    assert "eligible in 9.0 s" in blocked[0].detail


def sleepy_a(idle_timeout_s: float) -> Scenario:
    """a sleeps after `idle_timeout_s` without requests and may be preempted at once."""
    return two_models(models=[
        {"name": "a", "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0,
         "fairness": {"min_runtime_s": 0.0}, "sleep": {"idle_timeout_s": idle_timeout_s}},
        {"name": "b", "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0},
    ])


@pytest.mark.parametrize(("idle_timeout_s", "b_at", "slept_at", "claimed_at"), [
    # a's request ends at 5.2; the reconciler's rounds are every 5 s. b waits (a may sleep by
    # itself within its wait); once a is leaving, no occupant will sleep by itself, the wait
    # ends, and the memory a is giving back needs no victim: b claims at its next 0.5 s poll
    # after a's park (1 s), without preempting.
    (3.0, 9.5, 10.0, 11.0),   # idle from 8.2: the round at 10; b's check at 10.5 sees a leaving
    (9.0, 12.5, 15.0, 16.0),  # idle from 14.2: the round at 15; b's check at 15.5 sees a leaving
])
def test_memory_an_idle_model_gives_back_is_claimed_at_the_waiters_next_check_without_preempting(
        idle_timeout_s: float, b_at: float, slept_at: float, claimed_at: float) -> None:
    sim, ttft = run(sleepy_a(idle_timeout_s), make_trace([(0.0, "a"), (b_at, "b")]), "shoal")
    assert [e for e in kinds(sim) if e[1] in ("wake", "evict", "released", "claimed")] == [
        (b_at, "wake", "b"), (slept_at, "evict", "a"), (slept_at + 1.0, "released", "a"),
        (claimed_at, "claimed", "b")]
    assert ttft == pytest.approx([5.1, claimed_at + 5.0 + 0.1 - b_at])
    assert sim.metrics.counters["evicted_idle"] == 1
    assert sim.metrics.counters["evicted_preempted"] == 0


def test_requests_queue_for_kv_cache_and_run_in_arrival_order() -> None:
    """A replica with 250 tokens of KV runs two 111-token requests at once; the third waits
    for the first to end (at 5.2) and prefills after the second's prefill."""
    scenario = two_models(models=[
        {"name": "a", "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 1,
         "kv_cache_tokens": 250},
        {"name": "b", "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0},
    ])
    trace = make_trace([(5.0, "a"), (5.0, "a"), (5.0, "a")])
    _, ttft = run(scenario, trace, "shoal")
    # prefills run one after another: first tokens at 5.1 and 5.2; the first ends at 5.2, the
    # third starts then, behind no prefill: first token 5.3.
    assert ttft == pytest.approx([0.1, 0.2, 0.3])


def test_replicas_sharing_a_gpu_slow_each_other_by_their_share_of_it() -> None:
    """Two 10 GiB models on one GPU, both running: with interference 1 a request of the 1B
    model next to a running 3B model takes (1 + 3) / 1 = 4 times as long."""
    scenario = two_models(
        models=[{"name": "a", "params_b": 1.0, "weight_bytes": "2GiB", "measured_bytes": "10GiB", "replicas": 1},
                {"name": "b", "params_b": 3.0, "weight_bytes": "6GiB", "measured_bytes": "10GiB", "replicas": 1}],
        timing={"interference": 1.0})
    trace = make_trace([(1.0, "b"), (1.05, "a")])
    _, ttft = run(scenario, trace, "shoal")
    assert ttft == pytest.approx([0.3, 0.4])


def test_a_drain_that_times_out_hands_running_requests_back_to_the_queue() -> None:
    """a (always on, minimum runtime 0, never idle) runs a 1,001-token answer (10 s) from 16.0;
    b preempts a at once: a drains for its 2 s timeout, its request goes back to a's queue at
    18, a parks by 19 and b claims at its 19.0 poll. a's requeued request asks for a wake at
    18, but b's older intent keeps the memory a gives back: no victim, a 503."""
    scenario = two_models(models=[
        {"name": "a", "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 1,
         "fairness": {"min_runtime_s": 0.0}, "sleep": {"drain_timeout_s": 2.0}},
        {"name": "b", "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0},
    ])
    trace = Trace(("a", "b"), np.array([16.0, 16.0]), np.array([0, 1], dtype=np.int32),
                  np.array([100, 100], dtype=np.int32), np.array([1001, 11], dtype=np.int32), 100.0)
    sim, ttft = run(scenario, trace, "shoal")
    assert sim.metrics.counters["requeued"] == 1
    assert [e for e in kinds(sim) if e[1] in ("preempt", "evict", "released", "claimed", "blocked")] == [
        (16.0, "preempt", "b"), (16.0, "evict", "a"), (18.0, "blocked", "a"), (19.0, "released", "a"),
        (19.0, "claimed", "b")]
    assert ttft[1] == pytest.approx(19.0 + 5.0 + 0.1 - 16.0)
    assert math.isinf(ttft[0]) and sim.metrics.counters["failed_no_victim"] == 1


def test_the_same_scenario_and_seed_give_the_same_results() -> None:
    scenario = parse_scenario({
        "seed": 7, "cluster": {"num_nodes": 1, "gpus_per_node": 4},
        "models": [{"name": "m", "count": 12, "params_b": 7.0, "measured_bytes": "50GiB", "replicas": 0,
                    "sleep": {"idle_timeout_s": 60}}],
        "trace": {"duration_s": 1800, "arrivals": {"kind": "gamma", "cv": 3.0, "rate_per_s": 2.0},
                  "popularity": {"exponent": 0.8}},
    })
    from shoal.sim.traces import generate_trace

    first_trace, second_trace = (generate_trace(scenario.trace, scenario.models, scenario.seed) for _ in range(2))
    assert np.array_equal(first_trace.time_s, second_trace.time_s)
    for policy in ("shoal", "lru", "seed"):
        first, second = (Simulator(scenario, trace, POLICIES[policy], record_events=True)
                         for trace in (first_trace, second_trace))
        first_result, second_result = first.run(), second.run()
        assert first.events == second.events
        assert np.array_equal(np.frombuffer(first.metrics.ttft), np.frombuffer(second.metrics.ttft))
        assert first_result.counters == second_result.counters
        assert first_result.counters.get("wakes", 0) > 0, "the scenario exercises wakes"


def test_a_replica_given_less_than_its_measured_memory_gets_a_smaller_kv_pool() -> None:
    """The seed's 3 x 10 GiB = 30 GiB for a model measured at 60 GiB (10 GiB of weights): its
    engine keeps (30 - 10) / (60 - 10) = 40% of the 1,000-token KV budget; Shoal reserves the
    measured 60 GiB and keeps it all."""
    scenario = two_models(models=[
        {"name": "a", "params_b": 1.0, "weight_bytes": "10GiB", "measured_bytes": "60GiB", "replicas": 1,
         "kv_cache_tokens": 1000},
        {"name": "b", "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0},
    ])
    trace = make_trace([(1.0, "a")])
    for policy, kv_tokens in (("seed", 400), ("shoal", 1000)):
        sim, _ = run(scenario, trace, policy)
        (replica,) = [r for r in sim.state.replicas.values() if r.model.key == "a"]
        assert replica.kv_capacity == kv_tokens


def sleeping_models(a_level: str, *, cpu_ram: str = "1TiB", idle_timeout_s: float | None = 5.0) -> Scenario:
    """a sleeps at `a_level` (after `idle_timeout_s` idle, if given), b parks warm."""
    sleep: dict[str, Any] = {"level": a_level}
    if idle_timeout_s is not None:
        sleep["idle_timeout_s"] = idle_timeout_s
    return two_models(cluster={"cpu_ram_bytes": cpu_ram}, models=[
        {"name": "a", "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0,
         "fairness": {"min_runtime_s": 0.0}, "sleep": sleep},
        {"name": "b", "params_b": 1.0, "weight_bytes": "30GiB", "measured_bytes": "60GiB", "replicas": 0},
    ])


@pytest.mark.parametrize(("level", "parked"), [("cold", True), ("warm", False)])
def test_a_cold_sleep_parks_the_process_charged_only_parked_process_bytes(level: str, parked: bool) -> None:
    """8 GiB of RAM: 4 GiB of CPU cache, too little for a's 30 GiB of weights. a's request ends
    at 5.2; the round at 15 puts it to sleep. Slept cold, it parks WARM with its weights dropped
    (0.5 s: nothing copied), charged 512 MiB (``parked_process_bytes``), in the sim's snapshot
    and in the planner's CPU cache alike; slept warm, its weights find no room: it stops."""
    scenario = sleeping_models(level, cpu_ram="8GiB")
    sim, _ = run(scenario, make_trace([(0.0, "a")]), "shoal")
    assert [e for e in kinds(sim) if e[1] in ("evict", "released")] == [(15.0, "evict", "a"),
                                                                          (15.5, "released", "a")]
    assert sim.events is not None
    assert [e.detail for e in sim.events if e.kind == "released"] == ["WARM" if parked else "COLD"]
    assert [(r.state, r.weights_dropped) for r in sim.state.replicas.values()] == ([(WARM, True)] if parked else [])
    charge = scenario.cluster.placement.parked_process_bytes
    assert charge == 512 << 20
    (node,) = sim.state.build_snapshot(sim.now, sim.desired).nodes
    assert [(r.level, r.cpu_bytes, r.parked_bytes) for r in node.replicas] == (
        [("WARM", 30 * GiB, charge)] if parked else [])
    work = NodeWork(node, 0.0, {0: 0.0}, 0.0)
    assert work.cpu_cache.used_bytes == (charge if parked else 0)


@pytest.mark.parametrize(("level", "sleep_s", "wake_s", "counter"), [
    ("cold", 0.5, 3.0, "reloads_in_place"),  # park_fixed; restore_fixed 1 + disk 1 + to the GPU 1
    ("warm", 1.0, 2.0, "loads_from_cpu"),    # park_fixed 0.5 + copy out 0.5; restore_fixed 1 + copy in 1
])
def test_a_cold_slept_replica_wakes_by_reloading_its_weights_into_its_process(
        level: str, sleep_s: float, wake_s: float, counter: str) -> None:
    """a sleeps idle at 15 and is asked again at 30: the same replica is woken. Cold, it reads its
    weights from disk and copies them to the GPU in its living process (3 s, not a 5 s create)."""
    sim, ttft = run(sleeping_models(level), make_trace([(0.0, "a"), (30.0, "a")]), "shoal")
    assert ttft == pytest.approx([5.1, wake_s + 0.1])
    assert [e for e in kinds(sim) if e[1] in ("evict", "released", "load", "ready") and e[0] < 35.0] == [
        (0.0, "load", "a"), (5.0, "ready", "a"), (15.0, "evict", "a"), (15.0 + sleep_s, "released", "a"),
        (30.0, "load", "a"), (30.0 + wake_s, "ready", "a")]
    counters = sim.metrics.counters
    assert counters["loads_from_disk"] == 1 and counters[counter] == 1
    assert counters["loads_from_cpu"] + counters["reloads_in_place"] == 1
    assert sim.events is not None
    assert [e.detail for e in sim.events if e.kind == "evict"] == (
        ["idle to WARM (weights dropped)"] * 2 if level == "cold" else ["idle to WARM"] * 2)


def test_a_preempted_cold_model_parks_without_its_weights_and_reloads() -> None:
    """SWAP_TRACE with a cold: b preempts a at 16; a parks in 0.5 s (its weights dropped), b is
    created by its claim after that. a at 40 preempts b (a warm park, 1 s: released at 41)
    and is reloaded in its own process: 1 + 1 + 1 = 3 s, ready at 44."""
    sim, ttft = run(sleeping_models("cold", idle_timeout_s=None), make_trace(SWAP_TRACE), "shoal")
    events = kinds(sim)
    assert (16.5, "released", "a") in events
    assert [e for e in events if e[0] >= 40.0] == [
        (40.0, "wake", "a"), (40.0, "preempt", "a"), (40.0, "evict", "b"), (41.0, "released", "b"),
        (41.0, "load", "a"), (41.0, "claimed", "a"), (44.0, "ready", "a")]
    assert ttft[2] == pytest.approx(4.1)
    assert sim.metrics.counters["reloads_in_place"] == 1
