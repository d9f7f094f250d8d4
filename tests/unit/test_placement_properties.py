"""Invariants of the placement policy over random clusters (1-6 nodes x 1-8 GPUs of mixed
sizes, HOT / WARM / dedicated / multi-GPU replicas, pinned bytes) and random model mixes."""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.shared.policy.cluster_state import (
    CandidateLevel,
    ClusterSnapshot,
    ModelDemand,
    NodeSnapshot,
    ReplicaSnapshot,
)
from shoal.shared.policy.memory_figure import MemoryFigure, get_memory_figure
from shoal.shared.policy.node_eval import choose_victims
from shoal.shared.policy.node_state import WorkReplica
from shoal.shared.policy.placement import ClusterPlanner, plan_placements
from shoal.shared.policy.placement_config import PlacementConfig
from shoal.shared.policy.placement_plan import PlacementPlan

GiB = 1 << 30
GPU_GIB = (16, 24, 40, 80)
MODELS = tuple(f"m{i}" for i in range(6))
CONFIG = PlacementConfig()


def clock() -> float:
    return 1000.0


@st.composite
def clusters(draw: st.DrawFn) -> ClusterSnapshot:
    ids: Iterator[int] = iter(range(10_000))
    nodes = []
    for node_index in range(draw(st.integers(1, 6))):
        gpu_gib = draw(st.lists(st.sampled_from(GPU_GIB), min_size=1, max_size=8))
        replicas: list[ReplicaSnapshot] = []
        pinned: dict[int, int] = {}
        empty_gpus = []
        for gpu_id, total_gib in enumerate(gpu_gib):
            free_gib = total_gib
            for _ in range(draw(st.integers(0, 3))):
                if free_gib == 0:
                    break
                num_gib = draw(st.integers(1, free_gib))
                free_gib -= num_gib
                replicas.append(
                    ReplicaSnapshot(
                        replica_id=f"r{next(ids)}",
                        model=draw(st.sampled_from(MODELS)),
                        level="HOT",
                        gpu_bytes={gpu_id: num_gib * GiB},
                        cpu_bytes=draw(st.integers(1, 8)) * GiB,
                        dedicated=draw(st.integers(0, 4)) == 0,
                        last_accessed=draw(st.integers(0, 100)),
                    )
                )
            if free_gib and draw(st.integers(0, 5)) == 0:
                pinned[gpu_id] = draw(st.integers(1, free_gib)) * GiB
            elif free_gib == total_gib:
                empty_gpus.append(gpu_id)
        if len(empty_gpus) >= 2 and draw(st.booleans()):
            pair = empty_gpus[:2]
            replicas.append(
                ReplicaSnapshot(
                    f"r{next(ids)}",
                    draw(st.sampled_from(MODELS)),
                    "HOT",
                    {g: gpu_gib[g] * GiB for g in pair},
                    8 * GiB,
                    dedicated=draw(st.booleans()),
                )
            )
        cpu_cache_gib = draw(st.integers(0, 48))
        used_gib = 0
        for _ in range(draw(st.integers(0, 3))):
            num_gib = draw(st.integers(1, 8))
            if used_gib + num_gib <= cpu_cache_gib:
                used_gib += num_gib
                replicas.append(
                    ReplicaSnapshot(
                        f"r{next(ids)}",
                        draw(st.sampled_from(MODELS)),
                        "WARM",
                        cpu_bytes=num_gib * GiB,
                        dedicated=draw(st.integers(0, 4)) == 0,
                        last_accessed=draw(st.integers(0, 100)),
                    )
                )
        nodes.append(
            NodeSnapshot(
                f"node{node_index}",
                {g: b * GiB for g, b in enumerate(gpu_gib)},
                cpu_cache_gib * GiB,
                tuple(replicas),
                pinned,
            )
        )
    desired = {m: draw(st.integers(0, 3)) for m in MODELS}
    return ClusterSnapshot(tuple(nodes), desired)


