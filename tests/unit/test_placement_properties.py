"""Invariants of the placement policy over random clusters (1-6 nodes x 1-8 GPUs of mixed
sizes, HOT / WARM / protected / multi-GPU replicas, pinned bytes) and random model mixes,
and of the indexes that answer for the whole cluster (`gpu_index`, `cluster_index`)."""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.gpu_index import EvictionFit, GpuSlots, ReclaimIndex
from shoal.shared.placement.memory_figure import MemoryFigure, get_memory_figure
from shoal.shared.placement.node_eval import choose_victims, get_victim_totals, pick_victims
from shoal.shared.placement.node_state import WorkReplica
from shoal.shared.placement.plan import PlacementPlan
from shoal.shared.placement.planner import ClusterPlanner, plan_placements
from shoal.shared.placement.snapshot import (
    CandidateLevel,
    ClusterSnapshot,
    ModelDemand,
    NodeSnapshot,
    ReplicaSnapshot,
)

GiB = 1 << 30
GPU_GIB = (16, 24, 40, 80)
MODELS = tuple(f"m{i}" for i in range(6))
CONFIG = PlacementConfig()


def clock() -> float:
    return 1000.0


@st.composite
def clusters(draw: st.DrawFn, *, uniform: bool = False, over_commit: bool = False) -> ClusterSnapshot:
    """Random clusters. `uniform`: every node's GPUs of one size (the clearing index's
    case); `over_commit`: some GPUs' totals shrunk below what they hold (a node
    re-registered with smaller GPUs)."""
    ids: Iterator[int] = iter(range(10_000))
    nodes = []
    for node_index in range(draw(st.integers(1, 6))):
        if uniform:
            gpu_gib = [draw(st.sampled_from(GPU_GIB))] * draw(st.integers(1, 8))
        else:
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
                        protected=draw(st.integers(0, 4)) == 0,
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
                    protected=draw(st.booleans()),
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
                        protected=draw(st.integers(0, 4)) == 0,
                        last_accessed=draw(st.integers(0, 100)),
                    )
                )
        totals_gib = list(gpu_gib)
        if over_commit:
            for gpu_id in range(len(gpu_gib)):
                held_gib = (
                    pinned.get(gpu_id, 0) // GiB + sum(r.gpu_bytes.get(gpu_id, 0) for r in replicas) // GiB
                )
                if held_gib >= 2 and draw(st.booleans()):
                    totals_gib[gpu_id] = draw(st.integers(1, held_gib - 1))
        nodes.append(
            NodeSnapshot(
                f"node{node_index}",
                {g: b * GiB for g, b in enumerate(totals_gib)},
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
                popular=draw(st.integers(0, 4)) == 0,
                min_num_gpus=draw(st.sampled_from((1, 1, 1, 2))),
            )
        )
    return result


