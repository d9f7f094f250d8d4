"""What a planning pass decides, as plain values the scheduler commits and the tests assert on.

A `PlacementPlan` is complete: every replica that changes level or place appears once
(net of the whole pass), with the node, GPUs and bytes it takes or frees, so the caller
can turn it into GPU-key and replica-record writes without consulting the policy again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from shoal.shared.placement.memory_figure import MemorySource
from shoal.shared.placement.node_eval import AllocationKind
from shoal.shared.placement.node_state import EvictionReason
from shoal.shared.placement.snapshot import CandidateLevel


@dataclass(frozen=True, slots=True)
class Placement:
    """A replica becoming HOT: created (from COLD) or restored from its node's CPU cache (WARM)."""

    model: str
    replica_id: str
    node_id: str
    gpu_bytes: Mapping[int, int]
    """Bytes reserved per GPU index of `node_id`."""
    gpu_memory_fraction: float | None
    """Single-GPU replicas: share of the GPU the worker may use (clamped); None for multi-GPU."""
    kind: AllocationKind
    from_level: Literal["WARM", "COLD"]
    candidate_level: CandidateLevel
    memory_source: MemorySource
    """Where the figure the reservation is based on came from."""
    cpu_bytes: int
    """Host RAM its weights take if it is parked WARM later."""
    eviction_ids: tuple[str, ...] = ()
    """Replicas evicted to make room for this one (each also listed as an `Eviction`)."""


@dataclass(frozen=True, slots=True)
class Eviction:
    """A replica leaving a GPU (HOT -> WARM / COLD) or the CPU cache (WARM -> COLD)."""

    model: str
    replica_id: str
    node_id: str
    from_level: Literal["HOT", "WARM"]
    to_level: Literal["WARM", "COLD"]
    """WARM: parked in the node's CPU RAM; COLD: deleted."""
    freed_gpu_bytes: Mapping[int, int]
    """GPU bytes it gave back, per GPU index (empty for WARM -> COLD)."""
    reason: EvictionReason
    drop_weights: bool = False
    """HOT -> WARM as a cold sleep: the worker stays, its weights are dropped."""


@dataclass(frozen=True, slots=True)
class Unplaced:
    """A replica the cluster cannot accommodate even with every allowed eviction."""

    model: str
    replica_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """The outcome of one planning pass over one snapshot."""

    placements: tuple[Placement, ...] = ()
    evictions: tuple[Eviction, ...] = ()
    unplaced: tuple[Unplaced, ...] = ()
    desired_replicas: Mapping[str, int] = field(default_factory=dict)
    """New desired replica count of every model whose count this pass changed."""
    planned_at: float = 0.0
    """Clock time of the pass (reservation timestamps derive from it)."""

    @property
    def is_empty(self) -> bool:
        """Nothing to write."""
        return not (self.placements or self.evictions or self.desired_replicas)

    def get_placed_ids(self, model: str) -> list[str]:
        return [p.replica_id for p in self.placements if p.model == model]
