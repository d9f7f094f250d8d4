"""KV records <-> placement policy types: how records read, what a plan writes, and a round trip."""

from __future__ import annotations

import random

import msgspec
import pytest

from shoal.services.scheduler.records import (
    GpuChange,
    apply_gpu_change,
    build_demand,
    build_snapshot,
    find_over_committed,
    get_recorded_locations,
    plan_to_records,
)
from shoal.shared.gpu_state import mark_parked, remove_occupant
from shoal.shared.messages import GpuInfo, GpuRecord, ModelSpec, NodeRecord, Occupant, ReplicaRecord
from shoal.shared.model_settings import FairnessSettings
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.memory_figure import UnknownModelMemory
from shoal.shared.placement.planner import ClusterPlanner, plan_placements
from shoal.shared.placement.replicas import get_planned_locations
from shoal.shared.placement.snapshot import ReplicaSnapshot
from shoal.shared.subjects import gpu_kv_key, replica_kv_key

GiB = 1 << 30
CONFIG = PlacementConfig()
NOW = 1_000.0


def node_record(node_id: str, num_gpus: int = 2, gpu_gib: int = 80, ram_gib: int = 64) -> NodeRecord:
    gpus = [GpuInfo(index=i, total_bytes=gpu_gib * GiB) for i in range(num_gpus)]
    return NodeRecord(node_id=node_id, hostname=node_id, gpus=gpus, cpu_ram_bytes=ram_gib * GiB)


def occupant(replica_id: str, model: str, gib: int, state: str = "serving", **kwargs: object) -> Occupant:
    return Occupant(replica_id=replica_id, model=model, num_bytes=gib * GiB, state=state, since=0.0, **kwargs)  # type: ignore[arg-type]


def gpu_record(node_id: str, index: int, *occupants: Occupant, gpu_gib: int = 80) -> GpuRecord:
    return GpuRecord(node_id=node_id, index=index, total_bytes=gpu_gib * GiB, occupants=list(occupants))