def assert_plan_is_safe(cluster: ClusterSnapshot, plan: PlacementPlan) -> None:
    """No GPU or CPU cache over-committed, no protected replica evicted, each replica once."""
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
            assert not replica.protected, f"protected {eviction.replica_id} evicted by {eviction.reason}"
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
def test_plans_never_over_commit_and_never_evict_protected(
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


# --------------------------------------------------------------------------- the indexes


def reference_victims(sizes: list[int], deficit: int) -> list[int] | None:
    """The victim rule spelled out slot by slot (the seed-style loop `pick_victims` must
    match): the fewest sizes that cover `deficit`; with that count fixed, each slot takes
    the smallest size that still lets the remaining slots cover what is left."""
    ascending = sorted(sizes)
    covered = num_victims = 0
    for num_bytes in reversed(ascending):
        if covered >= deficit:
            break
        covered += num_bytes
        num_victims += 1
    if covered < deficit:
        return None
    victims: list[int] = []
    still_needed = deficit
    for slot in range(num_victims):
        num_after = num_victims - slot - 1
        for position, num_bytes in enumerate(ascending):
            others = ascending[:position] + ascending[position + 1 :]
            best_after = sum(others[len(others) - num_after :]) if num_after else 0
            if num_bytes + best_after >= still_needed:
                victims.append(ascending.pop(position))
                still_needed -= num_bytes
                break
    return victims


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 30), max_size=8), deficit=st.integers(1, 150))
def test_pick_victims_follows_the_slot_by_slot_rule(sizes: list[int], deficit: int) -> None:
    ascending = sorted(sizes)
    positions = pick_victims(ascending, deficit)
    expected = reference_victims(ascending, deficit)
    assert (None if positions is None else sorted(ascending[p] for p in positions)) == (
        None if expected is None else sorted(expected)
    )


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 30), min_size=1, max_size=8))
def test_victim_totals_give_the_room_left_for_every_deficit(sizes: list[int]) -> None:
    """What the eviction index relies on: with k victims, the bytes freed for a deficit
    are the smallest of `get_victim_totals(sizes, k)` that covers it."""
    ascending = sorted(sizes)
    for deficit in range(1, sum(ascending) + 1):
        positions = pick_victims(ascending, deficit)
        assert positions is not None
        totals = get_victim_totals(ascending, len(positions))
        assert sum(ascending[p] for p in positions) == min(t for t in totals if t >= deficit)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_reclaim_index_answers_like_a_scan_of_every_gpu_after_any_updates(
    data: st.DataObject, seed: int
) -> None:
    """Small integer bytes, so exact ties in room are frequent and the tie key decides."""
    rng = random.Random(seed)
    sizes_by_node = data.draw(
        st.lists(st.lists(st.sampled_from((40, 80)), min_size=1, max_size=4), max_size=5)
    )
    ties = [{g: rng.choice((0.25, 0.5, 0.75)) for g in range(len(n))} for n in sizes_by_node]
    slots = GpuSlots(ties, [dict(enumerate(n)) for n in sizes_by_node])
    room_strategy = st.tuples(st.integers(-20, 40), st.lists(st.integers(1, 30), max_size=5))
    drawn = [data.draw(room_strategy) for _ in range(len(slots))]
    rooms = [(available, tuple(sorted(sizes))) for available, sizes in drawn]
    index = ReclaimIndex(slots, [r[0] for r in rooms], [r[1] for r in rooms])
    for _ in range(data.draw(st.integers(1, 12))):
        if len(slots) and data.draw(st.booleans()):
            slot = data.draw(st.integers(0, len(slots) - 1))
            available, sizes = data.draw(room_strategy)
            rooms[slot] = (available, tuple(sorted(sizes)))
            index.set_room(slot, *rooms[slot])
            continue
        # Precondition of the query: no GPU has room without evictions.
        floor = max((r[0] for r in rooms), default=0) + 1
        allocs = {
            40: data.draw(st.integers(floor, floor + 60)),
            80: data.draw(st.integers(floor, floor + 90)),
        }
        excluded = set(data.draw(st.lists(st.integers(0, max(0, len(slots) - 1)), max_size=2)))
        scan: list[EvictionFit] = []
        for slot, (available, evictable) in enumerate(rooms):
            alloc = allocs[slots.total_bytes[slot]]
            victims = reference_victims(list(evictable), alloc - available)
            if slot not in excluded and victims is not None:
                room_left = available + sum(victims) - alloc
                scan.append(
                    EvictionFit(
                        len(victims),
                        room_left,
                        slots.tie_key[slot],
                        slots.node_pos[slot],
                        slots.gpu_id[slot],
                        alloc,
                    )
                )
        assert index.find_best_fit(allocs.__getitem__, excluded) == min(scan, default=None)
    assert [tuple(index.get_room(slot)) for slot in range(len(slots))] == rooms


def recount_rooms(
    cluster: ClusterSnapshot, plan: PlacementPlan, placed_ids: set[str]
) -> dict[tuple[str, int], tuple[int, tuple[int, ...]]]:
    """Every GPU's (free bytes, evictable bytes) from the snapshot and the plan alone:
    replicas placed in the pass are not evictable again (`placed_ids` also names those
    restored where they were, which the plan does not list)."""
    hot = {
        r.replica_id: (node.node_id, dict(r.gpu_bytes), r.protected)
        for node in cluster.nodes
        for r in node.replicas
        if r.level == "HOT"
    }
    for eviction in plan.evictions:
        if eviction.from_level == "HOT":
            del hot[eviction.replica_id]
    for placement in plan.placements:
        hot[placement.replica_id] = (placement.node_id, dict(placement.gpu_bytes), True)  # placed: never evicted again
    rooms = {}
    for node in cluster.nodes:
        for gpu_id, total_bytes in node.gpu_total_bytes.items():
            available = total_bytes - node.pinned_gpu_bytes.get(gpu_id, 0)
            evictable = []
            for replica_id, (node_id, gpu_bytes, protected) in hot.items():
                num_bytes = gpu_bytes.get(gpu_id, 0)
                if node_id == node.node_id and num_bytes > 0:
                    available -= num_bytes
                    if not protected and replica_id not in placed_ids:
                        evictable.append(num_bytes)
            rooms[(node.node_id, gpu_id)] = (available, tuple(sorted(evictable)))
    return rooms


