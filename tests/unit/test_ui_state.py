"""What the dashboard is sent, and how a waiting stream describes its wait: pure builders over
records, no NATS."""

from __future__ import annotations

from typing import Any

from shoal.services.gateway.cluster import ClusterView
from shoal.services.gateway.progress import WaitProgress
from shoal.services.gateway.ui_state import build_models, build_nodes, build_replicas
from shoal.services.worker.stats import ENGINE_COUNTS, EngineTotals
from shoal.shared import subjects
from shoal.shared.messages import (
    GpuInfo,
    GpuRecord,
    ModelSpec,
    NodeRecord,
    Occupant,
    ReplicaRecord,
    WorkerStats,
)

AT = 1000.0


def node(node_id: str, heartbeat_at: float) -> NodeRecord:
    return NodeRecord(node_id=node_id, hostname="h", gpus=[GpuInfo(0, 100)], cpu_ram_bytes=10,
                      heartbeat_at=heartbeat_at)


def replica(replica_id: str, state: str, *, model: str = "org/m", phase: Any = None, level: Any = "HOT",
            created_at: float = 1.0) -> ReplicaRecord:
    return ReplicaRecord(replica_id=replica_id, model=model, node_id="a", gpu_bytes={0: 10}, state=state,
                         phase=phase, level=level, created_at=created_at)  # type: ignore[arg-type]


def view(*replicas: ReplicaRecord, models: tuple[str, ...] = ("org/m",)) -> ClusterView:
    cluster = ClusterView(None)  # type: ignore[arg-type]  # filled by hand, as its watchers would
    for model in models:
        cluster._on_model(subjects.model_token(model), ModelSpec(key=model, path="m", desired_replicas=2))
    for record in replicas:
        cluster._on_replica(subjects.replica_kv_key(record.model, record.replica_id), record)
    return cluster


def test_loading_phase_says_how_far_a_replica_on_its_way_is() -> None:
    assert replica("r", "pending").loading_phase == "placing"
    assert replica("r", "loading").loading_phase == "starting"
    assert replica("r", "loading", phase="warming_up").loading_phase == "warming_up"
    assert replica("r", "ready", phase="warming_up").loading_phase is None, "a stale phase means nothing"


def test_nodes_hold_their_gpus_and_a_silent_node_shows_as_down() -> None:
    gpus = [GpuRecord(node_id="b", index=1, total_bytes=100), GpuRecord(node_id="a", index=0, total_bytes=100,
            occupants=[Occupant("r1", "org/m", 40, "serving", 0.0), Occupant("r2", "org/m", 30, "sleeping", 0.0)]),
            GpuRecord(node_id="b", index=0, total_bytes=100), GpuRecord(node_id="gone", index=0, total_bytes=100)]
    nodes = build_nodes(gpus, {"a": node("a", AT - 1), "b": node("b", AT - 2), "gone": node("gone", AT - 60)}, AT)
    assert [(n.node_id, n.alive) for n in nodes] == [("a", True), ("b", True), ("gone", False)]
    assert [g.key for g in nodes[1].gpus] == ["b.0", "b.1"]
    assert [(o.replica_id, o.held_bytes) for o in nodes[0].gpus[0].occupants] == [("r1", 40), ("r2", 0)]


def test_replicas_show_the_workers_last_request_else_the_gpu_record_s_last_access() -> None:
    gpus = [GpuRecord(node_id="a", index=0, total_bytes=100, occupants=[
        Occupant("r1", "org/m", 10, "serving", 0.0, last_accessed=500.0),
        Occupant("r2", "org/m", 10, "serving", 0.0, last_accessed=600.0)])]
    heard = WorkerStats(replica_id="r1", model="org/m", node_id="a", at=AT, interval_s=1.0, last_request_at=900.0,
                        num_requests_running=2)
    found = {r.replica_id: r for r in build_replicas([replica("r1", "ready"), replica("r2", "ready")], gpus,
                                                      {"r1": heard})}
    assert found["r1"].last_access == 900.0 and found["r1"].requests_running == 2
    assert found["r2"].last_access == 600.0 and found["r2"].requests_running is None


def test_models_count_replicas_by_what_they_do() -> None:
    cluster = view(replica("r1", "ready"), replica("r2", "loading", phase="loading_weights"),
                   replica("r3", "sleeping", level="WARM"), replica("r4", "pending"),
                   models=("org/m", "org/idle"))
    models = {m.key: m for m in build_models(cluster, lambda model: 3 if model == "org/m" else 0, AT)}
    m = models["org/m"]
    assert (m.num_serving, m.num_loading, m.num_sleeping, m.in_flight, m.desired_replicas) == (1, 2, 1, 3, 2)
    assert models["org/idle"].num_serving == 0 and models["org/idle"].failing is None


def test_a_waiting_stream_names_its_stage_and_its_replicas_phases() -> None:
    progress = WaitProgress(view(), "org/m")
    assert progress.describe(0.4) == "waiting 0 s for org/m (placing)"
    cluster = view(replica("aaaaaaaa11", "loading", phase="loading_weights", created_at=1.0),
                   replica("bbbbbbbb22", "pending", created_at=2.0))
    progress = WaitProgress(cluster, "org/m", "queued")
    assert progress.describe(6.2) == "waiting 6 s for org/m (queued): replica aaaaaaaa loading_weights, bbbbbbbb placing"
    progress = WaitProgress(view(replica("r1", "ready")), "org/m", "generating")
    assert progress.describe(31) == "waiting 31 s for org/m (generating): behind other requests"


def test_engine_totals_carry_a_replaced_engine_s_counts_forward() -> None:
    totals = EngineTotals()
    counts = dict.fromkeys(ENGINE_COUNTS, 0.0)
    assert totals.update(1, counts | {"num_steps": 10})["num_steps"] == 10
    assert totals.update(1, counts | {"num_steps": 15})["num_steps"] == 15
    assert totals.update(None, None)["num_steps"] == 15, "parked: no engine, nothing lost"
    assert totals.update(2, counts | {"num_steps": 4})["num_steps"] == 19, "a new engine counts from zero"
