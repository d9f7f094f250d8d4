"""Seed 000's decision tree branch by branch, the per-GPU resources, the memory figure, and
the cluster-level candidate levels of seed 002. Tiny nodes, exact GPU ids and bytes."""

from __future__ import annotations

import random

import pytest

from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.memory_figure import MemoryFigure, UnknownModelMemory, get_memory_figure
from shoal.shared.placement.node_eval import choose_victims, evaluate_node
from shoal.shared.placement.node_state import NodeWork
from shoal.shared.placement.planner import ClusterPlanner
from shoal.shared.placement.resources import GpuResources
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
    replica_id: str,
    model: str,
    gpu_gib: dict[int, int],
    *,
    protected: bool = False,
    last_accessed: float = 0.0,
) -> ReplicaSnapshot:
    return ReplicaSnapshot(
        replica_id, model, "HOT", {g: b * GiB for g, b in gpu_gib.items()}, 1 * GiB, protected, last_accessed
    )


def make_node(
    gpu_gib: list[int],
    *replicas: ReplicaSnapshot,
    node_id: str = "n0",
    pinned_gib: dict[int, int] | None = None,
    cpu_cache_gib: int = 64,
) -> NodeSnapshot:
    return NodeSnapshot(
        node_id,
        {g: b * GiB for g, b in enumerate(gpu_gib)},
        cpu_cache_gib * GiB,
        tuple(replicas),
        {g: b * GiB for g, b in (pinned_gib or {}).items()},
    )


def work(snapshot: NodeSnapshot, tie_keys: dict[int, float] | None = None) -> NodeWork:
    """A working copy whose GPU tie keys rank GPU 0 first unless told otherwise."""
    ties = tie_keys or {g: g / 100 for g in snapshot.gpu_total_bytes}
    return NodeWork(snapshot, CONFIG.min_available_gpu_fraction, ties, 0.5)


def measured(model: str, required_gib: float, *, min_num_gpus: int = 1, desired: int = 1) -> ModelDemand:
    figure = MemoryFigure(int(required_gib * GiB), int(required_gib * GiB / 2), "measured")
    return ModelDemand(model, figure, desired, min_num_gpus=min_num_gpus)


def guessed(model: str, weight_gib: float) -> ModelDemand:
    return ModelDemand(model, get_memory_figure(weight_bytes=int(weight_gib * GiB), config=CONFIG), 1)


# --------------------------------------------------------------------------- decision tree, one node


def test_deployed_when_the_replica_is_already_hot_on_the_node() -> None:
    node = work(make_node([80], hot("r1", "m", {0: 20})))
    offer = evaluate_node(node, measured("m", 20), "r1", CONFIG)
    assert offer.level == CandidateLevel.DEPLOYED
    assert offer.gpu_bytes == {0: 20 * GiB}


def test_fractional_when_required_is_below_the_threshold() -> None:
    offer = evaluate_node(work(make_node([80, 80])), measured("m", 20), "r1", CONFIG)
    assert (offer.level, offer.kind, offer.gpu_bytes) == (CandidateLevel.FREE, "fractional", {0: 20 * GiB})
    assert offer.room_left_bytes == 60 * GiB


def test_full_single_gpu_when_required_reaches_the_threshold() -> None:
    # 64 GiB is exactly 0.8 x 80 GiB: not below the threshold, so the whole GPU.
    offer = evaluate_node(work(make_node([80, 80])), measured("m", 64), "r1", CONFIG)
    assert (offer.level, offer.kind, offer.gpu_bytes) == (CandidateLevel.FREE, "full_gpu", {0: 80 * GiB})


def test_guessed_figure_fits_one_gpu_by_raw_weight_size_and_takes_it_whole() -> None:
    # 30 GiB of weights x 3 = 90 GiB > 80 GiB, but the weights fit: the seed reserves the GPU.
    offer = evaluate_node(work(make_node([80])), guessed("m", 30), "r1", CONFIG)
    assert (offer.level, offer.kind, offer.gpu_bytes) == (CandidateLevel.FREE, "full_gpu", {0: 80 * GiB})


