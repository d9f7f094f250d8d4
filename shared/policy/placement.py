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

Speed. Looking at every GPU of every node per replica is too slow at 1,000 nodes, so the
FREE level is answered from two indexes that give exactly the answer of the full scan:

* single GPU: `FreeGpuIndex`, every GPU sorted by free bytes per GPU size (bisect);
* multi-GPU: `WholeGpuIndex`, nodes grouped by the sizes of their entirely free GPUs,
  each group sorted by the node's free bytes (the best fit of a group is its first node).

Only when no node has room without evictions (the FULL level) are all nodes evaluated.
Node working copies are built lazily, the first time a node is looked at in detail.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from shoal.shared.policy.cluster_state import (
    CandidateLevel,
    ClusterSnapshot,
    ModelDemand,
    PlacedLevel,
    ReplicaSnapshot,
)
from shoal.shared.policy.gpu_index import FreeGpuIndex, WholeGpuIndex
from shoal.shared.policy.node_eval import (
    NodeCandidate,
    count_whole_gpus,
    evaluate_node,
    get_free_gpu_order,
    get_multi_gpu_need,
    get_single_gpu_allocation,
    search_multi_gpu,
)
from shoal.shared.policy.node_state import (
    EvictionReason,
    LevelChange,
    NodeWork,
    WorkReplica,
    get_reserved_bytes,
)
from shoal.shared.policy.placement_config import PlacementConfig
from shoal.shared.policy.placement_plan import Eviction, Placement, PlacementPlan, Unplaced
from shoal.shared.policy.replica_plan import choose_replicas_to_remove, target_replica_ids

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
        self._snapshots = cluster.nodes
        self._pos_by_node_id = {node.node_id: pos for pos, node in enumerate(cluster.nodes)}
        self._nodes: list[NodeWork | None] = [None] * len(cluster.nodes)
        self._gpu_tie_keys = [{g: rng.random() for g in sorted(n.gpu_total_bytes)} for n in cluster.nodes]
        self._node_tie_keys = [rng.random() for _ in cluster.nodes]

        self._initial: dict[str, Origin] = {}
        """Replica id -> (node position, the replica) in the snapshot."""
        self._where: dict[str, tuple[int, PlacedLevel]] = {}
        """Replica id -> (node position, level) now; COLD replicas are absent."""
        self._ids_by_model: dict[str, set[str]] = {}
        self._crowded_by_model: dict[str, dict[tuple[int, int], int]] = {}
        """Model -> (node position, GPU index) -> number of its HOT replicas there."""
        self._touched: dict[str, WorkReplica] = {}
        self._reasons: dict[str, EvictionReason] = {}
        self._placed: dict[str, tuple[NodeCandidate, ModelDemand]] = {}
        self._unplaced: list[Unplaced] = []
        self._initial_desired = dict(cluster.desired_replicas)
        self._desired = dict(cluster.desired_replicas)

        self._free_gpus = FreeGpuIndex()
        self._whole_gpus = WholeGpuIndex()
        for pos, node in enumerate(cluster.nodes):
            for replica in node.replicas:
                self._initial[replica.replica_id] = (pos, replica)
                self._where[replica.replica_id] = (pos, replica.level)
                self._ids_by_model.setdefault(replica.model, set()).add(replica.replica_id)
                crowded = self._crowded_by_model.setdefault(replica.model, {})
                for gpu_id, num_bytes in replica.gpu_bytes.items():
                    if num_bytes > 0:
                        crowded[(pos, gpu_id)] = crowded.get((pos, gpu_id), 0) + 1
            reserved = get_reserved_bytes(node)
            available = {g: total - reserved[g] for g, total in node.gpu_total_bytes.items()}
            self._free_gpus.add_node(pos, node.gpu_total_bytes, available, self._gpu_tie_keys[pos])
            ties = self._gpu_tie_keys[pos]
            free_ids = sorted(
                (g for g, total in node.gpu_total_bytes.items() if available[g] == total),
                key=lambda g: (-node.gpu_total_bytes[g], ties[g]),
            )
            free_totals = tuple(node.gpu_total_bytes[g] for g in free_ids)
            self._whole_gpus.set_node(pos, free_totals, sum(available.values()), self._node_tie_keys[pos])
        self._free_gpus.freeze()
        self._taken_ids = set(self._initial)

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
        free = self._find_free(demand)
        if free is not None:
            return free
        if cached is not None:
            return cached
        return self._find_full(demand, replica_id)

    def get_node_candidates(self, demand: ModelDemand, replica_id: str) -> list[NodeCandidate]:
        """Every node's own offer, by the decision tree alone (slow: for explanations and tests)."""
        return [
            evaluate_node(self._node(pos), demand, replica_id, self._config)
            for pos in range(len(self._nodes))
        ]

    def _find_free(self, demand: ModelDemand) -> NodeCandidate | None:
        """The best offer needing no evictions, from the indexes."""
        config = self._config

        def get_alloc_bytes(total_bytes: int) -> int | None:
            shape = get_single_gpu_allocation(demand, total_bytes, config)
            return None if shape is None else shape[1]

        hit = self._free_gpus.find_best_fit(get_alloc_bytes, self._crowded_by_model.get(demand.model, {}))
        if hit is not None:
            shape = get_single_gpu_allocation(
                demand, self._snapshots[hit.node_pos].gpu_total_bytes[hit.gpu_id], config
            )
            assert shape is not None, "the index only returns GPUs the replica can use"
            return NodeCandidate(
                CandidateLevel.FREE,
                self._snapshots[hit.node_pos].node_id,
                shape[0],
                {hit.gpu_id: hit.alloc_bytes},
                (),
                hit.room_left_bytes,
                hit.tie_key,
                hit.crowded,
            )
        need_bytes, num_extra = get_multi_gpu_need(demand, config)
        best = self._whole_gpus.find_best_fit(
            lambda free_totals: count_whole_gpus(free_totals, need_bytes, num_extra, demand.min_num_gpus)
        )
        if best is None:
            return None
        offer = search_multi_gpu(self._node(best[2]), demand, config, free_only=True)
        assert offer is not None and offer.room_left_bytes == best[0], (
            "multi-GPU index disagrees with the node"
        )
        return offer

    def _update_crowded(self, model: str, pos: int, gpu_bytes: Mapping[int, int], delta: int) -> None:
        crowded = self._crowded_by_model.setdefault(model, {})
        for gpu_id, num_bytes in gpu_bytes.items():
            if num_bytes > 0:
                count = crowded.get((pos, gpu_id), 0) + delta
                if count:
                    crowded[(pos, gpu_id)] = count
                else:
                    del crowded[(pos, gpu_id)]

    def _find_full(self, demand: ModelDemand, replica_id: str) -> NodeCandidate:
        """The best offer over every node when none has room without evictions."""
        best = NodeCandidate(CandidateLevel.CANT_ACCOMMODATE, "")
        for pos in range(len(self._nodes)):
            offer = evaluate_node(self._node(pos), demand, replica_id, self._config)
            assert offer.level != CandidateLevel.FREE, f"the free indexes missed node {offer.node_id}"
            if offer.sort_key < best.sort_key:
                best = offer
        return best

    # ------------------------------------------------------------------ changes

    def place_replica(
        self, demand: ModelDemand, replica_id: str, *, keep_warm_ids: frozenset[str] = frozenset()
    ) -> NodeCandidate:
        """Place one replica where `get_candidate` says, evicting what it names.

        Args:
            demand: the model's figure and flags.
            replica_id: a new id or one of the model's WARM ids.
            keep_warm_ids: WARM replicas not to drop for CPU room (this model's other targets).

        Returns:
            The candidate acted on; CANT_ACCOMMODATE is recorded as unplaced.
        """
        offer = self.get_candidate(demand, replica_id)
        if offer.level == CandidateLevel.DEPLOYED:
            return offer
        if offer.level == CandidateLevel.CANT_ACCOMMODATE:
            self._unplaced.append(
                Unplaced(demand.model, replica_id, "no node has room, even after evictions")
            )
            return offer
        pos = self._pos_by_node_id[offer.node_id]
        node = self._node(pos)
        for victim_id in offer.eviction_ids:
            self._record(pos, node.evict_hot(victim_id, "pressure", keep_warm_ids=keep_warm_ids))
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
            replica = self._node(where[0]).take_warm(replica_id)
            self._refresh(where[0])
        replica.dedicated = demand.dedicated
        node.place(replica, offer.gpu_bytes, whole_gpus=offer.kind != "fractional")
        self._where[replica_id] = (pos, "HOT")
        self._ids_by_model.setdefault(demand.model, set()).add(replica_id)
        self._taken_ids.add(replica_id)
        self._touched[replica_id] = replica
        self._placed[replica_id] = (offer, demand)
        self._update_crowded(demand.model, pos, replica.gpu_bytes, +1)
        self._refresh(pos)
        return offer

    def ensure(self, demand: ModelDemand) -> list[NodeCandidate]:
        """Place replicas until `demand.desired_replicas` are HOT: WARM ids first (most
        recently used first), then new ids. Replicas that cannot be placed lower the
        model's desired count (seed 002).

        Returns:
            One candidate per replica it tried to place.
        """
        hot_ids, warm_ids = self._split_ids(demand.model)
        cached_ids = sorted(warm_ids, key=lambda rid: (-self._replica(rid).last_accessed, rid))
        targets = target_replica_ids(
            demand.desired_replicas, len(hot_ids), cached_ids, self._taken_ids, self._rng
        )
        keep_warm_ids = frozenset(targets)
        offers = [self.place_replica(demand, rid, keep_warm_ids=keep_warm_ids) for rid in targets]
        num_unplaced = sum(o.level == CandidateLevel.CANT_ACCOMMODATE for o in offers)
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
        replicas = [self._replica(rid) for rid in sorted(self._ids_by_model.get(model, ()))]
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
        if replica_id not in self._ids_by_model.get(model, ()):
            return False
        was_hot = self._where[replica_id][1] == "HOT"
        self._remove(replica_id, "explicit", park=True)
        if was_hot:
            self._desired[model] = max(0, self._desired.get(model, 0) - 1)
        return True

    # ------------------------------------------------------------------ result

    def finish(self) -> PlacementPlan:
        """The net changes of the pass, in the order they were made."""
        placements: list[Placement] = []
        evictions: list[Eviction] = []
        for replica_id, replica in self._touched.items():
            before = self._initial.get(replica_id)
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
                to_level = "COLD" if after is None else "WARM"
                if before[1].level != to_level:
                    evictions.append(self._eviction(before, to_level, self._reasons[replica_id]))
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
            dedicated=replica.dedicated,
            eviction_ids=offer.eviction_ids,
        )

    def _eviction(self, before: Origin, to_level: str, reason: EvictionReason) -> Eviction:
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
        )

    # ------------------------------------------------------------------ bookkeeping

    def _node(self, pos: int) -> NodeWork:
        node = self._nodes[pos]
        if node is None:
            snapshot = self._snapshots[pos]
            node = NodeWork(
                snapshot,
                self._config.min_available_gpu_fraction,
                self._gpu_tie_keys[pos],
                self._node_tie_keys[pos],
            )
            self._nodes[pos] = node
        return node

    def _replica(self, replica_id: str) -> WorkReplica:
        pos, level = self._where[replica_id]
        node = self._node(pos)
        return node.hot[replica_id] if level == "HOT" else node.warm[replica_id]

    def _split_ids(self, model: str) -> tuple[list[str], list[str]]:
        """(HOT ids, WARM ids) of `model`, sorted."""
        ids = sorted(self._ids_by_model.get(model, ()))
        return [r for r in ids if self._where[r][1] == "HOT"], [r for r in ids if self._where[r][1] == "WARM"]

    def _remove(self, replica_id: str, reason: EvictionReason, *, park: bool) -> None:
        """Evict or delete one replica. One this pass created is deleted outright: parking
        it would leave a WARM copy of a replica that was never started."""
        pos, level = self._where[replica_id]
        node = self._node(pos)
        park = park and replica_id in self._initial
        changes = (
            node.evict_hot(replica_id, reason, park=park)
            if level == "HOT"
            else [node.drop_warm(replica_id, reason)]
        )
        self._record(pos, changes)
        self._refresh(pos)

    def _record(self, pos: int, changes: Sequence[LevelChange]) -> None:
        for change in changes:
            replica = change.replica
            self._touched.setdefault(replica.replica_id, replica)
            self._reasons[replica.replica_id] = change.reason
            if change.from_level == "HOT":
                self._update_crowded(replica.model, pos, change.freed_gpu_bytes, -1)
            if change.to_level == "WARM":
                self._where[replica.replica_id] = (pos, "WARM")
            else:
                del self._where[replica.replica_id]
                self._ids_by_model[replica.model].discard(replica.replica_id)
            if change.reason == "pressure" and change.from_level == "HOT" and replica.model in self._desired:
                # A preempted model is not re-placed by the next pass (that would evict back
                # and thrash); its next request asks for it again.
                self._desired[replica.model] = max(0, self._desired[replica.model] - 1)

    def _refresh(self, pos: int) -> None:
        """Bring the indexes in line with node `pos`'s working copy."""
        node = self._node(pos)
        available = node.gpus.available_bytes_by_gpu
        for gpu_id, available_bytes in available.items():
            self._free_gpus.update(pos, gpu_id, available_bytes)
        totals = node.gpus.total_bytes_by_gpu
        free_totals = tuple(totals[g] for g in get_free_gpu_order(node))
        self._whole_gpus.set_node(pos, free_totals, node.gpus.total_available_bytes, node.node_tie_key)


def order_demands(demands: Sequence[ModelDemand]) -> list[ModelDemand]:
    """Placement order of one pass: dedicated models first, then the largest figures first
    (first-fit decreasing packs tighter), then by model key."""
    return sorted(demands, key=lambda d: (not d.dedicated, -d.figure.required_bytes, d.model))


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
