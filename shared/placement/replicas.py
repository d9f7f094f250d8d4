"""Replica bookkeeping of seed 002: which ids to place, which to remove, and the apply() delta.

`build_delta` compares the recorded replicas with the planned ones and lists the node
operations that turn one into the other, in the order they must run:

    to_cache    HOT -> WARM on the same node   frees GPU memory      \\ first: a from_cache
    delete      HOT/WARM -> gone               frees GPU or CPU RAM  /  or create may need it
    from_cache  WARM -> HOT on the same node   takes GPU memory
    create      new, or moved to another node  takes GPU memory
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from shoal.shared.placement.plan import PlacementPlan

DeltaOp = Literal["to_cache", "delete", "from_cache", "create"]


class RankedReplica(Protocol):
    """What removal ranking reads of a replica."""

    @property
    def replica_id(self) -> str: ...
    @property
    def level(self) -> str: ...
    @property
    def last_accessed(self) -> float: ...


def new_replica_id(rng: random.Random, taken_ids: Collection[str]) -> str:
    """A uuid4 hex id drawn from `rng` that is not in `taken_ids`."""
    while True:
        replica_id = uuid.UUID(int=rng.getrandbits(128), version=4).hex
        if replica_id not in taken_ids:
            return replica_id


def target_replica_ids(
    desired_replicas: int,
    num_deployed: int,
    cached_ids: Sequence[str],
    taken_ids: Collection[str],
    rng: random.Random,
) -> list[str]:
    """Ids of the replicas to place so that `desired_replicas` are HOT (seed 002).

    Args:
        desired_replicas: HOT replicas wanted.
        num_deployed: HOT replicas there are.
        cached_ids: WARM replicas of the model, best to promote first.
        taken_ids: every replica id in use; new ids avoid them.
        rng: source of new ids.

    Returns:
        ``max(0, desired - deployed)`` ids: cached ids first, then new uuid4 hex ids.
    """
    num_needed = max(0, desired_replicas - num_deployed)
    targets = list(cached_ids[:num_needed])
    while len(targets) < num_needed:
        replica_id = new_replica_id(rng, taken_ids)
        if replica_id not in targets:
            targets.append(replica_id)
    return targets


def choose_replicas_to_remove(replicas: Sequence[RankedReplica], num_to_remove: int) -> list[str]:
    """Scale down: WARM replicas go first (they serve nothing), then HOT ones least
    recently used first; never more than there are, never fewer than zero."""
    ranked = sorted(replicas, key=lambda r: (r.level != "WARM", r.last_accessed, r.replica_id))
    return [r.replica_id for r in ranked[: max(0, num_to_remove)]]


@dataclass(frozen=True, slots=True)
class ReplicaLocation:
    """Where a replica is (recorded) or should be (planned); absent means COLD."""

    replica_id: str
    model: str
    node_id: str
    level: Literal["HOT", "WARM"]
    gpu_bytes: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ReplicaDelta:
    """Node operations turning the recorded replicas into the planned ones."""

    to_cache: tuple[ReplicaLocation, ...] = ()
    """HOT replicas to park WARM on their node (the recorded location)."""
    delete: tuple[ReplicaLocation, ...] = ()
    """Replicas to stop (the recorded location)."""
    from_cache: tuple[ReplicaLocation, ...] = ()
    """WARM replicas to bring back onto GPUs (the planned location)."""
    create: tuple[ReplicaLocation, ...] = ()
    """Replicas to start (the planned location)."""

    def steps(self) -> Iterator[tuple[DeltaOp, ReplicaLocation]]:
        """Every operation, in the order they must run (see the module docstring)."""
        for op in ("to_cache", "delete", "from_cache", "create"):
            for location in getattr(self, op):
                yield op, location

    @property
    def is_empty(self) -> bool:
        return not (self.to_cache or self.delete or self.from_cache or self.create)


def build_delta(
    recorded: Mapping[str, ReplicaLocation], planned: Mapping[str, ReplicaLocation]
) -> ReplicaDelta:
    """seed 002's ``build()``: diff recorded against planned replicas, keyed by replica id.

    A replica planned on a node other than its recorded one is deleted there and created
    here (weights parked in one node's RAM cannot be restored on another). A HOT replica
    planned HOT on other GPUs of its node is parked and restored.
    """
    to_cache: list[ReplicaLocation] = []
    delete: list[ReplicaLocation] = []
    from_cache: list[ReplicaLocation] = []
    create: list[ReplicaLocation] = []
    for replica_id in sorted(recorded.keys() | planned.keys()):
        before = recorded.get(replica_id)
        after = planned.get(replica_id)
        if before == after:
            continue
        if before is None:
            assert after is not None and after.level == "HOT", (
                f"replica {replica_id}: planned WARM, never recorded"
            )
            create.append(after)
            continue
        if after is None or after.node_id != before.node_id:
            delete.append(before)
            if after is not None and after.level == "HOT":
                create.append(after)
            continue
        if after.level == "WARM":
            if before.level == "HOT":
                to_cache.append(before)
            continue
        if before.level == "HOT":
            to_cache.append(before)
        from_cache.append(after)
    return ReplicaDelta(tuple(to_cache), tuple(delete), tuple(from_cache), tuple(create))


def get_planned_locations(
    recorded: Mapping[str, ReplicaLocation], plan: PlacementPlan
) -> dict[str, ReplicaLocation]:
    """The replicas as they will be once `plan` is carried out (input to `build_delta`)."""
    planned = dict(recorded)
    for eviction in plan.evictions:
        if eviction.to_level == "COLD":
            planned.pop(eviction.replica_id, None)
        else:
            planned[eviction.replica_id] = ReplicaLocation(
                eviction.replica_id, eviction.model, eviction.node_id, "WARM"
            )
    for placement in plan.placements:
        planned[placement.replica_id] = ReplicaLocation(
            placement.replica_id, placement.model, placement.node_id, "HOT", dict(placement.gpu_bytes)
        )
    return planned