def test_fractional_search_takes_the_gpu_with_no_eviction() -> None:
    node = work(make_node([80, 80], hot("a", "x", {0: 70}), hot("b", "y", {1: 50})))
    offer = evaluate_node(node, measured("m", 20), "r1", CONFIG)
    assert (offer.level, offer.gpu_bytes, offer.eviction_ids) == (CandidateLevel.FREE, {1: 20 * GiB}, ())


def test_fractional_search_prefers_the_best_fit_over_the_emptiest_gpu() -> None:
    node = work(make_node([80, 80, 80], hot("a", "x", {0: 30}), hot("b", "y", {1: 50})))
    offer = evaluate_node(node, measured("m", 20), "r1", CONFIG)
    assert offer.gpu_bytes == {1: 20 * GiB}
    assert offer.room_left_bytes == 10 * GiB


def test_exact_ties_are_broken_by_the_seeded_key_not_the_gpu_index() -> None:
    snapshot = make_node([80, 80])
    assert evaluate_node(work(snapshot, {0: 0.9, 1: 0.1}), measured("m", 20), "r1", CONFIG).gpu_bytes == {
        1: 20 * GiB
    }
    assert evaluate_node(work(snapshot, {0: 0.1, 1: 0.9}), measured("m", 20), "r1", CONFIG).gpu_bytes == {
        0: 20 * GiB
    }


def test_replicas_of_one_model_spread_over_gpus_before_best_fit() -> None:
    node = work(make_node([80, 80], hot("a", "m", {0: 20})))
    offer = evaluate_node(node, measured("m", 20), "r2", CONFIG)
    assert offer.gpu_bytes == {1: 20 * GiB}


def test_fractional_search_takes_the_gpu_needing_the_fewest_evictions() -> None:
    two_needed = [hot("a", "x", {0: 25}), hot("b", "y", {0: 25}), hot("d", "w", {0: 25})]
    node = work(make_node([80, 80], *two_needed, hot("c", "z", {1: 70})))
    offer = evaluate_node(node, measured("m", 40), "r1", CONFIG)
    assert (offer.level, offer.gpu_bytes, offer.eviction_ids) == (CandidateLevel.FULL, {1: 40 * GiB}, ("c",))
    assert offer.room_left_bytes == 40 * GiB


def test_victims_are_the_smallest_that_still_cover_the_deficit() -> None:
    node = work(make_node([80], hot("a", "x", {0: 10}), hot("b", "y", {0: 30}), hot("c", "z", {0: 35})))
    victims = choose_victims(node.get_evictable_on_gpu(0, "m"), 0, 30 * GiB)
    assert [v.replica_id for v in victims or []] == ["b"]
    victims = choose_victims(node.get_evictable_on_gpu(0, "m"), 0, 40 * GiB)
    assert sorted(v.replica_id for v in victims or []) == ["a", "b"]
    assert choose_victims(node.get_evictable_on_gpu(0, "m"), 0, 76 * GiB) is None


def test_equal_victims_go_least_recently_used_first() -> None:
    node = work(
        make_node([80], hot("a", "x", {0: 30}, last_accessed=9.0), hot("b", "y", {0: 30}, last_accessed=1.0))
    )
    offer = evaluate_node(node, measured("m", 40), "r1", CONFIG)
    assert offer.eviction_ids == ("b",)


def test_protected_replicas_are_never_evicted() -> None:
    node = work(make_node([80], hot("a", "x", {0: 70}, protected=True)))
    assert evaluate_node(node, measured("m", 20), "r1", CONFIG).level == CandidateLevel.CANT_ACCOMMODATE


def test_replicas_of_the_same_model_are_never_evicted_for_it() -> None:
    node = work(make_node([80], hot("a", "m", {0: 70})))
    assert evaluate_node(node, measured("m", 20), "r2", CONFIG).level == CandidateLevel.CANT_ACCOMMODATE


def test_pinned_bytes_block_a_whole_gpu_placement() -> None:
    node = work(make_node([80], hot("a", "x", {0: 10}), pinned_gib={0: 1}))
    assert evaluate_node(node, measured("m", 70), "r1", CONFIG).level == CandidateLevel.CANT_ACCOMMODATE