@settings(max_examples=150, deadline=None)
@given(
    cluster=st.one_of(clusters(), clusters(uniform=True), clusters(over_commit=True)),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_indexes_agree_with_a_recount_after_any_sequence_of_operations(
    cluster: ClusterSnapshot, data: st.DataObject, seed: int
) -> None:
    """After any mix of placements (with and without evictions), scale downs and explicit
    evictions: every GPU's indexed room equals a recount from the snapshot and the plan,
    and the indexed choice (FREE and FULL levels, one GPU or several) equals the best of
    every node's own decision tree. Recounts and probes come at random points, so the
    indexes are built at random points too."""
    planner = ClusterPlanner(cluster, config=CONFIG, rng=random.Random(seed), clock=clock)
    warm_ids = {
        model: sorted(
            r.replica_id for n in cluster.nodes for r in n.replicas if r.model == model and r.level == "WARM"
        )
        for model in MODELS
    }
    known_ids = sorted(r.replica_id for node in cluster.nodes for r in node.replicas)
    placed_ids: set[str] = set()
    for step in range(data.draw(st.integers(1, 8))):
        operation = data.draw(
            st.sampled_from(("place", "place", "scale_down", "evict_model", "evict_replica"))
        )
        model = data.draw(st.sampled_from(MODELS))
        if operation == "place":
            for number, demand in enumerate(data.draw(demands())):
                choices = [f"new-{step}-{number}", *warm_ids[demand.model]]
                replica_id = data.draw(st.sampled_from(choices))
                offer = planner.place_replica(demand, replica_id)
                if offer.level not in (CandidateLevel.DEPLOYED, CandidateLevel.CANT_ACCOMMODATE):
                    placed_ids.add(replica_id)
        elif operation == "scale_down":
            planner.scale_down(model, data.draw(st.integers(0, 3)))
        elif operation == "evict_model":
            planner.evict_model(model)
        elif known_ids:
            planner.evict_replica(model, data.draw(st.sampled_from(known_ids)))
        if data.draw(st.booleans()):
            for (node_id, gpu_id), room in recount_rooms(cluster, planner.finish(), placed_ids).items():
                assert tuple(planner.get_gpu_room(node_id, gpu_id)) == room, f"{node_id} GPU {gpu_id}"
        if data.draw(st.booleans()):
            for demand in data.draw(demands()):
                replica_id = f"probe-{step}"
                best_offer = min(planner.get_node_candidates(demand, replica_id), key=lambda o: o.sort_key)
                assert planner.get_candidate(demand, replica_id).sort_key == best_offer.sort_key


@settings(max_examples=100, deadline=None)
@given(cluster=clusters(over_commit=True), model_mix=demands(), seed=st.integers(0, 2**32 - 1))
def test_over_committed_gpus_get_no_room_and_never_lose_a_protected_replica(
    cluster: ClusterSnapshot, model_mix: list[ModelDemand], seed: int
) -> None:
    """Input GPUs may hold more than their total: the plan is still made (no exception),
    never evicts a protected replica, and any GPU it places on ends within its total."""
    plan = plan_placements(cluster, model_mix, config=CONFIG, rng=random.Random(seed), clock=clock)
    known = {r.replica_id: r for node in cluster.nodes for r in node.replicas}
    assert not any(
        known[e.replica_id].protected for e in plan.evictions if e.reason in ("pressure", "cpu_pressure")
    )
    placed_ids = {p.replica_id for p in plan.placements}
    rooms = recount_rooms(cluster, plan, placed_ids)
    for placement in plan.placements:
        for gpu_id in placement.gpu_bytes:
            assert rooms[(placement.node_id, gpu_id)][0] >= 0, (
                f"{placement.node_id} GPU {gpu_id} over-committed"
            )
