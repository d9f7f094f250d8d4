"""What the dashboard shows, as one JSON document: nodes and GPUs, replicas, models, history.

Built from the gateway's live view (cluster.py: the KV buckets, by watchers), the workers'
latest stats (worker_metrics.py) and the history (history.py): no NATS request per page
refresh. Pure: the caller passes everything, time included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import msgspec

from shoal.services.gateway.cluster import ClusterView
from shoal.services.gateway.history import HistoryPoint
from shoal.shared.bus import NODE_TTL_S
from shoal.shared.messages import GpuRecord, LoadPhase, NodeRecord, ReplicaRecord, WorkerStats


class UiOccupant(msgspec.Struct):
    replica_id: str
    model: str
    state: str
    held_bytes: int
    """GPU bytes it holds now (0 while sleeping)."""
    num_bytes: int
    """Its share when it holds memory."""


class UiGpu(msgspec.Struct):
    key: str
    index: int
    name: str
    total_bytes: int
    occupants: list[UiOccupant]


class UiNode(msgspec.Struct):
    node_id: str
    alive: bool
    """Heartbeating (a node whose agent stopped keeps its GPU keys until they are cleaned up)."""
    hostname: str = ""
    virtual: bool = False
    cpu_ram_bytes: int = 0
    num_workers: int = 0
    heartbeat_age_s: float | None = None
    gpus: list[UiGpu] = msgspec.field(default_factory=list)


class UiReplica(msgspec.Struct):
    replica_id: str
    model: str
    node_id: str
    gpus: list[str]
    """Keys of its GPUs (``<node>.<index>``)."""
    gpu_bytes: int
    level: str
    state: str
    phase: LoadPhase | None
    created_at: float
    last_access: float | None
    """When it last took a request (its worker's stats), else when it was last marked accessed."""
    error: str | None = None
    requests_running: int | None = None
    requests_waiting: int | None = None
    kv_usage: float | None = None
    """Used KV blocks over all (0-1)."""


class UiModel(msgspec.Struct):
    key: str
    desired_replicas: int
    num_serving: int
    num_loading: int
    num_sleeping: int
    in_flight: int
    """Waiting or running in this gateway."""
    failing: str | None
    """Why placement backs off (its replicas keep failing), if it does."""


class UiState(msgspec.Struct):
    at: float
    gateway_id: str
    admin: bool
    """The key the page sent may use the admin API."""
    nodes: list[UiNode]
    replicas: list[UiReplica]
    models: list[UiModel]
    history: list[HistoryPoint]
    """Points after the `since` the page asked for (all on its first request)."""
    history_window_s: float


def build_nodes(gpus: Iterable[GpuRecord], nodes: dict[str, NodeRecord], at: float) -> list[UiNode]:
    """Every node with a GPU key or a live heartbeat, its GPUs in index order."""
    by_node: dict[str, UiNode] = {}
    for node_id, record in nodes.items():
        age = at - record.heartbeat_at
        if age > NODE_TTL_S:
            continue  # its key expired from the bucket (watchers are not told)
        by_node[node_id] = UiNode(node_id=node_id, alive=True, hostname=record.hostname, virtual=record.virtual,
                                  cpu_ram_bytes=record.cpu_ram_bytes, num_workers=record.num_workers,
                                  heartbeat_age_s=max(0.0, age))
    for gpu in gpus:
        node = by_node.setdefault(gpu.node_id, UiNode(node_id=gpu.node_id, alive=False, virtual=gpu.virtual))
        occupants = [UiOccupant(o.replica_id, o.model, o.state, o.held_bytes, o.num_bytes) for o in gpu.occupants]
        node.gpus.append(UiGpu(f"{gpu.node_id}.{gpu.index}", gpu.index, gpu.name, gpu.total_bytes, occupants))
    for node in by_node.values():
        node.gpus.sort(key=lambda g: g.index)
    return [by_node[node_id] for node_id in sorted(by_node)]


def build_replicas(replicas: Iterable[ReplicaRecord], gpus: Iterable[GpuRecord],
                   stats: dict[str, WorkerStats]) -> list[UiReplica]:
    last_accessed: dict[str, float] = {}
    for gpu in gpus:
        for occupant in gpu.occupants:
            last_accessed[occupant.replica_id] = max(occupant.last_accessed,
                                                     last_accessed.get(occupant.replica_id, 0.0))
    found = []
    for record in replicas:
        heard = stats.get(record.replica_id)
        kv = heard.kv_cache if heard is not None else None
        last_access = heard.last_request_at if heard is not None else None
        found.append(UiReplica(
            replica_id=record.replica_id, model=record.model, node_id=record.node_id,
            gpus=[f"{record.node_id}.{index}" for index in sorted(record.gpu_bytes)],
            gpu_bytes=sum(record.gpu_bytes.values()), level=record.level, state=record.state,
            phase=record.loading_phase, created_at=record.created_at,
            last_access=last_access or last_accessed.get(record.replica_id) or None, error=record.error,
            requests_running=heard.num_requests_running if heard is not None else None,
            requests_waiting=heard.num_requests_waiting if heard is not None else None,
            kv_usage=kv.num_used_blocks / kv.num_blocks if kv is not None and kv.num_blocks else None,
        ))
    return sorted(found, key=lambda r: (r.model, r.created_at, r.replica_id))


def build_models(cluster: ClusterView, get_in_flight: Callable[[str], int], at: float) -> list[UiModel]:
    states: dict[str, Counter[str]] = {}
    for record in cluster.replicas.values():
        kind = ("serving" if record.serving else "loading" if record.loading_phase is not None
                else "sleeping" if record.level == "WARM" else "other")
        states.setdefault(record.model, Counter())[kind] += 1
    models = []
    for key in sorted(cluster.models):
        spec = cluster.models[key]
        counts = states.get(key, Counter())
        models.append(UiModel(key=key, desired_replicas=spec.desired_replicas, num_serving=counts["serving"],
                              num_loading=counts["loading"], num_sleeping=counts["sleeping"],
                              in_flight=get_in_flight(key), failing=cluster.failing_reason(key, at)))
    return models


def build_state(cluster: ClusterView, stats: Iterable[WorkerStats], *, get_in_flight: Callable[[str], int],
                history: list[HistoryPoint], history_window_s: float, gateway_id: str, admin: bool,
                at: float) -> UiState:
    """The dashboard's document (see the module doc)."""
    by_replica = {s.replica_id: s for s in stats}
    gpus = list(cluster.gpus.values())
    return UiState(
        at=at,
        gateway_id=gateway_id,
        admin=admin,
        nodes=build_nodes(gpus, cluster.nodes, at),
        replicas=build_replicas(cluster.replicas.values(), gpus, by_replica),
        models=build_models(cluster, get_in_flight, at),
        history=history,
        history_window_s=history_window_s,
    )