def test_single_gpu_search_falls_through_to_multi_gpu() -> None:
    # Only GPU 0 is big enough for 30 GiB alone, and a protected replica holds it.
    node = work(make_node([40, 24, 24], hot("a", "x", {0: 20}, protected=True)))
    offer = evaluate_node(node, measured("m", 30), "r1", CONFIG)
    assert (offer.level, offer.kind, offer.gpu_bytes) == (
        CandidateLevel.FREE,
        "multi_gpu",
        {1: 24 * GiB, 2: 24 * GiB},
    )


def test_multi_gpu_with_a_real_figure_takes_exactly_the_gpus_it_needs() -> None:
    offer = evaluate_node(work(make_node([80] * 4)), measured("m", 100), "r1", CONFIG)
    assert (offer.level, offer.kind, offer.gpu_bytes) == (
        CandidateLevel.FREE,
        "multi_gpu",
        {0: 80 * GiB, 1: 80 * GiB},
    )


def test_multi_gpu_with_a_guessed_figure_takes_one_extra_gpu() -> None:
    offer = evaluate_node(work(make_node([80] * 4)), guessed("m", 100), "r1", CONFIG)
    assert offer.gpu_bytes == {0: 80 * GiB, 1: 80 * GiB, 2: 80 * GiB}


def test_min_num_gpus_forces_whole_gpus() -> None:
    offer = evaluate_node(work(make_node([80] * 4)), measured("m", 10, min_num_gpus=2), "r1", CONFIG)
    assert (offer.kind, offer.gpu_bytes) == ("multi_gpu", {0: 80 * GiB, 1: 80 * GiB})


def test_multi_gpu_evicts_from_the_gpus_with_the_fewest_replicas() -> None:
    node = work(make_node([80] * 3, hot("a", "x", {0: 10}), hot("b", "y", {0: 10}), hot("c", "z", {1: 10})))
    offer = evaluate_node(node, measured("m", 100), "r1", CONFIG)
    assert (offer.level, offer.gpu_bytes, offer.eviction_ids) == (
        CandidateLevel.FULL,
        {2: 80 * GiB, 1: 80 * GiB},
        ("c",),
    )


def test_multi_gpu_cannot_use_a_gpu_with_a_protected_replica() -> None:
    node = work(make_node([80] * 2, hot("a", "x", {1: 10}, protected=True)))
    assert evaluate_node(node, measured("m", 100), "r1", CONFIG).level == CandidateLevel.CANT_ACCOMMODATE


def test_cant_accommodate_a_model_larger_than_the_node() -> None:
    assert evaluate_node(work(make_node([80] * 2)), measured("m", 200), "r1", CONFIG).level == (
        CandidateLevel.CANT_ACCOMMODATE
    )


def test_no_eviction_beats_eviction_across_shapes() -> None:
    # Single GPU: only the 80 GiB GPU takes 30 GiB of weights, after evicting "a".
    # Multi-GPU (guess: 30 GiB over 24 GiB GPUs = 2, +1): three free 24 GiB GPUs, no eviction.
    node = work(make_node([80, 24, 24, 24], hot("a", "x", {0: 10})))
    offer = evaluate_node(node, guessed("m", 30), "r1", CONFIG)
    assert (offer.level, offer.kind, offer.eviction_ids) == (CandidateLevel.FREE, "multi_gpu", ())
    assert offer.gpu_bytes == {1: 24 * GiB, 2: 24 * GiB, 3: 24 * GiB}


def test_an_over_committed_gpu_has_no_room_until_evictions_cover_the_excess() -> None:
    # GPU 0 records 60 GiB of occupants on 40 GiB (its node re-registered with smaller
    # GPUs): 20 GiB below empty. Evicting "a" (30 GiB) leaves exactly 10 GiB.
    node = work(make_node([40, 80], hot("a", "x", {0: 30}), hot("b", "y", {0: 30}), hot("c", "z", {1: 75})))
    assert node.gpus.available_bytes_by_gpu == {0: -20 * GiB, 1: 5 * GiB}
    offer = evaluate_node(node, measured("m", 10), "r1", CONFIG)
    assert (offer.level, offer.gpu_bytes, offer.eviction_ids, offer.room_left_bytes) == (
        CandidateLevel.FULL,
        {0: 10 * GiB},
        ("a",),
        0,
    )
    assert evaluate_node(node, measured("m", 5), "r1", CONFIG).gpu_bytes == {1: 5 * GiB}  # room on GPU 1


