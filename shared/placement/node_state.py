"""The planner's working copy of one node: GPU and CPU accounting plus its HOT and WARM replicas.

Built from a `NodeSnapshot` (never mutated) and changed only through `place`, `drop_warm`,
`take_warm` and `evict_hot`, which keep three things consistent:

    GpuResources.available_bytes_by_gpu  ==  total - pinned - sum(HOT replicas' bytes per GPU)
    CpuCacheResources.used_bytes          ==  sum(WARM replicas' held_cpu_bytes)
    hot_ids_by_gpu[g]                     ==  HOT replicas holding bytes on GPU g

Evicting a HOT replica (seed 002, "Node side"): its GPU memory is given back; it is
parked WARM when the node's CPU cache has room, else WARM replicas are dropped (to COLD)
smallest first to make room — but only when dropping can make enough room; otherwise the
evicted replica itself goes COLD (deleted) and the WARM ones stay.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from shoal.shared.placement.resources import CpuCacheResources, GpuResources
from shoal.shared.placement.snapshot import NodeSnapshot

Level = Literal["HOT", "WARM", "COLD"]
EvictionReason = Literal["pressure", "cpu_pressure", "moved", "scale_down", "explicit", "preempted", "idle"]
"""Why a replica left the GPU or the CPU cache:
pressure: evicted to make room for another placement; cpu_pressure: a WARM copy dropped
to make CPU room for another parked replica; moved: a WARM copy superseded by a HOT copy
of the same replica on another node; scale_down / explicit: asked for; preempted: chosen
by fair preemption for a waking model (seed 001); idle: no request for its model's idle
timeout."""


@dataclass(slots=True)
class WorkReplica:
    """A replica as the planner sees it now (mutable; copied from the snapshot)."""

    replica_id: str
    model: str
    node_id: str
    level: Level
    gpu_bytes: dict[int, int] = field(default_factory=dict)
    cpu_bytes: int = 0
    protected: bool = False
    last_accessed: float = 0.0
    locked: bool = False
    """Placed by this plan: not evicted again by the same plan (no thrashing inside one plan)."""
    parked_bytes: int | None = None
    """WARM with its weights dropped: what it holds of the CPU cache (None: `cpu_bytes`)."""
    loaded: bool = True
    """HOT: loaded and serving (`ReplicaSnapshot.loaded`); only such a replica can be parked."""

    @property
    def held_cpu_bytes(self) -> int:
        """What it holds of the CPU cache while WARM."""
        return self.cpu_bytes if self.parked_bytes is None else self.parked_bytes


@dataclass(frozen=True, slots=True)
class LevelChange:
    """One replica moving down: HOT -> WARM / COLD, or WARM -> COLD."""

    replica: WorkReplica
    from_level: Level
    to_level: Level
    freed_gpu_bytes: Mapping[int, int]
    reason: EvictionReason


class NodeWork:
    """Mutable accounting of one node during one plan."""

    __slots__ = (
        "cpu_cache",
        "gpu_tie_keys",
        "gpus",
        "hot",
        "hot_ids_by_gpu",
        "node_id",
        "node_tie_key",
        "warm",
    )

    def __init__(
        self,
        snapshot: NodeSnapshot,
        min_available_gpu_fraction: float,
        gpu_tie_keys: Mapping[int, float],
        node_tie_key: float,
    ) -> None:
        """Args:
        snapshot: the node as read; copied, never changed.
        min_available_gpu_fraction: threshold of the GPUs' "available" set.
        gpu_tie_keys: a seeded random number per GPU; breaks exact ties between GPUs.
        node_tie_key: a seeded random number breaking exact ties between nodes.
        """
        self.node_id = snapshot.node_id
        self.gpu_tie_keys = gpu_tie_keys
        self.node_tie_key = node_tie_key
        self.hot: dict[str, WorkReplica] = {}
        self.warm: dict[str, WorkReplica] = {}
        self.hot_ids_by_gpu: dict[int, set[str]] = {gpu_id: set() for gpu_id in snapshot.gpu_total_bytes}
        for replica in snapshot.replicas:
            work = WorkReplica(
                replica_id=replica.replica_id,
                model=replica.model,
                node_id=snapshot.node_id,
                level=replica.level,
                gpu_bytes=dict(replica.gpu_bytes),
                cpu_bytes=replica.cpu_bytes,
                protected=replica.protected,
                last_accessed=replica.last_accessed,
                parked_bytes=replica.parked_bytes if replica.level == "WARM" else None,
                loaded=replica.loaded,
            )
            if replica.level == "HOT":
                self._add_hot(work)
            else:
                self.warm[work.replica_id] = work
        self.gpus = GpuResources(
            snapshot.gpu_total_bytes, get_reserved_bytes(snapshot), min_available_gpu_fraction
        )
        self.cpu_cache = CpuCacheResources(
            snapshot.cpu_cache_bytes, sum(r.held_cpu_bytes for r in self.warm.values())
        )

    # ------------------------------------------------------------------ queries

    def get_evictable_on_gpu(self, gpu_id: int, model: str) -> list[WorkReplica]:
        """HOT replicas on `gpu_id` that pressure may evict to place `model`: not
        protected, not placed by this plan, and not replicas of `model` itself."""
        evictable = []
        for replica_id in self.hot_ids_by_gpu[gpu_id]:
            replica = self.hot[replica_id]
            if not (replica.protected or replica.locked or replica.model == model):
                evictable.append(replica)
        return evictable

    def get_evictable_sizes(self, gpu_id: int) -> list[int]:
        """Bytes on `gpu_id` of each HOT replica pressure may evict for a model with no
        replica there (not protected, not placed by this plan), ascending."""
        sizes = []
        for replica_id in self.hot_ids_by_gpu[gpu_id]:
            replica = self.hot[replica_id]
            if not (replica.protected or replica.locked):
                sizes.append(replica.gpu_bytes[gpu_id])
        sizes.sort()
        return sizes

    def serves_model_on_gpu(self, gpu_id: int, model: str) -> bool:
        """A HOT replica of `model` holds memory on `gpu_id`."""
        return any(self.hot[replica_id].model == model for replica_id in self.hot_ids_by_gpu[gpu_id])

    def is_gpu_clearable(self, gpu_id: int, model: str) -> bool:
        """Every byte reserved on the GPU belongs to a replica `model` may evict."""
        evictable_bytes = sum(r.gpu_bytes[gpu_id] for r in self.get_evictable_on_gpu(gpu_id, model))
        return self.gpus.get_available_bytes(gpu_id) + evictable_bytes == self.gpus.total_bytes_by_gpu[gpu_id]

    # ------------------------------------------------------------------ changes

    def place(self, replica: WorkReplica, gpu_bytes: Mapping[int, int], *, whole_gpus: bool) -> None:
        """Make `replica` HOT here holding `gpu_bytes` (the caller freed the room first)."""
        assert replica.replica_id not in self.hot, (
            f"replica {replica.replica_id} is already HOT on {self.node_id}"
        )
        assert replica.replica_id not in self.warm, (
            f"replica {replica.replica_id}: take it from the cache first"
        )
        if whole_gpus:
            assigned = self.gpus.try_assign_whole_gpus(gpu_bytes)
        else:
            assigned = all(
                self.gpus.try_assign_memory(b, gpu_id) is not None for gpu_id, b in gpu_bytes.items()
            )
        assert assigned, f"placing {replica.replica_id} on {self.node_id} {dict(gpu_bytes)} would over-commit"
        replica.node_id = self.node_id
        replica.level = "HOT"
        replica.gpu_bytes = dict(gpu_bytes)
        replica.parked_bytes = None
        replica.locked = True
        self._add_hot(replica)

    def take_warm(self, replica_id: str) -> WorkReplica:
        """Remove a WARM replica from the CPU cache (to promote it, move it, or drop it)."""
        replica = self.warm.pop(replica_id)
        self.cpu_cache.release(replica.held_cpu_bytes)
        return replica

    def evict_hot(
        self,
        replica_id: str,
        reason: EvictionReason,
        *,
        park: bool = True,
        keep_warm_ids: Collection[str] = (),
        parked_bytes: int | None = None,
    ) -> list[LevelChange]:
        """Take a HOT replica off its GPUs: park it WARM if CPU RAM allows, else delete it.

        Args:
            replica_id: a HOT replica of this node.
            reason: recorded on the change.
            park: False deletes the replica outright (scale down); so does evicting one that
                is not loaded yet (nothing to park).
            keep_warm_ids: WARM replicas that must not be dropped to make CPU room (a plan
                is about to promote them).
            parked_bytes: park with its weights dropped (a cold sleep), holding this much of
                the CPU cache instead of its weights' bytes.

        Returns:
            The evicted replica's change first, then any WARM replicas dropped for room.
        """
        replica = self.hot.pop(replica_id)
        park = park and replica.loaded
        freed_gpu_bytes = dict(replica.gpu_bytes)
        for gpu_id in freed_gpu_bytes:
            self.hot_ids_by_gpu[gpu_id].discard(replica_id)
        self.gpus.release(freed_gpu_bytes)
        replica.gpu_bytes = {}
        charge = replica.cpu_bytes if parked_bytes is None else parked_bytes
        dropped = self._make_cpu_room(charge, keep_warm_ids) if park else None
        if dropped is None:
            replica.level = "COLD"
            return [LevelChange(replica, "HOT", "COLD", freed_gpu_bytes, reason)]
        held = self.cpu_cache.try_hold(charge)
        replica.parked_bytes = parked_bytes
        assert held, f"node {self.node_id}: CPU cache has no room after making room for {replica_id}"
        replica.level = "WARM"
        self.warm[replica_id] = replica
        return [LevelChange(replica, "HOT", "WARM", freed_gpu_bytes, reason), *dropped]

    def drop_warm(self, replica_id: str, reason: EvictionReason) -> LevelChange:
        """Delete a WARM replica (its weights leave the CPU cache)."""
        replica = self.take_warm(replica_id)
        replica.level = "COLD"
        return LevelChange(replica, "WARM", "COLD", {}, reason)

    def _make_cpu_room(self, num_bytes: int, keep_warm_ids: Collection[str]) -> list[LevelChange] | None:
        """Drop WARM replicas smallest first until `num_bytes` fit in the CPU cache.

        Returns:
            The drops, or None (nothing dropped) when even dropping every droppable WARM
            replica would not make room.
        """
        if num_bytes <= self.cpu_cache.free_bytes:
            return []
        droppable = sorted(
            (r for r in self.warm.values() if not r.protected and r.replica_id not in keep_warm_ids),
            key=lambda r: (r.held_cpu_bytes, r.replica_id),
        )
        headroom_bytes = self.cpu_cache.capacity_bytes - self.cpu_cache.used_bytes
        if headroom_bytes + sum(r.held_cpu_bytes for r in droppable) < num_bytes:
            return None
        dropped = []
        for replica in droppable:
            if num_bytes <= self.cpu_cache.free_bytes:
                break
            dropped.append(self.drop_warm(replica.replica_id, "cpu_pressure"))
        return dropped

    def _add_hot(self, replica: WorkReplica) -> None:
        self.hot[replica.replica_id] = replica
        for gpu_id, num_bytes in replica.gpu_bytes.items():
            if num_bytes > 0:
                self.hot_ids_by_gpu[gpu_id].add(replica.replica_id)


def get_reserved_bytes(snapshot: NodeSnapshot) -> dict[int, int]:
    """Bytes held on each GPU of a node snapshot: pinned bytes plus HOT replicas' bytes."""
    reserved = {gpu_id: snapshot.pinned_gpu_bytes.get(gpu_id, 0) for gpu_id in snapshot.gpu_total_bytes}
    for replica in snapshot.replicas:
        for gpu_id, num_bytes in replica.gpu_bytes.items():
            reserved[gpu_id] += num_bytes
    return reserved
