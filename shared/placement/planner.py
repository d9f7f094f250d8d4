"""Cluster placement (seeds 000 and 002): one planning pass over one snapshot, as data.

    snapshot ──▶ ClusterPlanner ──ensure / scale_down / evict_*──▶ finish() ──▶ PlacementPlan

For each replica to place, every node's offer is ranked by candidate level
(DEPLOYED < CACHED_AND_FREE < FREE < CACHED_AND_FULL < FULL < CANT_ACCOMMODATE), then
fewest evictions, one GPU before several, a GPU not yet serving the same model, best fit
(least room left), then a seeded random key (`NodeCandidate.sort_key`). The winner is
applied to the planner's working copy (so later replicas of the same pass see it) and,
at the end, the net changes come out as a `PlacementPlan`.

The snapshot is never mutated. The planner is not thread-safe and holds no I/O: the
scheduler reads the KV buckets into a snapshot, plans, and commits the plan with CAS
(re-reading and re-planning on a conflict).

Speed. Asking every node's decision tree for every replica is too slow at 1,000 nodes:
`ClusterIndex` answers both levels from indexes that give exactly the same answer, and
builds a node's working copy only when a decision looks at that node in detail. Building
the planner is one pass over the snapshot's replicas with no object per replica; each
model's replica ids and GPUs are gathered on first use.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import replace

from shoal.shared.placement.cluster_index import ClusterIndex
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.gpu_index import GpuRoom
from shoal.shared.placement.node_eval import NodeCandidate, evaluate_node
from shoal.shared.placement.node_state import EvictionReason, LevelChange, WorkReplica
from shoal.shared.placement.plan import Eviction, Placement, PlacementPlan, Unplaced
from shoal.shared.placement.replicas import choose_replicas_to_remove, target_replica_ids
from shoal.shared.placement.snapshot import (
    CandidateLevel,
    ClusterSnapshot,
    ModelDemand,
    PlacedLevel,
    ReplicaSnapshot,
)

Origin = tuple[int, ReplicaSnapshot]
"""Where a replica was in the snapshot: (node position, the replica as read)."""


class ClusterPlanner:
    """One planning pass: place, scale down and evict against a snapshot, then `finish()`."""

    def __init__(
        self,
        cluster: ClusterSnapshot,
        *,
        config: PlacementConfig,
        rng: random.Random,
        clock: Callable[[], float],
    ) -> None:
        """Args:
        cluster: read, never mutated.
        config: policy knobs.
        rng: the only source of randomness (tie keys, new replica ids): same seed, same plan.
        clock: stamps new replicas' last access and the plan.
        """
        self._config = config
        self._rng = rng
        self._clock = clock
        nodes = cluster.nodes
        self._snapshots = nodes
        self._pos_by_node_id = {node.node_id: pos for pos, node in enumerate(nodes)}
        self._index = ClusterIndex(nodes, config, rng)
        self._node = self._index.node

        self._where: dict[str, tuple[int, PlacedLevel]] = {}
        """Replica id -> (node position, level) now; COLD replicas are absent."""
        self._snapshot_replicas_by_model: dict[str, tuple[list[ReplicaSnapshot], list[int]]] = {}
        """Model -> (its replicas in the snapshot, the node position of each)."""
        self._ids_by_model: dict[str, set[str]] = {}
        """Model -> ids of its HOT and WARM replicas (per model, on first use)."""
        self._crowded_by_model: dict[str, dict[int, int]] = {}
        """Model -> GPU slot -> number of its HOT replicas there (per model, on first use)."""
        self._touched: dict[str, WorkReplica] = {}
        """Replicas this pass changed (snapshot replicas that stayed put are absent)."""
        self._origin_pos: dict[str, int] = {}
        """Touched snapshot replicas -> their node position in the snapshot."""
        self._snapshot_replicas: list[dict[str, ReplicaSnapshot] | None] = [None] * len(nodes)
        self._reasons: dict[str, EvictionReason] = {}
        self._placed: dict[str, tuple[NodeCandidate, ModelDemand]] = {}
        self._unplaced: list[Unplaced] = []
        self._initial_desired = dict(cluster.desired_replicas)
        self._desired = dict(cluster.desired_replicas)
        # One pass over the snapshot's replicas, with no object per replica (the location
        # tuples are shared per node): where each is and each model's replicas.
        where, by_model = self._where, self._snapshot_replicas_by_model
        for pos, node in enumerate(nodes):
            hot: tuple[int, PlacedLevel] = (pos, "HOT")
            warm: tuple[int, PlacedLevel] = (pos, "WARM")
            for replica in node.replicas:
                of_model = by_model.get(replica.model)
                if of_model is None:
                    of_model = by_model[replica.model] = ([], [])
                of_model[0].append(replica)
                of_model[1].append(pos)
                where[replica.replica_id] = hot if replica.level == "HOT" else warm

    # ------------------------------------------------------------------ evaluation

    def get_candidate(self, demand: ModelDemand, replica_id: str) -> NodeCandidate:
        """The best node for one replica now, with its level across the cluster (no side effects)."""
        where = self._where.get(replica_id)
        if where is not None and where[1] == "HOT":
            node = self._node(where[0])
            return NodeCandidate(
                CandidateLevel.DEPLOYED, node.node_id, gpu_bytes=dict(node.hot[replica_id].gpu_bytes)
            )
        cached: NodeCandidate | None = None
        if where is not None:
            offer = evaluate_node(self._node(where[0]), demand, replica_id, self._config)
            if offer.level == CandidateLevel.FREE:
                return replace(offer, level=CandidateLevel.CACHED_AND_FREE)
            if offer.level == CandidateLevel.FULL:
                cached = replace(offer, level=CandidateLevel.CACHED_AND_FULL)
        crowded = self._get_crowded(demand.model)
        free = self._index.find_free(demand, crowded)
        if free is not None:
            return free
        if cached is not None:
            return cached
        return self._index.find_full(demand, replica_id, crowded)

    def get_node_candidates(self, demand: ModelDemand, replica_id: str) -> list[NodeCandidate]:
        """Every node's own offer, by the decision tree alone (slow: for explanations and tests)."""
        return [
            evaluate_node(self._node(pos), demand, replica_id, self._config)
            for pos in range(len(self._snapshots))
        ]

    def get_gpu_room(self, node_id: str, gpu_id: int) -> GpuRoom:
        """What one GPU offers now to a model with no replica on it: its free bytes and the
        bytes of each replica pressure may evict there (no side effects on the plan)."""
        return self._index.get_gpu_room(self._pos_by_node_id[node_id], gpu_id)

    def _get_ids(self, model: str) -> set[str]:
        """Ids of `model`'s HOT and WARM replicas now, built on first use from the snapshot
        (a new replica is placed only after this exists, and adds itself)."""
        ids = self._ids_by_model.get(model)
        if ids is None:
            where = self._where
            snapshot_replicas, _ = self._snapshot_replicas_by_model.get(model, ([], []))
            ids = self._ids_by_model[model] = {
                r.replica_id for r in snapshot_replicas if r.replica_id in where
            }
        return ids

    def _get_crowded(self, model: str) -> dict[int, int]:
        """GPU slot -> number of `model`'s HOT replicas there, built on first use like
        `_get_ids`: a snapshot replica that changed lives on a built node, one that did
        not still holds its snapshot GPUs."""
        crowded = self._crowded_by_model.get(model)
        if crowded is None:
            crowded = self._crowded_by_model[model] = {}
            get_built_node, slot_by_gpu_by_node = self._index.get_built_node, self._index.slots.slot_by_gpu
            replicas, positions = self._snapshot_replicas_by_model.get(model, ([], []))
            for replica, pos in zip(replicas, positions, strict=True):
                if get_built_node(pos) is None:  # untouched, where the snapshot has it
                    if replica.level != "HOT":
                        continue
                    gpu_bytes = replica.gpu_bytes
                else:  # may have moved, parked or left
                    where = self._where.get(replica.replica_id)
                    if where is None or where[1] != "HOT":
                        continue
                    pos = where[0]
                    gpu_bytes = self._node(pos).hot[replica.replica_id].gpu_bytes
                slot_by_gpu = slot_by_gpu_by_node[pos]
                for gpu_id in gpu_bytes:
                    if gpu_bytes[gpu_id] > 0:
                        slot = slot_by_gpu[gpu_id]
                        crowded[slot] = crowded.get(slot, 0) + 1
        return crowded

    def _update_crowded(self, model: str, pos: int, gpu_bytes: Mapping[int, int], delta: int) -> None:
        crowded = self._crowded_by_model.get(model)
        if crowded is None:
            return  # built from the current state on first use
        slot_by_gpu = self._index.slots.slot_by_gpu[pos]
        for gpu_id, num_bytes in gpu_bytes.items():
            if num_bytes > 0:
                slot = slot_by_gpu[gpu_id]
                count = crowded.get(slot, 0) + delta
                if count:
                    crowded[slot] = count
                else:
                    del crowded[slot]

    # ------------------------------------------------------------------ changes

    def place_replica(
        self,
        demand: ModelDemand,
        replica_id: str,
        *,
        keep_warm_ids: frozenset[str] = frozenset(),
        allow_evictions: bool = True,
    ) -> NodeCandidate:
        """Place one replica where `get_candidate` says, evicting what it names.

        Args:
            demand: the model's figure and flags.
            replica_id: a new id or one of the model's WARM ids.
            keep_warm_ids: WARM replicas not to drop for CPU room (this model's other targets).
            allow_evictions: False places the replica only where it fits without evicting.

        Returns:
            The candidate acted on; CANT_ACCOMMODATE, and a candidate that would evict when
            evictions are not allowed, are recorded as unplaced.
        """
        offer = self.get_candidate(demand, replica_id)
        if offer.level == CandidateLevel.DEPLOYED:
            return offer
        if offer.level == CandidateLevel.CANT_ACCOMMODATE:
            self._unplaced.append(
                Unplaced(demand.model, replica_id, "no node has room, even after evictions")
            )
            return offer
        if offer.eviction_ids and not allow_evictions:
            self._unplaced.append(Unplaced(demand.model, replica_id, "no node has room without evictions"))
            return offer
        self._get_crowded(demand.model)  # built before the change it then counts (see there)
        pos = self._pos_by_node_id[offer.node_id]
        node = self._node(pos)
        changed_gpu_ids = set(offer.gpu_bytes)
        for victim_id in offer.eviction_ids:
            changed_gpu_ids.update(
                self._record(pos, node.evict_hot(victim_id, "pressure", keep_warm_ids=keep_warm_ids))
            )
        where = self._where.get(replica_id)
        if where is None:
            replica = WorkReplica(
                replica_id=replica_id,
                model=demand.model,
                node_id=offer.node_id,
                level="COLD",
                cpu_bytes=demand.figure.weight_bytes,
                last_accessed=self._clock(),
            )
        else:
            replica = self._node(where[0]).take_warm(replica_id)  # CPU RAM only: no index moves
        self._touch(replica)
        # A WARM replica keeps the protection it came with: promoted and demoted again within
        # one plan, it must not become a CPU-pressure victim that it was not at the start.
        replica.protected = replica.protected or demand.popular
        node.place(replica, offer.gpu_bytes, whole_gpus=offer.kind != "fractional")
        self._where[replica_id] = (pos, "HOT")
        self._get_ids(demand.model).add(replica_id)
        self._touched[replica_id] = replica
        self._placed[replica_id] = (offer, demand)
        self._update_crowded(demand.model, pos, replica.gpu_bytes, +1)
        self._index.refresh(pos, changed_gpu_ids)
        return offer

    def ensure(self, demand: ModelDemand, *, allow_evictions: bool = True) -> list[NodeCandidate]:
        """Place replicas until `demand.desired_replicas` are HOT: WARM ids first (most
        recently used first), then new ids.

        Args:
            demand: the model and how many HOT replicas it wants.
            allow_evictions: True (a request or an operator asks): evict by pressure where
                needed, and replicas that cannot be placed even so lower the model's desired
                count (seed 002). False (refilling a model that is short of replicas, e.g.
                after pressure evictions): place only where there is room without
                evicting, and leave the desired count as it is (the rest waits for room).

        Returns:
            One candidate per replica it tried to place.
        """
        hot_ids, warm_ids = self._split_ids(demand.model)
        cached_ids = sorted(warm_ids, key=lambda rid: (-self._replica(rid).last_accessed, rid))
        targets = target_replica_ids(
            demand.desired_replicas, len(hot_ids), cached_ids, self._get_taken_ids(), self._rng
        )
        keep_warm_ids = frozenset(targets)
        offers = [
            self.place_replica(demand, rid, keep_warm_ids=keep_warm_ids, allow_evictions=allow_evictions)
            for rid in targets
        ]
        num_unplaced = sum(o.level == CandidateLevel.CANT_ACCOMMODATE for o in offers) if allow_evictions else 0
        self._desired[demand.model] = demand.desired_replicas - num_unplaced
        return offers

    def scale_down(self, model: str, num_replicas: int) -> list[str]:
        """Keep at most `num_replicas` replicas of `model` (HOT and WARM together): WARM ones
        are deleted first, then the least recently used HOT ones. Sets the desired count.

        Returns:
            The ids deleted.
        """
        num_replicas = max(0, num_replicas)
        self._desired[model] = num_replicas
        replicas = [self._replica(rid) for rid in sorted(self._get_ids(model))]
        removed_ids = choose_replicas_to_remove(replicas, len(replicas) - num_replicas)
        for replica_id in removed_ids:
            self._remove(replica_id, "scale_down", park=False)
        return removed_ids

    def evict_model(self, model: str) -> list[str]:
        """Explicit eviction of a whole model: desired count 0, every HOT replica parked
        WARM where CPU RAM allows, else deleted (seed 002).

        Returns:
            The HOT replicas evicted.
        """
        self._desired[model] = 0
        hot_ids, _ = self._split_ids(model)
        for replica_id in hot_ids:
            self._remove(replica_id, "explicit", park=True)
        return hot_ids

    def evict_replica(self, model: str, replica_id: str) -> bool:
        """Explicit eviction of one replica: a HOT one is parked (or deleted) and its model's
        desired count drops by one; a WARM one is deleted.

        Returns:
            False when `model` has no such replica.
        """
        if replica_id not in self._get_ids(model):
            return False
        was_hot = self._where[replica_id][1] == "HOT"
        self._remove(replica_id, "explicit", park=True)
        if was_hot:
            self._desired[model] = max(0, self._desired.get(model, 0) - 1)
        return True

    def sleep_replica(
        self, model: str, replica_id: str, *, reason: EvictionReason, park: bool, drop_weights: bool = False
    ) -> bool:
        """Put one HOT replica to sleep: parked WARM (`park`, where CPU RAM allows) or dropped to
        COLD. With `drop_weights` (a cold sleep) it parks with its weights dropped, charged
        ``parked_process_bytes`` of its node's CPU cache; CPU pressure ends it as any parked one. A preempted replica keeps its model's desired count (it comes back when room
        returns); one that sleeps because it is idle lowers it by one (it comes back on the
        next request).

        Returns:
            False when `model` has no such HOT replica.
        """
        if replica_id not in self._get_ids(model) or self._where[replica_id][1] != "HOT":
            return False
        self._remove(replica_id, reason, park=park, drop_weights=drop_weights)
        if reason == "idle":
            self._desired[model] = max(0, self._desired.get(model, 0) - 1)
        return True

    # ------------------------------------------------------------------ result

    def finish(self) -> PlacementPlan:
        """The net changes of the pass, in the order they were made."""
        placements: list[Placement] = []
        evictions: list[Eviction] = []
        for replica_id, replica in self._touched.items():
            before = self._get_origin(replica_id)
            after = self._where.get(replica_id)
            if after is not None and after[1] == "HOT":
                if before is not None and before[0] == after[0] and before[1].gpu_bytes == replica.gpu_bytes:
                    continue
                if before is not None and (before[1].level == "HOT" or before[0] != after[0]):
                    was_hot = before[1].level == "HOT"
                    to_level = "WARM" if was_hot and before[0] == after[0] else "COLD"
                    reason = self._reasons.get(replica_id, "moved") if was_hot else "moved"
                    evictions.append(self._eviction(before, to_level, reason))
                placements.append(self._placement(replica, before))
            elif before is not None:
                # Parked on another node than it started on (moved there HOT, then evicted within
                # this pass), it never ran there: it leaves its first node's CPU cache for good.
                to_level = "WARM" if after is not None and after[0] == before[0] else "COLD"
                if before[1].level != to_level:
                    evictions.append(self._eviction(before, to_level, self._reasons[replica_id],
                                                    drop_weights=replica.parked_bytes is not None))
        desired = {m: n for m, n in self._desired.items() if self._initial_desired.get(m) != n}
        return PlacementPlan(
            tuple(placements), tuple(evictions), tuple(self._unplaced), desired, self._clock()
        )

    def _placement(self, replica: WorkReplica, before: Origin | None) -> Placement:
        offer, demand = self._placed[replica.replica_id]
        pos = self._pos_by_node_id[replica.node_id]
        fraction: float | None = None
        if offer.kind != "multi_gpu":
            ((gpu_id, num_bytes),) = replica.gpu_bytes.items()
            total_bytes = self._snapshots[pos].gpu_total_bytes[gpu_id]
            fraction = self._config.clamp_gpu_memory_fraction(num_bytes / total_bytes)
        restored = before is not None and before[0] == pos
        assert offer.kind is not None, "a placement has an allocation kind"
        return Placement(
            model=replica.model,
            replica_id=replica.replica_id,
            node_id=replica.node_id,
            gpu_bytes=dict(replica.gpu_bytes),
            gpu_memory_fraction=fraction,
            kind=offer.kind,
            from_level="WARM" if restored else "COLD",
            candidate_level=offer.level,
            memory_source=demand.figure.source,
            cpu_bytes=replica.cpu_bytes,
            eviction_ids=offer.eviction_ids,
        )

    def _eviction(self, before: Origin, to_level: str, reason: EvictionReason, *, drop_weights: bool = False
                  ) -> Eviction:
        pos, replica = before
        assert to_level in ("WARM", "COLD"), f"an eviction ends WARM or COLD, not {to_level}"
        return Eviction(
            model=replica.model,
            replica_id=replica.replica_id,
            node_id=self._snapshots[pos].node_id,
            from_level=replica.level,
            to_level="WARM" if to_level == "WARM" else "COLD",
            freed_gpu_bytes=dict(replica.gpu_bytes),
            reason=reason,
            drop_weights=drop_weights and to_level == "WARM",
        )

    # ------------------------------------------------------------------ bookkeeping

    def _touch(self, replica: WorkReplica) -> None:
        """Note a replica about to change. The first time, a snapshot replica is still where
        the snapshot had it (untouched replicas never move): remember that node."""
        replica_id = replica.replica_id
        if replica_id not in self._touched:
            self._touched[replica_id] = replica
            where = self._where.get(replica_id)
            if where is not None:
                self._origin_pos[replica_id] = where[0]

    def _is_from_snapshot(self, replica_id: str) -> bool:
        """The snapshot had the replica (a known one this pass did not touch came from it)."""
        return replica_id in self._origin_pos or (
            replica_id in self._where and replica_id not in self._touched
        )

    def _get_origin(self, replica_id: str) -> Origin | None:
        pos = self._origin_pos.get(replica_id)
        return None if pos is None else (pos, self._get_snapshot_replica(pos, replica_id))

    def _get_snapshot_replica(self, pos: int, replica_id: str) -> ReplicaSnapshot:
        by_id = self._snapshot_replicas[pos]
        if by_id is None:
            by_id = self._snapshot_replicas[pos] = {r.replica_id: r for r in self._snapshots[pos].replicas}
        return by_id[replica_id]

    def _get_taken_ids(self) -> Collection[str]:
        """Every replica id of the snapshot or of this pass: each is either still placed
        (in `_where`) or touched."""
        return _TakenIds(self._where, self._touched)

    def _replica(self, replica_id: str) -> WorkReplica:
        pos, level = self._where[replica_id]
        node = self._node(pos)
        return node.hot[replica_id] if level == "HOT" else node.warm[replica_id]

    def _split_ids(self, model: str) -> tuple[list[str], list[str]]:
        """(HOT ids, WARM ids) of `model`, sorted."""
        ids = sorted(self._get_ids(model))
        return [r for r in ids if self._where[r][1] == "HOT"], [r for r in ids if self._where[r][1] == "WARM"]

    def _remove(self, replica_id: str, reason: EvictionReason, *, park: bool, drop_weights: bool = False) -> None:
        """Evict or delete one replica. One this pass created is deleted outright: parking
        it would leave a WARM copy of a replica that was never started."""
        pos, level = self._where[replica_id]
        node = self._node(pos)
        park = park and self._is_from_snapshot(replica_id)
        changes = (
            node.evict_hot(replica_id, reason, park=park,
                           parked_bytes=self._config.parked_process_bytes if drop_weights else None)
            if level == "HOT"
            else [node.drop_warm(replica_id, reason)]
        )
        self._index.refresh(pos, self._record(pos, changes))

    def _record(self, pos: int, changes: Sequence[LevelChange]) -> set[int]:
        """Book level changes on node `pos`; returns the GPUs whose memory they changed.

        Desired counts are not touched: a replica evicted by pressure leaves its model
        under-replicated, not scaled down (`ensure(..., allow_evictions=False)` refills it
        when room returns)."""
        changed_gpu_ids: set[int] = set()
        for change in changes:
            replica = change.replica
            self._touch(replica)
            self._reasons[replica.replica_id] = change.reason
            if change.from_level == "HOT":
                self._update_crowded(replica.model, pos, change.freed_gpu_bytes, -1)
                changed_gpu_ids.update(change.freed_gpu_bytes)
            if change.to_level == "WARM":
                self._where[replica.replica_id] = (pos, "WARM")
            else:
                del self._where[replica.replica_id]
                ids = self._ids_by_model.get(replica.model)
                if ids is not None:
                    ids.discard(replica.replica_id)
        return changed_gpu_ids


class _TakenIds(Collection[str]):
    """A read-only view of the ids in two collections, without copying them."""

    __slots__ = ("_first", "_second")

    def __init__(self, first: Collection[str], second: Collection[str]) -> None:
        self._first, self._second = first, second

    def __contains__(self, item: object) -> bool:
        return item in self._first or item in self._second

    def __iter__(self) -> Iterator[str]:
        yield from self._first
        yield from (item for item in self._second if item not in self._first)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def order_demands(demands: Sequence[ModelDemand]) -> list[ModelDemand]:
    """Placement order of one pass: popular models first, then the largest figures first
    (first-fit decreasing packs tighter), then by model key."""
    return sorted(demands, key=lambda d: (not d.popular, -d.figure.required_bytes, d.model))


def plan_placements(
    cluster: ClusterSnapshot,
    demands: Sequence[ModelDemand],
    *,
    config: PlacementConfig,
    rng: random.Random,
    clock: Callable[[], float],
) -> PlacementPlan:
    """Place every demand's missing replicas on `cluster` in one pass (see `ClusterPlanner`)."""
    planner = ClusterPlanner(cluster, config=config, rng=rng, clock=clock)
    for demand in order_demands(demands):
        planner.ensure(demand)
    return planner.finish()