def test_an_over_committed_gpu_never_gives_up_a_protected_replica() -> None:
    # 40 GiB protected + 30 GiB on 40 GiB: evicting "a" still leaves the GPU 30 GiB over.
    node = work(make_node([40], hot("d", "x", {0: 40}, protected=True), hot("a", "y", {0: 30})))
    assert evaluate_node(node, measured("m", 1), "r1", CONFIG).level == CandidateLevel.CANT_ACCOMMODATE
    plan = planner(make_node([40], hot("d", "x", {0: 40}, protected=True), hot("a", "y", {0: 30})))
    assert plan.get_candidate(measured("m", 1), "r1").level == CandidateLevel.CANT_ACCOMMODATE


def test_the_planner_counts_the_excess_of_an_over_committed_gpu_in_its_evictions() -> None:
    over = make_node([40], hot("d", "x", {0: 30}, protected=True), hot("a", "y", {0: 30}), node_id="a")
    full = make_node([40], hot("b", "z", {0: 39}), node_id="b")
    cluster_planner = planner(over, full)
    assert cluster_planner.get_gpu_room("a", 0) == (-20 * GiB, (30 * GiB,))
    # 2 GiB fits nowhere. Evicting "a" leaves 8 GiB on node a, evicting "b" 38 GiB: best fit.
    offer = cluster_planner.place_replica(measured("m", 2), "r1")
    assert (offer.node_id, offer.eviction_ids, offer.room_left_bytes) == ("a", ("a",), 8 * GiB)
    assert cluster_planner.get_gpu_room("a", 0) == (8 * GiB, ())  # r1 is locked, d is protected
    offer = cluster_planner.place_replica(measured("m", 10), "r2")
    assert (offer.node_id, offer.eviction_ids, offer.room_left_bytes) == ("b", ("b",), 30 * GiB)


# --------------------------------------------------------------------------- cluster levels


def planner(*nodes: NodeSnapshot) -> ClusterPlanner:
    return ClusterPlanner(ClusterSnapshot(nodes), config=CONFIG, rng=random.Random(0), clock=lambda: 0.0)


def warm(replica_id: str, model: str, cpu_gib: int = 1) -> ReplicaSnapshot:
    return ReplicaSnapshot(replica_id, model, "WARM", {}, cpu_gib * GiB)


def test_cluster_level_deployed() -> None:
    offer = planner(make_node([80], hot("r1", "m", {0: 20}))).get_candidate(measured("m", 20), "r1")
    assert offer.level == CandidateLevel.DEPLOYED


def test_cached_and_free_beats_a_better_fit_elsewhere() -> None:
    cached_node = make_node([80], warm("r1", "m"), node_id="a")
    tight_node = make_node([80], hot("x1", "x", {0: 55}), node_id="b")
    offer = planner(cached_node, tight_node).get_candidate(measured("m", 20), "r1")
    assert (offer.level, offer.node_id) == (CandidateLevel.CACHED_AND_FREE, "a")


def test_free_elsewhere_beats_cached_and_full() -> None:
    cached_node = make_node([80], warm("r1", "m"), hot("x1", "x", {0: 70}), node_id="a")
    offer = planner(cached_node, make_node([80], node_id="b")).get_candidate(measured("m", 20), "r1")
    assert (offer.level, offer.node_id) == (CandidateLevel.FREE, "b")


def test_cached_and_full_beats_full_elsewhere() -> None:
    cached_node = make_node([80], warm("r1", "m"), hot("x1", "x", {0: 70}), node_id="a")
    other_node = make_node([80], hot("y1", "y", {0: 75}), node_id="b")
    offer = planner(cached_node, other_node).get_candidate(measured("m", 20), "r1")
    assert (offer.level, offer.node_id, offer.eviction_ids) == (CandidateLevel.CACHED_AND_FULL, "a", ("x1",))