def replica_record(
    replica_id: str, model: str, node_id: str, gpu_gib: dict[int, int], **kwargs: object
) -> ReplicaRecord:
    gpu_bytes = {g: b * GiB for g, b in gpu_gib.items()}
    return ReplicaRecord(replica_id=replica_id, model=model, node_id=node_id, gpu_bytes=gpu_bytes, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- records -> snapshot


def test_occupants_read_as_reservations_warm_copies_or_pinned_bytes() -> None:
    gpus = [
        gpu_record(
            "n0",
            0,
            occupant("hot", "m", 10, last_accessed=7.0),
            occupant("inflight", "m", 4, state="reserved", owner="s2", expires_at=NOW + 30),
            occupant("lapsed", "m", 3, state="reserved", owner="s3", expires_at=NOW - 1),
            occupant("sleepy", "m", 20, state="sleeping", last_accessed=3.0),
            occupant("broken", "x", 5),
        ),
        gpu_record("gone", 0, occupant("ghost", "m", 10)),  # no node record: a dead node
    ]
    replicas = [
        replica_record("hot", "m", "n0", {0: 10}, state="ready", cpu_bytes=2 * GiB),
        replica_record("sleepy", "m", "n0", {}, level="WARM", state="sleeping", cpu_bytes=5 * GiB),
        replica_record("broken", "x", "n0", {0: 5}, state="failed"),
        replica_record("ghost", "m", "gone", {0: 10}),
    ]
    models = [ModelSpec(key="m", path="m", desired_replicas=2)]
    snapshot = build_snapshot(
        [node_record("n1"), node_record("n0")], gpus, replicas, models, config=CONFIG, now=NOW
    )
    assert [n.node_id for n in snapshot.nodes] == ["n0", "n1"]
    n0 = snapshot.nodes[0]
    assert n0.gpu_total_bytes == {0: 80 * GiB, 1: 80 * GiB}
    assert n0.pinned_gpu_bytes == {0: 9 * GiB}  # in-flight reservation + failed replica
    assert n0.cpu_cache_bytes == 32 * GiB
    assert n0.replicas == (
        ReplicaSnapshot("hot", "m", "HOT", {0: 10 * GiB}, 2 * GiB, last_accessed=7.0),
        ReplicaSnapshot("sleepy", "m", "WARM", {}, 5 * GiB, last_accessed=3.0),
    )
    assert snapshot.desired_replicas == {"m": 2}


def test_a_hot_replica_not_yet_serving_reads_as_not_loaded() -> None:
    gpus = [gpu_record("n0", 0, occupant("new", "m", 10, state="loading"), occupant("up", "m", 10))]
    replicas = [replica_record("new", "m", "n0", {0: 10}, state="loading"),
                replica_record("up", "m", "n0", {0: 10}, state="ready")]
    snapshot = build_snapshot([node_record("n0")], gpus, replicas, [], config=CONFIG, now=NOW)
    assert [(r.replica_id, r.level, r.loaded) for r in snapshot.nodes[0].replicas] == [
        ("new", "HOT", False), ("up", "HOT", True)]


def test_a_hot_record_whose_occupants_all_sleep_reads_as_warm() -> None:
    gpus = [gpu_record("n0", 0, occupant("r", "m", 10, state="sleeping"))]
    replicas = [replica_record("r", "m", "n0", {0: 10}, state="ready", cpu_bytes=GiB)]
    snapshot = build_snapshot([node_record("n0")], gpus, replicas, [], config=CONFIG, now=NOW)
    assert snapshot.nodes[0].replicas[0].level == "WARM"


def test_demand_ranks_the_memory_figure_and_carries_the_spec_flags() -> None:
    spec = ModelSpec(key="m", path="m", weight_bytes=2 * GiB, estimated_bytes=5 * GiB, desired_replicas=2)
    demand = build_demand(spec, config=CONFIG)
    assert (demand.figure.required_bytes, demand.figure.source, demand.desired_replicas) == (
        5 * GiB,
        "estimate",
        2,
    )
    spec = msgspec.structs.replace(spec, measured_serving_bytes=4 * GiB, fairness=FairnessSettings(popular=True),
                                   num_gpus=2)
    demand = build_demand(spec, config=CONFIG, desired_replicas=3)
    assert (demand.figure.source, demand.popular, demand.min_num_gpus, demand.desired_replicas) == (
        "measured",
        True,
        2,
        3,
    )
    guessed = build_demand(ModelSpec(key="g", path="g", weight_bytes=2 * GiB), config=CONFIG)
    assert (guessed.figure.required_bytes, guessed.figure.source) == (6 * GiB, "factor")
    with pytest.raises(UnknownModelMemory):
        build_demand(ModelSpec(key="u", path="u"), config=CONFIG)


# --------------------------------------------------------------------------- plan -> records


def test_plan_writes_reservations_sleeping_occupants_and_records() -> None:
    gpus = [
        gpu_record("n0", 0, occupant("x1", "x", 70, last_accessed=5.0)),
        gpu_record("n0", 1, occupant("w1", "m", 20, state="sleeping"), occupant("y1", "y", 79)),
    ]
    replicas = {
        "x1": replica_record("x1", "x", "n0", {0: 70}, state="ready", cpu_bytes=4 * GiB, created_at=1.0),
        "w1": replica_record(
            "w1", "m", "n0", {}, level="WARM", state="sleeping", cpu_bytes=2 * GiB, created_at=2.0,
            ready_at=3.0, pid=42,
        ),
        "y1": replica_record("y1", "y", "n0", {1: 79}, state="ready", cpu_bytes=4 * GiB),
    }
    models = [
        ModelSpec(
            key="m", path="m", measured_serving_bytes=20 * GiB, weight_bytes=2 * GiB, desired_replicas=1
        ),
        ModelSpec(key="y", path="y", fairness=FairnessSettings(popular=True)),
    ]
    snapshot = build_snapshot([node_record("n0")], gpus, replicas.values(), models, config=CONFIG, now=NOW)
    plan = plan_placements(
        snapshot,
        [build_demand(models[0], config=CONFIG)],
        config=CONFIG,
        rng=random.Random(0),
        clock=lambda: NOW,
    )
    changes = plan_to_records(plan, gpus=gpus, replicas=replicas, scheduler_id="s1", reservation_ttl_s=60.0)

    assert list(changes.gpu_changes) == ["n0.0", "n0.1"]
    gpu0 = changes.gpu_changes["n0.0"]
    assert gpu0.remove_replica_ids == ("x1",)
    assert [(o.replica_id, o.state, o.num_bytes) for o in gpu0.add] == [
        ("x1", "draining", 70 * GiB),  # holds its bytes until its node agent confirms the park
        ("w1", "reserved", 20 * GiB),
    ]
    reservation = gpu0.add[1]
    assert (reservation.owner, reservation.expires_at, reservation.since) == ("s1", NOW + 60.0, NOW)
    assert gpu0.add[0].last_accessed == 5.0
    assert changes.gpu_changes["n0.1"] == GpuChange(("w1",), ())

    puts = {r.replica_id: r for r in changes.replica_puts}
    assert (puts["x1"].level, puts["x1"].state, puts["x1"].leaving_to, puts["x1"].gpu_bytes, puts["x1"].created_at) == (
        "HOT",
        "draining",
        "WARM",
        {0: 70 * GiB},
        1.0,
    )
    restored = puts["w1"]
    assert (restored.level, restored.state, restored.node_id, restored.gpu_bytes) == (
        "HOT",
        "pending",
        "n0",
        {0: 20 * GiB},
    )
    assert (restored.gpu_memory_fraction, restored.created_at, restored.scheduler_id) == (0.25, 2.0, "s1")
    # It has served before, in the same worker process: a failure now is not a failure to come up.
    assert (restored.ready_at, restored.pid) == (3.0, 42)
    assert changes.replica_delete_keys == ()


def test_an_evicted_replica_drains_holding_its_memory_until_its_node_agent_releases_it() -> None:
    gpus = [gpu_record("n0", 0, occupant("h", "m", 10))]
    replicas = {"h": replica_record("h", "m", "n0", {0: 10}, state="ready", cpu_bytes=GiB)}
    snapshot = build_snapshot(
        [node_record("n0", ram_gib=0)], gpus, replicas.values(), [], config=CONFIG, now=NOW
    )
    planner = ClusterPlanner(snapshot, config=CONFIG, rng=random.Random(0), clock=lambda: NOW)
    planner.evict_model("m")  # no CPU RAM to park it: it goes COLD
    changes = plan_to_records(
        planner.finish(), gpus=gpus, replicas=replicas, scheduler_id="s1", reservation_ttl_s=60
    )
    drained = apply_gpu_change(gpus[0], changes.gpu_changes["n0.0"], now=NOW)
    assert drained is not None and [(o.replica_id, o.state) for o in drained.occupants] == [("h", "draining")]
    assert drained.reserved_bytes == 10 * GiB, "counted until the worker is gone"
    assert changes.replica_delete_keys == ()
    (record,) = changes.replica_puts
    assert (record.state, record.leaving_to) == ("draining", "COLD")
    rebuilt = build_snapshot([node_record("n0", ram_gib=0)], [drained], [record], [], config=CONFIG, now=NOW)
    assert rebuilt.nodes[0].replicas == () and rebuilt.nodes[0].pinned_gpu_bytes == {0: 10 * GiB}
    released = remove_occupant(drained, "h", NOW)  # what its node agent writes once the worker stopped
    assert released is not None and released.reserved_bytes == 0


def test_apply_gpu_change_refuses_to_over_commit() -> None:
    record = gpu_record("n0", 0, occupant("a", "m", 50), occupant("s", "m", 70, state="sleeping"))
    fits = apply_gpu_change(record, GpuChange(("a",), (occupant("b", "m", 80, state="reserved"),)), now=NOW)
    assert fits is not None
    assert [o.replica_id for o in fits.occupants] == ["s", "b"] and fits.updated_at == NOW
    assert (
        apply_gpu_change(record, GpuChange((), (occupant("b", "m", 31, state="reserved"),)), now=NOW) is None
    )


def test_an_eviction_on_an_over_committed_gpu_commits() -> None:
    # A 40 GiB GPU holding 3 x 30 GiB (its node re-registered smaller): evicting one lowers
    # the excess, so the change applies although the GPU stays over its total.
    nodes = [node_record("n0", num_gpus=1, gpu_gib=40)]
    gpus = [gpu_record("n0", 0, *(occupant(r, "x", 30) for r in ("a", "b", "c")), gpu_gib=40)]
    replica_list = [replica_record(r, "x", "n0", {0: 30}, state="ready", cpu_bytes=GiB) for r in ("a", "b", "c")]
    replicas = {r.replica_id: r for r in replica_list}
    snapshot = build_snapshot(nodes, gpus, replica_list, [], config=CONFIG, now=NOW)
    planner = ClusterPlanner(snapshot, config=CONFIG, rng=random.Random(0), clock=lambda: NOW)
    assert planner.evict_replica("x", "b")
    changes = plan_to_records(planner.finish(), gpus=gpus, replicas=replicas, scheduler_id="s1",
                              reservation_ttl_s=60)
    updated = apply_gpu_change(gpus[0], changes.gpu_changes["n0.0"], now=NOW)
    assert updated is not None, "marking a victim draining must commit on an over-committed GPU"
    assert [(o.replica_id, o.state) for o in updated.occupants] == [
        ("a", "serving"), ("c", "serving"), ("b", "draining")
    ]
    parked = mark_parked(updated, "b", 0, NOW)  # its node agent, once the worker parked
    assert parked is not None and parked.reserved_bytes == 60 * GiB
    assert find_over_committed([parked]) == {"n0.0": 20 * GiB}
    # Plain removals apply too; nothing that adds bytes beyond the total does.
    assert apply_gpu_change(gpus[0], GpuChange(("a",), ()), now=NOW) is not None
    grows = GpuChange((), (occupant("d", "m", 1, state="reserved"),))
    assert apply_gpu_change(gpus[0], grows, now=NOW) is None
    swaps = GpuChange(("a",), (occupant("d", "m", 10, state="reserved"),))
    assert apply_gpu_change(gpus[0], swaps, now=NOW) is None, "a new replica never starts on held memory"


def test_a_gpu_re_registered_smaller_is_reported_and_gets_no_room_until_evictions_cover_it() -> None:
    # The node came back with a 40 GiB GPU 0; its agent kept the 60 GiB of occupants.
    nodes = [node_record("n0", num_gpus=1, gpu_gib=40)]
    gpus = [gpu_record("n0", 0, occupant("d", "x", 30), occupant("a", "y", 30), gpu_gib=40)]
    replica_list = [
        replica_record("d", "x", "n0", {0: 30}, state="ready", cpu_bytes=GiB),
        replica_record("a", "y", "n0", {0: 30}, state="ready", cpu_bytes=GiB),
    ]
    replicas = {r.replica_id: r for r in replica_list}
    assert find_over_committed(gpus) == {"n0.0": 20 * GiB}
    models = [
        ModelSpec(key="m", path="m", measured_serving_bytes=5 * GiB, weight_bytes=GiB, desired_replicas=1),
        ModelSpec(
            key="big", path="big", measured_serving_bytes=15 * GiB, weight_bytes=GiB, desired_replicas=1
        ),
        ModelSpec(key="x", path="x", fairness=FairnessSettings(popular=True)),
    ]
    snapshot = build_snapshot(nodes, gpus, replica_list, models, config=CONFIG, now=NOW)
    assert snapshot.nodes[0].gpu_total_bytes == {0: 40 * GiB}
    demands = [build_demand(spec, config=CONFIG) for spec in models[:2]]
    plan = plan_placements(snapshot, demands, config=CONFIG, rng=random.Random(0), clock=lambda: NOW)
    # "big" needs 35 GiB of evictions and only "a" (30 GiB) may go: unplaced. "m" needs
    # 25 GiB: evicting "a" brings the GPU from 20 GiB over to 10 GiB free.
    assert [(u.model, u.reason) for u in plan.unplaced] == [("big", "no node has room, even after evictions")]
    assert [(p.model, p.gpu_bytes, p.eviction_ids) for p in plan.placements] == [("m", {0: 5 * GiB}, ("a",))]
    assert [(e.replica_id, e.to_level, e.reason) for e in plan.evictions] == [("a", "WARM", "pressure")]
    changes = plan_to_records(plan, gpus=gpus, replicas=replicas, scheduler_id="s1", reservation_ttl_s=60)
    # Committed as one change, the new replica would start on memory "a" still holds while it
    # drains: refused. Shoal commits the eviction first and places once "a" is parked.
    assert apply_gpu_change(gpus[0], changes.gpu_changes["n0.0"], now=NOW) is None
    evict_only = GpuChange(("a",), tuple(o for o in changes.gpu_changes["n0.0"].add if o.replica_id == "a"))
    draining = apply_gpu_change(gpus[0], evict_only, now=NOW)
    assert draining is not None
    parked = mark_parked(draining, "a", 0, NOW)
    assert parked is not None
    reserve = GpuChange((), tuple(o for o in changes.gpu_changes["n0.0"].add if o.replica_id != "a"))
    updated = apply_gpu_change(parked, reserve, now=NOW)
    assert updated is not None and updated.reserved_bytes == 35 * GiB
    assert find_over_committed([updated]) == {}


# --------------------------------------------------------------------------- round trip


def test_round_trip_records_plan_records() -> None:
    nodes = [node_record("n0"), node_record("n1")]
    gpus = [
        gpu_record("n0", 0, occupant("x1", "x", 60)),
        gpu_record("n0", 1, occupant("d1", "d", 80)),
        gpu_record("n1", 0, occupant("x2", "x", 30), occupant("w1", "m", 10, state="sleeping")),
        gpu_record("n1", 1),
    ]
    replica_list = [
        replica_record("x1", "x", "n0", {0: 60}, state="ready", cpu_bytes=8 * GiB),
        replica_record("d1", "d", "n0", {1: 80}, state="ready", cpu_bytes=8 * GiB),
        replica_record("x2", "x", "n1", {0: 30}, state="ready", cpu_bytes=8 * GiB),
        replica_record("w1", "m", "n1", {}, level="WARM", state="sleeping", cpu_bytes=2 * GiB),
    ]
    replicas = {r.replica_id: r for r in replica_list}
    models = [
        ModelSpec(
            key="m", path="m", measured_serving_bytes=30 * GiB, weight_bytes=2 * GiB, desired_replicas=3
        ),
        ModelSpec(key="big", path="big", weight_bytes=40 * GiB, desired_replicas=1),
        ModelSpec(key="x", path="x", desired_replicas=2),
        ModelSpec(key="d", path="d", desired_replicas=1, fairness=FairnessSettings(popular=True)),
    ]
    snapshot = build_snapshot(nodes, gpus, replica_list, models, config=CONFIG, now=NOW)
    demands = [build_demand(spec, config=CONFIG) for spec in models[:2]]
    # What the scheduler commits: placements where there is room (evictions are their own,
    # earlier passes: the memory they free is placed on once it is released).
    planner = ClusterPlanner(snapshot, config=CONFIG, rng=random.Random(1), clock=lambda: NOW)
    for demand in demands:
        planner.ensure(demand, allow_evictions=False)
    plan = planner.finish()
    assert plan.placements, "the scenario places something"
    changes = plan_to_records(plan, gpus=gpus, replicas=replicas, scheduler_id="s1", reservation_ttl_s=60)

    new_gpus = []
    for record in gpus:
        change = changes.gpu_changes.get(gpu_kv_key(record.node_id, record.index))
        updated = record if change is None else apply_gpu_change(record, change, now=NOW)
        assert updated is not None and updated.reserved_bytes <= updated.total_bytes
        new_gpus.append(updated)
    new_replicas = dict(replicas)
    for key in changes.replica_delete_keys:
        del new_replicas[next(r for r, rec in new_replicas.items() if replica_kv_key(rec.model, r) == key)]
    new_replicas.update({r.replica_id: r for r in changes.replica_puts})

    expected = get_planned_locations(get_recorded_locations(replicas.values()), plan)
    assert get_recorded_locations(new_replicas.values()) == expected
    rebuilt = build_snapshot(nodes, new_gpus, new_replicas.values(), models, config=CONFIG, now=NOW)
    rebuilt_hot = {
        r.replica_id: dict(r.gpu_bytes) for n in rebuilt.nodes for r in n.replicas if r.level == "HOT"
    }
    assert rebuilt_hot == {rid: dict(loc.gpu_bytes) for rid, loc in expected.items() if loc.level == "HOT"}
    assert all(not n.pinned_gpu_bytes for n in rebuilt.nodes)

    demands_again = [
        build_demand(spec, config=CONFIG, desired_replicas=plan.desired_replicas.get(spec.key))
        for spec in models[:2]
    ]
    again_planner = ClusterPlanner(rebuilt, config=CONFIG, rng=random.Random(1), clock=lambda: NOW)
    for demand in demands_again:
        again_planner.ensure(demand, allow_evictions=False)
    again = again_planner.finish()
    assert again.placements == () and again.evictions == (), "a committed plan is stable"
