"""Seed 002's replica logic: target ids, scale down, explicit evictions, WARM parking in CPU
RAM, desired-count adjustments, and the apply() delta."""

from __future__ import annotations

import random
import uuid

from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.memory_figure import MemoryFigure
from shoal.shared.placement.plan import Eviction, Placement, PlacementPlan
from shoal.shared.placement.planner import ClusterPlanner, plan_placements
from shoal.shared.placement.replicas import (
    ReplicaLocation,
    build_delta,
    choose_replicas_to_remove,
    get_planned_locations,
    new_replica_id,
    target_replica_ids,
)
from shoal.shared.placement.snapshot import (
    CandidateLevel,
    ClusterSnapshot,
    ModelDemand,
    NodeSnapshot,
    ReplicaSnapshot,
)

GiB = 1 << 30
CONFIG = PlacementConfig()


def hot(
    replica_id: str, model: str, gpu_gib: dict[int, int], *, cpu_gib: int = 1, **kwargs: object
) -> ReplicaSnapshot:
    gpu_bytes = {g: b * GiB for g, b in gpu_gib.items()}
    return ReplicaSnapshot(replica_id, model, "HOT", gpu_bytes, cpu_gib * GiB, **kwargs)  # type: ignore[arg-type]


def warm(replica_id: str, model: str, cpu_gib: int, **kwargs: object) -> ReplicaSnapshot:
    return ReplicaSnapshot(replica_id, model, "WARM", {}, cpu_gib * GiB, **kwargs)  # type: ignore[arg-type]


def one_node(
    *replicas: ReplicaSnapshot, gpu_gib: tuple[int, ...] = (80,), cpu_cache_gib: int = 64, node_id: str = "n0"
) -> NodeSnapshot:
    return NodeSnapshot(node_id, {g: b * GiB for g, b in enumerate(gpu_gib)}, cpu_cache_gib * GiB, replicas)