def test_full_takes_the_node_needing_the_fewest_evictions() -> None:
    node_a = make_node(
        [80], hot("a1", "x", {0: 30}), hot("a2", "y", {0: 30}), hot("a3", "w", {0: 15}), node_id="a"
    )
    node_b = make_node([80], hot("b1", "z", {0: 75}), node_id="b")
    offer = planner(node_a, node_b).get_candidate(measured("m", 40), "r1")
    assert (offer.level, offer.node_id, offer.eviction_ids) == (CandidateLevel.FULL, "b", ("b1",))


def test_cluster_best_fit_across_nodes() -> None:
    node_a = make_node([80], hot("a1", "x", {0: 10}), node_id="a")
    node_b = make_node([80], hot("b1", "y", {0: 50}), node_id="b")
    offer = planner(node_a, node_b).get_candidate(measured("m", 20), "r1")
    assert (offer.node_id, offer.gpu_bytes, offer.room_left_bytes) == ("b", {0: 20 * GiB}, 10 * GiB)


def test_cluster_cant_accommodate() -> None:
    offer = planner(make_node([80], hot("a1", "x", {0: 70}, protected=True))).get_candidate(
        measured("m", 20), "r1"
    )
    assert offer.level == CandidateLevel.CANT_ACCOMMODATE


# --------------------------------------------------------------------------- resources


def test_a_protected_warm_replica_promoted_and_demoted_in_one_plan_stays_protected() -> None:
    """Found by the property test: m0's protected WARM copy is promoted (desired 1), then m0
    is evicted back to WARM, then m1's demotion needs the CPU cache that copy fills. It was
    dropped for room, having lost its protection on the way up: m1's copy goes COLD instead."""
    warm = ReplicaSnapshot("r-m0", "m0", "WARM", {}, 1 * GiB, True)
    node = make_node([16], hot("r-m1", "m1", {0: 1}, protected=True), warm, cpu_cache_gib=1)
    planner = ClusterPlanner(ClusterSnapshot((node,)), config=CONFIG, rng=random.Random(0), clock=lambda: 0.0)
    planner.ensure(measured("m0", 3))
    planner.evict_model("m0")
    planner.evict_model("m1")
    plan = planner.finish()
    assert [(e.replica_id, e.from_level, e.to_level, e.reason) for e in plan.evictions] == [
        ("r-m1", "HOT", "COLD", "explicit")
    ]


def test_evicting_a_replica_still_loading_stops_it_instead_of_parking_it() -> None:
    """A replica whose worker has not loaded the model has nothing to park: its eviction (an
    operator's, or Ollama's ``keep_alive: 0``) deletes it, while a serving one is parked WARM."""
    loading = ReplicaSnapshot("r-new", "m0", "HOT", {0: 1 * GiB}, 1 * GiB, loaded=False)
    node = make_node([16], loading, hot("r-old", "m1", {0: 1}), cpu_cache_gib=8)
    planner = ClusterPlanner(ClusterSnapshot((node,)), config=CONFIG, rng=random.Random(0), clock=lambda: 0.0)
    planner.evict_model("m0")
    planner.evict_model("m1")
    plan = planner.finish()
    assert [(e.replica_id, e.from_level, e.to_level) for e in plan.evictions] == [
        ("r-new", "HOT", "COLD"), ("r-old", "HOT", "WARM")]


def test_a_warm_replica_moved_then_parked_on_another_node_leaves_its_first_node() -> None:
    """Found by the property test: m0's WARM copy on n1 is placed on n2 (n1's GPU is too
    small), then parked there; m1's demotion on n1 takes the CPU cache it left. The plan must
    not say the copy stayed WARM where it was (n1 would hold both): it is dropped there."""
    warm = ReplicaSnapshot("r-m0", "m0", "WARM", {}, 1 * GiB, True)
    first = make_node([8], hot("r-m1", "m1", {0: 1}, protected=True), warm, node_id="n1", cpu_cache_gib=1)
    other = make_node([16], node_id="n2", cpu_cache_gib=1)
    planner = ClusterPlanner(ClusterSnapshot((first, other)), config=CONFIG, rng=random.Random(0),
                             clock=lambda: 0.0)
    planner.ensure(measured("m0", 12))
    planner.evict_model("m0")
    planner.evict_model("m1")
    plan = planner.finish()
    assert plan.placements == ()
    assert [(e.replica_id, e.node_id, e.from_level, e.to_level) for e in plan.evictions] == [
        ("r-m0", "n1", "WARM", "COLD"),
        ("r-m1", "n1", "HOT", "WARM"),
    ]