@st.composite
def demands(draw: st.DrawFn) -> list[ModelDemand]:
    result = []
    for model in draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=4, unique=True)):
        if draw(st.booleans()):
            required_gib = draw(st.integers(1, 200))
            figure = MemoryFigure(required_gib * GiB, max(1, required_gib // 2) * GiB, "measured")
        else:
            figure = get_memory_figure(weight_bytes=draw(st.integers(1, 60)) * GiB, config=CONFIG)
        result.append(
            ModelDemand(
                model,
                figure,
                desired_replicas=draw(st.integers(0, 4)),
                dedicated=draw(st.integers(0, 4)) == 0,
                min_num_gpus=draw(st.sampled_from((1, 1, 1, 2))),
            )
        )
    return result


def assert_plan_is_safe(cluster: ClusterSnapshot, plan: PlacementPlan) -> None:
    """No GPU or CPU cache over-committed, no dedicated replica evicted, each replica once."""
    known = {r.replica_id: r for node in cluster.nodes for r in node.replicas}
    nodes = {node.node_id: node for node in cluster.nodes}
    reserved = {
        (node.node_id, g): node.pinned_gpu_bytes.get(g, 0) + sum(r.gpu_bytes.get(g, 0) for r in node.replicas)
        for node in cluster.nodes
        for g in node.gpu_total_bytes
    }
    cpu_used = {
        node.node_id: sum(r.cpu_bytes for r in node.replicas if r.level == "WARM") for node in cluster.nodes
    }
    for eviction in plan.evictions:
        replica = known[eviction.replica_id]
        if eviction.reason in ("pressure", "cpu_pressure"):
            assert not replica.dedicated, f"dedicated {eviction.replica_id} evicted by {eviction.reason}"
        for g, num_bytes in eviction.freed_gpu_bytes.items():
            reserved[(eviction.node_id, g)] -= num_bytes
        if eviction.from_level == "WARM":
            cpu_used[eviction.node_id] -= replica.cpu_bytes
        if eviction.to_level == "WARM":
            cpu_used[eviction.node_id] += replica.cpu_bytes
    placed_ids = [p.replica_id for p in plan.placements]
    assert len(placed_ids) == len(set(placed_ids)), "a replica is placed once per plan"
    for placement in plan.placements:
        for g, num_bytes in placement.gpu_bytes.items():
            reserved[(placement.node_id, g)] += num_bytes
        if placement.from_level == "WARM":
            cpu_used[placement.node_id] -= known[placement.replica_id].cpu_bytes
        if placement.kind == "multi_gpu":
            assert placement.gpu_memory_fraction is None
        else:
            assert placement.gpu_memory_fraction is not None
            assert 0.01 <= placement.gpu_memory_fraction <= 0.99
    for (node_id, g), num_bytes in reserved.items():
        assert 0 <= num_bytes <= nodes[node_id].gpu_total_bytes[g], f"{node_id} GPU {g} over-committed"
    for node_id, num_bytes in cpu_used.items():
        assert 0 <= num_bytes <= nodes[node_id].cpu_cache_bytes, f"{node_id} CPU cache over-committed"


@settings(max_examples=150, deadline=None)
@given(cluster=clusters(), model_mix=demands(), seed=st.integers(0, 2**32 - 1))
def test_plans_never_over_commit_and_never_evict_dedicated(
    cluster: ClusterSnapshot, model_mix: list[ModelDemand], seed: int
) -> None:
    before = copy.deepcopy(cluster)
    plan = plan_placements(cluster, model_mix, config=CONFIG, rng=random.Random(seed), clock=clock)
    assert cluster == before, "the policy never mutates its input"
    assert_plan_is_safe(cluster, plan)


@settings(max_examples=100, deadline=None)
@given(cluster=clusters(), model_mix=demands(), seed=st.integers(0, 2**32 - 1))
def test_same_seed_same_plan(cluster: ClusterSnapshot, model_mix: list[ModelDemand], seed: int) -> None:
    first = plan_placements(cluster, model_mix, config=CONFIG, rng=random.Random(seed), clock=clock)
    second = plan_placements(cluster, model_mix, config=CONFIG, rng=random.Random(seed), clock=clock)
    assert first == second


@settings(max_examples=150, deadline=None)
@given(cluster=clusters(), model_mix=demands(), seed=st.integers(0, 2**32 - 1))
def test_every_choice_is_the_best_node_offer_and_never_evicts_when_it_need_not(
    cluster: ClusterSnapshot, model_mix: list[ModelDemand], seed: int
) -> None:
    """Step by step: the indexed cluster choice equals the best of every node's own decision
    tree, so a replica that fits somewhere without evictions is never given evictions."""
    planner = ClusterPlanner(cluster, config=CONFIG, rng=random.Random(seed), clock=clock)
    for demand in model_mix:
        for number in range(demand.desired_replicas):
            replica_id = f"{demand.model}-new-{number}"
            offers = planner.get_node_candidates(demand, replica_id)
            best_offer = min(offers, key=lambda o: o.sort_key)
            chosen = planner.get_candidate(demand, replica_id)
            assert chosen.sort_key == best_offer.sort_key
            if best_offer.level == CandidateLevel.FREE:
                assert chosen.level == CandidateLevel.FREE and chosen.eviction_ids == ()
            assert planner.place_replica(demand, replica_id).sort_key == chosen.sort_key
    assert_plan_is_safe(cluster, planner.finish())


@settings(max_examples=100, deadline=None)
@given(cluster=clusters(), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_any_sequence_of_operations_stays_safe(
    cluster: ClusterSnapshot, data: st.DataObject, seed: int
) -> None:
    planner = ClusterPlanner(cluster, config=CONFIG, rng=random.Random(seed), clock=clock)
    known_ids = sorted(r.replica_id for node in cluster.nodes for r in node.replicas)
    for _ in range(data.draw(st.integers(1, 6))):
        operation = data.draw(st.sampled_from(("ensure", "scale_down", "evict_model", "evict_replica")))
        model = data.draw(st.sampled_from(MODELS))
        if operation == "ensure":
            for demand in data.draw(demands()):
                planner.ensure(demand)
        elif operation == "scale_down":
            planner.scale_down(model, data.draw(st.integers(0, 3)))
        elif operation == "evict_model":
            planner.evict_model(model)
        elif known_ids:
            planner.evict_replica(model, data.draw(st.sampled_from(known_ids)))
    plan = planner.finish()
    assert_plan_is_safe(cluster, plan)
    assert all(count >= 0 for count in plan.desired_replicas.values())


@settings(max_examples=100, deadline=None)
@given(
    num_nodes=st.integers(1, 6),
    num_gpus=st.integers(1, 8),
    required_gib=st.lists(st.integers(1, 16), min_size=1, max_size=6),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_desired_counts_are_met_when_capacity_allows(
    num_nodes: int, num_gpus: int, required_gib: list[int], data: st.DataObject, seed: int
) -> None:
    # Replicas of at most 16 GiB on 80 GiB GPUs, at most 4 per GPU in all: any GPU that
    # cannot take the next one is more than 64 GiB full, so all of them always fit.
    cluster = ClusterSnapshot(
        tuple(NodeSnapshot(f"n{i}", dict.fromkeys(range(num_gpus), 80 * GiB)) for i in range(num_nodes))
    )
    budget = 4 * num_nodes * num_gpus
    model_mix = []
    for index, gib in enumerate(required_gib):
        desired = data.draw(st.integers(0, max(0, min(5, budget))))
        budget -= desired
        model_mix.append(
            ModelDemand(f"m{index}", MemoryFigure(gib * GiB, gib * GiB // 2, "measured"), desired)
        )
    plan = plan_placements(cluster, model_mix, config=CONFIG, rng=random.Random(seed), clock=clock)
    assert plan.unplaced == () and plan.evictions == ()
    for demand in model_mix:
        assert len(plan.get_placed_ids(demand.model)) == demand.desired_replicas


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=0, max_size=7), deficit=st.integers(1, 120))
def test_victims_are_as_few_as_possible_and_cover_the_deficit(sizes: list[int], deficit: int) -> None:
    evictable = [WorkReplica(f"r{i}", f"m{i}", "n0", "HOT", {0: b}) for i, b in enumerate(sizes)]
    victims = choose_victims(evictable, 0, deficit)
    covering = [
        n for n in range(len(sizes) + 1) if any(sum(c) >= deficit for c in itertools.combinations(sizes, n))
    ]
    if not covering:
        assert victims is None
        return
    assert victims is not None
    assert len(victims) == covering[0]
    assert sum(v.gpu_bytes[0] for v in victims) >= deficit
    assert len({v.replica_id for v in victims}) == len(victims)