def demand(model: str, required_gib: int, desired: int = 1) -> ModelDemand:
    return ModelDemand(model, MemoryFigure(required_gib * GiB, required_gib * GiB // 2, "measured"), desired)


def planner(*nodes: NodeSnapshot, desired: dict[str, int] | None = None, seed: int = 0) -> ClusterPlanner:
    cluster = ClusterSnapshot(nodes, desired or {})
    return ClusterPlanner(cluster, config=CONFIG, rng=random.Random(seed), clock=lambda: 500.0)


# --------------------------------------------------------------------------- target ids


def test_target_ids_reuse_cached_ids_first_then_make_new_ones() -> None:
    targets = target_replica_ids(4, 1, ["c1", "c2"], {"c1", "c2", "h1"}, random.Random(3))
    assert targets[:2] == ["c1", "c2"]
    assert len(targets) == 3
    for replica_id in targets[2:]:
        assert uuid.UUID(hex=replica_id).version == 4 and len(replica_id) == 32


def test_target_ids_take_only_as_many_cached_ids_as_needed() -> None:
    assert target_replica_ids(2, 1, ["c1", "c2"], set(), random.Random(0)) == ["c1"]
    assert target_replica_ids(1, 3, ["c1"], set(), random.Random(0)) == []


def test_new_ids_never_collide_with_taken_ones() -> None:
    colliding = new_replica_id(random.Random(7), set())
    fresh = new_replica_id(random.Random(7), {colliding})
    assert fresh != colliding
    assert target_replica_ids(1, 0, [], {colliding}, random.Random(7)) == [fresh]


def test_planner_promotes_the_most_recently_used_warm_replica_first() -> None:
    node = one_node(warm("old", "m", 1, last_accessed=1.0), warm("new", "m", 1, last_accessed=9.0))
    plan = plan_placements(
        ClusterSnapshot((node,)), [demand("m", 10)], config=CONFIG, rng=random.Random(0), clock=lambda: 0.0
    )
    (placement,) = plan.placements
    assert (placement.replica_id, placement.from_level, placement.candidate_level) == (
        "new",
        "WARM",
        CandidateLevel.CACHED_AND_FREE,
    )


# --------------------------------------------------------------------------- scale down


def test_removal_prefers_warm_then_least_recently_used_hot() -> None:
    replicas = [
        hot("h_recent", "m", {0: 1}, last_accessed=9.0),
        hot("h_old", "m", {0: 1}, last_accessed=1.0),
        warm("w", "m", 1, last_accessed=10.0),
    ]
    assert choose_replicas_to_remove(replicas, 2) == ["w", "h_old"]
    assert choose_replicas_to_remove(replicas, 9) == ["w", "h_old", "h_recent"]
    assert choose_replicas_to_remove(replicas, -1) == []


def test_scale_down_deletes_warm_then_lru_hot_and_sets_desired() -> None:
    node = one_node(
        hot("h1", "m", {0: 10}, last_accessed=1.0),
        hot("h2", "m", {0: 10}, last_accessed=5.0),
        hot("h3", "m", {0: 10}, last_accessed=9.0),
        warm("w1", "m", 2),
    )
    p = planner(node, desired={"m": 3})
    assert p.scale_down("m", 2) == ["w1", "h1"]
    plan = p.finish()
    assert [(e.replica_id, e.from_level, e.to_level, e.reason) for e in plan.evictions] == [
        ("w1", "WARM", "COLD", "scale_down"),
        ("h1", "HOT", "COLD", "scale_down"),
    ]
    assert plan.desired_replicas == {"m": 2}


# --------------------------------------------------------------------------- explicit eviction


def test_evicting_a_model_parks_its_hot_replicas_and_sets_desired_to_zero() -> None:
    node = one_node(
        hot("h1", "m", {0: 10}, cpu_gib=4), hot("h2", "m", {0: 10}, cpu_gib=4), warm("w1", "m", 2)
    )
    p = planner(node, desired={"m": 2})
    assert p.evict_model("m") == ["h1", "h2"]
    plan = p.finish()
    assert [(e.replica_id, e.to_level, e.freed_gpu_bytes) for e in plan.evictions] == [
        ("h1", "WARM", {0: 10 * GiB}),
        ("h2", "WARM", {0: 10 * GiB}),
    ]
    assert plan.desired_replicas == {"m": 0}


def test_evicting_one_replica_decrements_desired() -> None:
    p = planner(one_node(hot("h1", "m", {0: 10}), warm("w1", "m", 2)), desired={"m": 1})
    assert p.evict_replica("m", "h1")
    assert p.evict_replica("m", "w1")
    assert not p.evict_replica("m", "nope")
    assert not p.evict_replica("other", "h1")
    plan = p.finish()
    assert [(e.replica_id, e.from_level, e.to_level, e.reason) for e in plan.evictions] == [
        ("h1", "HOT", "WARM", "explicit"),
        ("w1", "WARM", "COLD", "explicit"),
    ]
    assert plan.desired_replicas == {"m": 0}


# --------------------------------------------------------------------------- CPU RAM for WARM replicas


def test_evicted_replica_is_parked_warm_when_cpu_ram_allows() -> None:
    p = planner(one_node(hot("x1", "x", {0: 70}, cpu_gib=4), cpu_cache_gib=10), desired={"x": 1})
    p.ensure(demand("m", 20))
    plan = p.finish()
    assert [(e.replica_id, e.to_level, e.reason) for e in plan.evictions] == [("x1", "WARM", "pressure")]
    assert plan.placements[0].eviction_ids == ("x1",)
    assert plan.desired_replicas == {"m": 1}, "a pressure eviction leaves the victim's desired count alone"


def test_a_model_short_of_replicas_after_pressure_is_refilled_only_without_evictions() -> None:
    # x was evicted by pressure: its desired count (1) stays, it is under-replicated.
    node = one_node(hot("m1", "m", {0: 70}), warm("x1", "x", 4), cpu_cache_gib=10)
    refill = planner(node, desired={"m": 1, "x": 1})
    offers = refill.ensure(demand("x", 20), allow_evictions=False)
    plan = refill.finish()
    assert [o.level for o in offers] == [CandidateLevel.CACHED_AND_FULL]
    assert plan.placements == () and plan.evictions == ()
    assert [(u.replica_id, u.reason) for u in plan.unplaced] == [("x1", "no node has room without evictions")]
    assert plan.desired_replicas == {}, "waiting for room does not lower the desired count"

    # Room returns (a second GPU): the refill restores x1 there, evicting nothing.
    roomy = one_node(hot("m1", "m", {0: 70}), warm("x1", "x", 4), gpu_gib=(80, 80), cpu_cache_gib=10)
    refill = planner(roomy, desired={"m": 1, "x": 1})
    refill.ensure(demand("x", 20), allow_evictions=False)
    plan = refill.finish()
    assert [(p.replica_id, p.gpu_bytes, p.from_level) for p in plan.placements] == [("x1", {1: 20 * GiB}, "WARM")]
    assert plan.evictions == ()


def test_warm_replicas_are_dropped_smallest_first_to_park_an_evicted_one() -> None:
    node = one_node(
        hot("x1", "x", {0: 70}, cpu_gib=4), warm("w3", "y", 3), warm("w5", "z", 5), cpu_cache_gib=10
    )
    p = planner(node)
    p.ensure(demand("m", 20))
    plan = p.finish()
    assert [(e.replica_id, e.from_level, e.to_level, e.reason) for e in plan.evictions] == [
        ("x1", "HOT", "WARM", "pressure"),
        ("w3", "WARM", "COLD", "cpu_pressure"),
    ]


def test_evicted_replica_is_deleted_when_dropping_cannot_make_room() -> None:
    node = one_node(hot("x1", "x", {0: 70}, cpu_gib=4), warm("w8", "y", 8, protected=True), cpu_cache_gib=10)
    p = planner(node)
    p.ensure(demand("m", 20))
    plan = p.finish()
    assert [(e.replica_id, e.to_level) for e in plan.evictions] == [("x1", "COLD")]


def test_a_warm_copy_about_to_be_promoted_is_not_dropped_for_its_victim() -> None:
    # Restoring r_m needs x1 off the GPU; x1 is parked before r_m leaves the CPU cache (the
    # delta runs to_cache before from_cache), so r_m's 6 GiB still count and x1 is deleted.
    node = one_node(hot("x1", "x", {0: 70}, cpu_gib=8), warm("r_m", "m", 6), cpu_cache_gib=10)
    plan = plan_placements(
        ClusterSnapshot((node,)), [demand("m", 20)], config=CONFIG, rng=random.Random(0), clock=lambda: 0.0
    )
    assert [(e.replica_id, e.to_level) for e in plan.evictions] == [("x1", "COLD")]
    assert [(p.replica_id, p.from_level, p.candidate_level) for p in plan.placements] == [
        ("r_m", "WARM", CandidateLevel.CACHED_AND_FULL)
    ]


def test_unplaced_replicas_lower_the_desired_count() -> None:
    plan = plan_placements(
        ClusterSnapshot((one_node(),)),
        [demand("m", 50, desired=3)],
        config=CONFIG,
        rng=random.Random(0),
        clock=lambda: 0.0,
    )
    assert len(plan.placements) == 1 and len(plan.unplaced) == 2
    assert plan.desired_replicas == {"m": 1}


def test_a_warm_copy_placed_on_another_node_is_deleted_where_it_was() -> None:
    node_a = one_node(warm("r1", "m", 2), hot("d", "x", {0: 75}, protected=True), node_id="a")
    node_b = one_node(node_id="b")
    plan = plan_placements(
        ClusterSnapshot((node_a, node_b)),
        [demand("m", 20)],
        config=CONFIG,
        rng=random.Random(0),
        clock=lambda: 0.0,
    )
    assert [(e.replica_id, e.node_id, e.to_level, e.reason) for e in plan.evictions] == [
        ("r1", "a", "COLD", "moved")
    ]
    assert [(p.replica_id, p.node_id, p.from_level) for p in plan.placements] == [("r1", "b", "COLD")]
    recorded = {"r1": ReplicaLocation("r1", "m", "a", "WARM")}
    delta = build_delta(recorded, get_planned_locations(recorded, plan))
    assert [(op, loc.node_id) for op, loc in delta.steps()] == [("delete", "a"), ("create", "b")]


# --------------------------------------------------------------------------- apply() delta


def loc(replica_id: str, node_id: str, level: str, gpu_gib: dict[int, int] | None = None) -> ReplicaLocation:
    gpu_bytes = {g: b * GiB for g, b in (gpu_gib or {}).items()}
    return ReplicaLocation(replica_id, "m", node_id, level, gpu_bytes)  # type: ignore[arg-type]


def test_delta_lists_each_transition_once() -> None:
    recorded = {
        "keep": loc("keep", "a", "HOT", {0: 10}),
        "park": loc("park", "a", "HOT", {0: 10}),
        "wake": loc("wake", "a", "WARM"),
        "gone": loc("gone", "a", "WARM"),
        "shift": loc("shift", "a", "HOT", {0: 10}),
    }
    planned = {
        "keep": loc("keep", "a", "HOT", {0: 10}),
        "park": loc("park", "a", "WARM"),
        "wake": loc("wake", "a", "HOT", {1: 10}),
        "new": loc("new", "b", "HOT", {0: 10}),
        "shift": loc("shift", "a", "HOT", {1: 10}),
    }
    delta = build_delta(recorded, planned)
    assert [loc.replica_id for loc in delta.to_cache] == ["park", "shift"]
    assert [loc.replica_id for loc in delta.delete] == ["gone"]
    assert [loc.replica_id for loc in delta.from_cache] == ["shift", "wake"]
    assert [loc.replica_id for loc in delta.create] == ["new"]
    assert delta.from_cache[1].gpu_bytes == {1: 10 * GiB}


def test_delta_steps_free_memory_before_taking_it() -> None:
    recorded = {
        "z": loc("z", "a", "WARM"),
        "victim": loc("victim", "a", "HOT", {0: 70}),
        "old": loc("old", "a", "WARM"),
    }
    planned = {
        "z": loc("z", "a", "HOT", {0: 20}),
        "victim": loc("victim", "a", "WARM"),
        "n": loc("n", "a", "HOT", {0: 5}),
    }
    ops = [op for op, _ in build_delta(recorded, planned).steps()]
    assert ops == ["to_cache", "delete", "from_cache", "create"]
    assert build_delta(planned, planned).is_empty


def test_planned_locations_follow_a_plan() -> None:
    recorded = {
        "a": loc("a", "n0", "HOT", {0: 10}),
        "b": loc("b", "n0", "HOT", {1: 10}),
        "c": loc("c", "n0", "WARM"),
    }
    plan = PlacementPlan(
        placements=(
            Placement(
                "m",
                "c",
                "n0",
                {0: 10 * GiB},
                0.125,
                "fractional",
                "WARM",
                CandidateLevel.CACHED_AND_FULL,
                "measured",
                GiB,
                ("a",),
            ),
        ),
        evictions=(
            Eviction("m", "a", "n0", "HOT", "WARM", {0: 10 * GiB}, "pressure"),
            Eviction("m", "b", "n0", "HOT", "COLD", {1: 10 * GiB}, "explicit"),
        ),
    )
    planned = get_planned_locations(recorded, plan)
    assert planned == {"a": loc("a", "n0", "WARM"), "c": loc("c", "n0", "HOT", {0: 10})}
    assert [(op, where.replica_id) for op, where in build_delta(recorded, planned).steps()] == [
        ("to_cache", "a"),
        ("delete", "b"),
        ("from_cache", "c"),
    ]


# --------------------------------------------------------------------------- cold sleep


def test_a_cold_sleep_parks_with_the_process_charge_not_the_weights() -> None:
    # 10 GiB of weights would not fit a 4 GiB cache; the parked process (512 MiB) does.
    p = planner(one_node(hot("x1", "x", {0: 20}, cpu_gib=10), cpu_cache_gib=4), desired={"x": 1})
    assert p.sleep_replica("x", "x1", reason="idle", park=True, drop_weights=True)
    plan = p.finish()
    assert [(e.replica_id, e.to_level, e.drop_weights) for e in plan.evictions] == [("x1", "WARM", True)]


def test_cpu_pressure_ends_a_cold_slept_replica_by_its_process_charge() -> None:
    parked = CONFIG.parked_process_bytes
    node = one_node(hot("x1", "x", {0: 70}, cpu_gib=3), warm("c", "y", 8, parked_bytes=parked),
                    warm("w1", "z", 1), cpu_cache_gib=3)
    p = planner(node)
    p.ensure(demand("m", 20))
    plan = p.finish()
    # 3 GiB of cache, 1.5 GiB held: c (0.5 GiB held) goes first, then w1, to park x1's 3 GiB.
    assert [(e.replica_id, e.to_level, e.reason) for e in plan.evictions] == [
        ("x1", "WARM", "pressure"), ("c", "COLD", "cpu_pressure"), ("w1", "COLD", "cpu_pressure")]


def test_parked_process_bytes_is_validated() -> None:
    import pytest

    assert PlacementConfig().parked_process_bytes == 512 << 20
    with pytest.raises(ValueError, match="parked_process_bytes"):
        PlacementConfig(parked_process_bytes=-1)