def test_available_set_follows_the_min_available_gpu_fraction() -> None:
    gpus = GpuResources({0: 100, 1: 100}, {0: 71, 1: 70}, min_available_gpu_fraction=0.3)
    assert gpus.available_gpu_ids == {1}
    assert gpus.try_assign_memory(1, gpu_id=1) == 1
    assert gpus.available_gpu_ids == set()
    gpus.release({0: 71})
    assert gpus.available_gpu_ids == {0}
    assert gpus.available_bytes_by_gpu == {0: 100, 1: 29}


def test_assign_memory_to_a_given_gpu_or_to_the_roomiest_available_one() -> None:
    gpus = GpuResources({0: 100, 1: 100, 2: 100}, {0: 10, 1: 40, 2: 75}, min_available_gpu_fraction=0.3)
    assert gpus.try_assign_memory(20, gpu_id=2) == 2
    assert gpus.try_assign_memory(20) == 0
    assert gpus.try_assign_memory(90) is None
    assert gpus.try_assign_memory(10, gpu_id=2) is None
    assert gpus.available_bytes_by_gpu == {0: 70, 1: 60, 2: 5}


def test_assign_whole_gpus_is_all_or_nothing() -> None:
    gpus = GpuResources({0: 100, 1: 100}, {1: 1}, min_available_gpu_fraction=0.3)
    assert not gpus.try_assign_whole_gpus([0, 1])
    assert gpus.available_bytes_by_gpu == {0: 100, 1: 99}
    assert gpus.try_assign_whole_gpus([0])
    assert gpus.available_bytes_by_gpu == {0: 0, 1: 99}
    assert gpus.available_gpu_ids == {1}


def test_giving_back_more_than_was_taken_is_a_bug() -> None:
    gpus = GpuResources({0: 100}, {0: 10}, min_available_gpu_fraction=0.3)
    with pytest.raises(AssertionError, match="frees more than the GPU has"):
        gpus.release({0: 11})


# --------------------------------------------------------------------------- memory figure and config


@pytest.mark.parametrize(
    ("measured_bytes", "override_bytes", "estimated_bytes", "expected"),
    [
        (700, 500, 300, (700, "measured")),
        (None, 500, 300, (500, "override")),
        (None, None, 300, (300, "estimate")),
        (None, None, None, (300, "factor")),
        (0, None, None, (300, "factor")),
    ],
)
def test_memory_figure_precedence(
    measured_bytes: int | None,
    override_bytes: int | None,
    estimated_bytes: int | None,
    expected: tuple[int, str],
) -> None:
    figure = get_memory_figure(
        weight_bytes=100,
        config=CONFIG,
        measured_bytes=measured_bytes,
        override_bytes=override_bytes,
        estimated_bytes=estimated_bytes,
    )
    assert (figure.required_bytes, figure.source) == expected
    assert figure.weight_bytes == 100


def test_the_factor_is_configurable_and_needs_a_weight_size() -> None:
    assert (
        get_memory_figure(weight_bytes=100, config=PlacementConfig(gpu_fraction_factor=1.5)).required_bytes
        == 150
    )
    with pytest.raises(UnknownModelMemory):
        get_memory_figure(weight_bytes=0, config=CONFIG)


@pytest.mark.parametrize(
    "bad",
    [
        {"gpu_fraction_factor": 0.5},
        {"fraction_threshold": 0.0},
        {"fraction_threshold": 1.2},
        {"min_available_gpu_fraction": -0.1},
        {"unknown_extra_gpus": -1},
        {"min_gpu_memory_fraction": 0.5, "max_gpu_memory_fraction": 0.4},
        {"warm_cache_fraction": 2.0},
    ],
)
def test_config_rejects_bad_values(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PlacementConfig(**bad)  # type: ignore[arg-type]
