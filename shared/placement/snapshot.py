"""What the placement policy reads: an immutable snapshot of the cluster and the models to place.

The scheduler builds these from the KV buckets (``services/scheduler/records.py``);
tests and the simulator build them by hand. Nothing here is mutated by the policy: it
copies what it changes into its own working state.

    ClusterSnapshot
      nodes: NodeSnapshot ...                 one per live node agent, in node id order
        gpu_total_bytes {gpu index: bytes}
        pinned_gpu_bytes {gpu index: bytes}   reserved by someone this snapshot cannot evict
        cpu_cache_bytes                       host RAM WARM replicas may hold
        replicas: ReplicaSnapshot ...         HOT (holding gpu_bytes) or WARM (holding cpu_bytes)
      desired_replicas {model: count}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal

from shoal.shared.placement.memory_figure import MemoryFigure

PlacedLevel = Literal["HOT", "WARM"]
"""A replica the snapshot knows of is on a GPU (HOT) or parked in CPU RAM (WARM); COLD
replicas (on disk only) have no record and take no resources."""


class CandidateLevel(IntEnum):
    """How good a node is for one replica; lower is better (seed 002)."""

    DEPLOYED = 0
    """The replica is already HOT there: nothing to do."""
    CACHED_AND_FREE = 1
    """The node holds the replica WARM and has room without evictions."""
    FREE = 2
    """Room without evictions."""
    CACHED_AND_FULL = 3
    """The node holds the replica WARM but needs evictions to take it back."""
    FULL = 4
    """Needs evictions of unprotected replicas."""
    CANT_ACCOMMODATE = 5
    """No room, even after every allowed eviction."""


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """One replica on one node."""

    replica_id: str
    model: str
    level: PlacedLevel
    gpu_bytes: Mapping[int, int] = field(default_factory=dict)
    """HOT: bytes reserved per GPU index of its node. WARM: empty."""
    cpu_bytes: int = 0
    """Host RAM its weights take while WARM (and would take if parked)."""
    protected: bool = False
    """Never evicted under memory pressure: its model is popular, or it is inside its minimum
    runtime (seed 001; the scheduler decides, `fairness.is_protected`)."""
    last_accessed: float = 0.0
    """Clock time of its last request; least recently used replicas go first."""
    parked_bytes: int | None = None
    """WARM with its weights dropped (a cold sleep: the process stays, reloads from disk): the
    CPU cache bytes it holds instead of `cpu_bytes` (``parked_process_bytes``)."""
    loaded: bool = True
    """HOT: its worker has loaded it and serves. One still starting has nothing to park: an
    eviction stops it instead of parking it WARM."""

    def __post_init__(self) -> None:
        assert self.level == "HOT" or not self.gpu_bytes, (
            f"replica {self.replica_id}: a WARM replica holds no GPU memory"
        )
        assert all(b >= 0 for b in self.gpu_bytes.values()), f"replica {self.replica_id}: negative GPU bytes"
        assert self.cpu_bytes >= 0, f"replica {self.replica_id}: negative CPU bytes"


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One node: its GPUs, its CPU RAM for WARM replicas, and what runs or sleeps on it."""

    node_id: str
    gpu_total_bytes: Mapping[int, int]
    """Total bytes of each GPU, by GPU index."""
    cpu_cache_bytes: int = 0
    """Host RAM that WARM replicas may hold in all (see ``warm_cache_fraction``)."""
    replicas: tuple[ReplicaSnapshot, ...] = ()
    pinned_gpu_bytes: Mapping[int, int] = field(default_factory=dict)
    """Bytes reserved per GPU by occupants the policy may not evict: another scheduler's
    reservation in flight, a failed replica not yet freed."""

    def __post_init__(self) -> None:
        assert self.gpu_total_bytes, f"node {self.node_id} has no GPUs"
        assert all(b > 0 for b in self.gpu_total_bytes.values()), f"node {self.node_id}: a GPU of 0 bytes"
        assert set(self.pinned_gpu_bytes) <= set(self.gpu_total_bytes), (
            f"node {self.node_id}: pinned bytes on a GPU it does not have"
        )
        for replica in self.replicas:
            assert set(replica.gpu_bytes) <= set(self.gpu_total_bytes), (
                f"node {self.node_id}: replica {replica.replica_id} holds a GPU the node does not have"
            )


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Every live node and the desired replica count of every registered model."""

    nodes: tuple[NodeSnapshot, ...]
    desired_replicas: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        node_ids = [node.node_id for node in self.nodes]
        assert len(node_ids) == len(set(node_ids)), "node ids in a snapshot are unique"
        replica_ids = [r.replica_id for node in self.nodes for r in node.replicas]
        assert len(replica_ids) == len(set(replica_ids)), "a replica id appears on one node only"


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """A model the scheduler wants placed: how much it needs and how many HOT replicas."""

    model: str
    figure: MemoryFigure
    desired_replicas: int
    popular: bool = False
    """Its replicas are never evicted under pressure, and it is placed first in a pass."""
    min_num_gpus: int = 1
    """At least this many whole GPUs per replica (tensor parallel); 1 lets it share a GPU."""

    def __post_init__(self) -> None:
        if self.desired_replicas < 0:
            raise ValueError(f"{self.model}: desired_replicas must be >= 0, got {self.desired_replicas}")
        if self.min_num_gpus < 1:
            raise ValueError(f"{self.model}: min_num_gpus must be >= 1, got {self.min_num_gpus}")
