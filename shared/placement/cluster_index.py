"""Which node takes a replica, without asking every node: the planner's working copies of
the nodes and the indexes over them (`gpu_index`), kept in step by every change.

    ClusterIndex
      node(pos)             a node's working copy (`NodeWork`), built the first time a
                            decision looks at the node in detail
      find_free(...)        best offer needing no eviction   FreeGpuIndex, WholeGpuIndex
      find_full(...)        best offer needing evictions     ReclaimIndex, ClearingIndex
      refresh(pos, gpus)    after a change to a node's working copy

Both searches return exactly what the best of every node's `evaluate_node` would: the
indexes pick the node, and the winner's own decision tree gives the details (asserted to
agree). A model's own replicas are never its victims, which the model-independent FULL
indexes cannot see: the nodes already serving the model (`crowded` slots, few) are asked
directly, and so are nodes of mixed GPU sizes for whole-GPU shapes. The two FULL indexes
are built by the first decision that needs them, from the working copies already built
and from the snapshot for every other node.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Hashable, Iterator, Mapping, Sequence

from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.gpu_index import (
    ClearingIndex,
    FreeGpuIndex,
    GpuRoom,
    GpuSlots,
    ReclaimIndex,
    WholeGpuIndex,
)
from shoal.shared.placement.node_eval import (
    NodeCandidate,
    count_whole_gpus,
    evaluate_node,
    get_clearing_offers,
    get_free_gpu_order,
    get_multi_gpu_need,
    get_single_gpu_allocation,
    order_clearable,
    search_multi_gpu,
    search_single_gpu,
)
from shoal.shared.placement.node_state import NodeWork
from shoal.shared.placement.snapshot import CandidateLevel, ModelDemand, NodeSnapshot

SortKey = tuple[int, int, int, bool, int, float]
"""`NodeCandidate.sort_key`."""


class ClusterIndex:
    """Node working copies and the indexes over them, for one planning pass."""

    def __init__(self, nodes: Sequence[NodeSnapshot], config: PlacementConfig, rng: random.Random) -> None:
        """Args:
        nodes: the snapshot's nodes; read, never mutated.
        config: policy knobs.
        rng: draws one tie key per GPU (node by node, GPU index order), then one per node.
        """
        self._config = config
        self._snapshots = nodes
        self._nodes: list[NodeWork | None] = [None] * len(nodes)
        self._gpu_tie_keys = [{g: rng.random() for g in sorted(n.gpu_total_bytes)} for n in nodes]
        self._node_tie_keys = [rng.random() for _ in nodes]
        self.slots = GpuSlots(self._gpu_tie_keys, [node.gpu_total_bytes for node in nodes])
        self._gpu_sizes = tuple(dict.fromkeys(self.slots.total_bytes))
        self._min_gpu_bytes = min(self._gpu_sizes, default=0)
        self._max_gpus_per_node = max((len(node.gpu_total_bytes) for node in nodes), default=0)
        self._mixed_positions = [
            pos for pos, node in enumerate(nodes) if len(set(node.gpu_total_bytes.values())) > 1
        ]

        available = self._read_available_bytes()
        self._free_gpus = FreeGpuIndex(self.slots, available)
        self._whole_gpus = WholeGpuIndex()
        for pos, node in enumerate(nodes):
            slot_by_gpu = self.slots.slot_by_gpu[pos]
            totals, ties = node.gpu_total_bytes, self._gpu_tie_keys[pos]
            free_ids = [g for g, slot in slot_by_gpu.items() if available[slot] == totals[g]]
            if len(free_ids) >= 2:
                free_ids.sort(key=lambda g: (-totals[g], ties[g]))
                node_free_bytes = sum(available[slot] for slot in slot_by_gpu.values())
                free_totals = tuple(totals[g] for g in free_ids)
                self._whole_gpus.set_node(pos, free_totals, node_free_bytes, self._node_tie_keys[pos])
        self._reclaim: ReclaimIndex | None = None
        """Built by the first decision that needs evictions."""
        self._spanning_positions: set[int] = set()
        """Nodes whose snapshot has a replica on several GPUs (found with `_reclaim`)."""
        self._clearing: ClearingIndex | None = None
        """Built by the first multi-GPU decision that needs evictions."""

    def _read_available_bytes(self) -> list[int]:
        """Free bytes per slot in the snapshot (negative where the input over-commits)."""
        available = list(self.slots.total_bytes)
        for pos, node in enumerate(self._snapshots):
            slot_by_gpu = self.slots.slot_by_gpu[pos]
            for gpu_id, num_bytes in node.pinned_gpu_bytes.items():
                available[slot_by_gpu[gpu_id]] -= num_bytes
            for replica in node.replicas:
                gpu_bytes = replica.gpu_bytes  # empty for WARM replicas
                for gpu_id in gpu_bytes:
                    available[slot_by_gpu[gpu_id]] -= gpu_bytes[gpu_id]
        return available

    # ------------------------------------------------------------------ nodes

    def node(self, pos: int) -> NodeWork:
        """Node `pos`'s working copy, built from the snapshot on first use."""
        node = self._nodes[pos]
        if node is None:
            node = NodeWork(
                self._snapshots[pos],
                self._config.min_available_gpu_fraction,
                self._gpu_tie_keys[pos],
                self._node_tie_keys[pos],
            )
            self._nodes[pos] = node
        return node

    def get_built_node(self, pos: int) -> NodeWork | None:
        """Node `pos`'s working copy if one was built (else the snapshot is still true)."""
        return self._nodes[pos]

    def get_gpu_room(self, pos: int, gpu_id: int) -> GpuRoom:
        """What one GPU offers now to a model with no replica on it."""
        return self._get_reclaim_index().get_room(self.slots.slot_by_gpu[pos][gpu_id])

    # ------------------------------------------------------------------ searches

    def find_free(self, demand: ModelDemand, crowded: Collection[int]) -> NodeCandidate | None:
        """The best offer needing no evictions; `crowded`: slots of GPUs serving the model."""
        config = self._config

        def get_alloc_bytes(total_bytes: int) -> int | None:
            shape = get_single_gpu_allocation(demand, total_bytes, config)
            return None if shape is None else shape[1]

        hit = self._free_gpus.find_best_fit(get_alloc_bytes, crowded)
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
        offer = search_multi_gpu(self.node(best[2]), demand, config, free_only=True)
        assert offer is not None and offer.room_left_bytes == best[0], (
            "multi-GPU index disagrees with the node"
        )
        return offer

    def find_full(self, demand: ModelDemand, replica_id: str, crowded: Mapping[int, int]) -> NodeCandidate:
        """The best offer when no node has room without evictions (`find_free` found none).

        Args:
            demand: the model to place.
            replica_id: the replica (not HOT anywhere).
            crowded: GPU slot -> number of the model's HOT replicas there.
        """
        config = self._config
        allocs: dict[int, int | None] = {}
        for total_bytes in self._gpu_sizes:
            shape = get_single_gpu_allocation(demand, total_bytes, config)
            allocs[total_bytes] = None if shape is None else shape[1]
        best: tuple[SortKey, int] | None = None
        gpu_id: int | None = None  # set while the best is the index's one-GPU offer: ask only that GPU
        fit = self._get_reclaim_index().find_best_fit(allocs.__getitem__, crowded)
        if fit is not None:
            key: SortKey = (CandidateLevel.FULL, fit.num_victims, 0, False, fit.room_left_bytes, fit.tie_key)
            best, gpu_id = (key, fit.node_pos), fit.gpu_id
        for pos in self._get_crowded_nodes_to_ask(crowded, allocs, best):
            offer = search_single_gpu(self.node(pos), demand, config)
            if offer is not None and (best is None or (offer.sort_key, pos) < best):
                best, gpu_id = (offer.sort_key, pos), None
        if best is None or best[0][1] >= 2:  # one GPU with one eviction beats any multi-GPU offer
            for key, pos in self._find_full_multi_gpu(demand, crowded):
                if best is None or (key, pos) < best:
                    best, gpu_id = (key, pos), None
        if best is None:
            return NodeCandidate(CandidateLevel.CANT_ACCOMMODATE, "")
        node = self.node(best[1])
        if gpu_id is None:
            chosen: NodeCandidate | None = evaluate_node(node, demand, replica_id, config)
        else:
            chosen = search_single_gpu(node, demand, config, (gpu_id,))
        assert chosen is not None and chosen.sort_key == best[0], (
            f"the eviction indexes disagree with node {node.node_id}'s decision tree"
        )
        return chosen

    def _get_crowded_nodes_to_ask(
        self, crowded: Mapping[int, int], allocs: Mapping[int, int | None], best: tuple[SortKey, int] | None
    ) -> list[int]:
        """Nodes where the model already has replicas whose GPUs might beat `best`: the
        index counts the model's own replicas as victims, so it only bounds them."""
        if not crowded or (best is not None and best[0][:4] < (CandidateLevel.FULL, 1, 0, True)):
            return []  # one eviction without sharing a GPU with the model: nothing beats it
        reclaim = self._get_reclaim_index()
        positions = set()
        for slot in crowded:
            alloc_bytes = allocs[self.slots.total_bytes[slot]]
            if alloc_bytes is None:
                continue
            num_victims = reclaim.count_victims(slot, alloc_bytes)
            if num_victims is not None and (
                best is None or (CandidateLevel.FULL, num_victims, 0, True) <= best[0][:4]
            ):
                positions.add(self.slots.node_pos[slot])
        return sorted(positions)

    def _find_full_multi_gpu(
        self, demand: ModelDemand, crowded: Mapping[int, int]
    ) -> Iterator[tuple[SortKey, int]]:
        """Multi-GPU offers that need evictions: the best uniform node from the clearing
        index, then every node of mixed GPU sizes or serving the model, asked directly."""
        need_bytes, num_extra = get_multi_gpu_need(demand, self._config)
        if num_extra == 0 and demand.min_num_gpus <= 1 and need_bytes <= self._min_gpu_bytes:
            return  # one GPU covers the need on every node: no node makes a multi-GPU offer
        crowded_positions = {self.slots.node_pos[slot] for slot in crowded}
        num_gpus = self._max_gpus_per_node
        entry = self._get_clearing_index().find_best_fit(
            lambda total_bytes: count_whole_gpus(
                [total_bytes] * num_gpus, need_bytes, num_extra, demand.min_num_gpus
            ),
            crowded_positions,
        )
        if entry is not None:
            num_evictions, room_left_bytes, tie_key, pos = entry
            yield (CandidateLevel.FULL, num_evictions, 1, False, room_left_bytes, tie_key), pos
        for pos in sorted(crowded_positions.union(self._mixed_positions)):
            offer = search_multi_gpu(self.node(pos), demand, self._config)
            if offer is not None:
                yield offer.sort_key, pos

    # ------------------------------------------------------------------ upkeep

    def refresh(self, pos: int, gpu_ids: Collection[int]) -> None:
        """Bring the indexes in line with node `pos`'s working copy after `gpu_ids` changed."""
        if not gpu_ids:
            return
        node = self.node(pos)
        available = node.gpus.available_bytes_by_gpu
        slot_by_gpu = self.slots.slot_by_gpu[pos]
        for gpu_id in gpu_ids:
            slot = slot_by_gpu[gpu_id]
            self._free_gpus.update(slot, available[gpu_id])
            if self._reclaim is not None:
                self._reclaim.set_room(slot, available[gpu_id], tuple(node.get_evictable_sizes(gpu_id)))
        totals = node.gpus.total_bytes_by_gpu
        free_totals = tuple(totals[g] for g in get_free_gpu_order(node))
        self._whole_gpus.set_node(pos, free_totals, node.gpus.total_available_bytes, node.node_tie_key)
        if self._clearing is not None:
            self._set_clearing(pos)

    def _get_reclaim_index(self) -> ReclaimIndex:
        """The single-GPU eviction index, built on first use from the working copies of the
        nodes already built and from the snapshot for all others."""
        if self._reclaim is None:
            slots = self.slots
            evictable: list[list[int]] = [[] for _ in range(len(slots))]
            for pos, node in enumerate(self._snapshots):
                work = self._nodes[pos]
                slot_by_gpu = slots.slot_by_gpu[pos]
                if work is not None:
                    for gpu_id, slot in slot_by_gpu.items():
                        evictable[slot] = work.get_evictable_sizes(gpu_id)
                    continue
                for replica in node.replicas:
                    gpu_bytes = replica.gpu_bytes  # empty for WARM replicas
                    if len(gpu_bytes) > 1:
                        self._spanning_positions.add(pos)
                    if not replica.protected:
                        for gpu_id in gpu_bytes:
                            if gpu_bytes[gpu_id] > 0:
                                evictable[slot_by_gpu[gpu_id]].append(gpu_bytes[gpu_id])
            get_available_bytes = self._free_gpus.get_available_bytes
            self._reclaim = ReclaimIndex(
                slots,
                [get_available_bytes(slot) for slot in range(len(slots))],
                [tuple(sorted(sizes)) for sizes in evictable],
            )
        return self._reclaim

    def _get_clearing_index(self) -> ClearingIndex:
        """The multi-GPU eviction index, built on first use."""
        if self._clearing is None:
            self._clearing = ClearingIndex(
                (pos, *offers, self._node_tie_keys[pos])
                for pos in range(len(self._snapshots))
                if (offers := self._get_clearing_offers(pos)) is not None
            )
        return self._clearing

    def _set_clearing(self, pos: int) -> None:
        assert self._clearing is not None, "the clearing index is built"
        offers = self._get_clearing_offers(pos)
        if offers is not None:
            self._clearing.set_node(pos, *offers, self._node_tie_keys[pos])

    def _get_clearing_offers(self, pos: int) -> tuple[int, list[tuple[int, int, int]]] | None:
        """(GPU size, clearing offers) of node `pos`; None for a node of mixed GPU sizes.

        On a GPU that evictions can clear every replica is evictable, so the reclaim
        index's counts and bytes are its replicas'. A replica spanning several GPUs
        (counted once, freeing them all) needs the node's own replica ids."""
        totals = self._snapshots[pos].gpu_total_bytes
        total_bytes = self.slots.total_bytes[self.slots.slot_by_gpu[pos][next(iter(totals))]]
        if any(b != total_bytes for b in totals.values()):
            return None
        ties = self._gpu_tie_keys[pos]
        reclaim = self._get_reclaim_index()
        rooms = {g: reclaim.get_room(slot) for g, slot in self.slots.slot_by_gpu[pos].items()}
        node_free_bytes = sum(room.available_bytes for room in rooms.values())
        clearable = [g for g, room in rooms.items() if room.reclaimable_bytes == total_bytes]
        node = self._nodes[pos]
        if node is not None and any(len(r.gpu_bytes) > 1 for r in node.hot.values()):
            ordered = order_clearable((g, total_bytes, ties[g], node.hot_ids_by_gpu[g]) for g in clearable)
            replica_bytes: dict[Hashable, int] = {
                replica_id: sum(node.hot[replica_id].gpu_bytes.values())
                for g in clearable
                for replica_id in node.hot_ids_by_gpu[g]
            }
            return total_bytes, get_clearing_offers(ordered, replica_bytes, node_free_bytes)
        if node is None and pos in self._spanning_positions:
            self.node(pos)  # spans GPUs: read its replica ids from a working copy
            return self._get_clearing_offers(pos)
        # One replica per evictable size, each on this GPU only: no need for ids.
        taken_order = sorted(clearable, key=lambda g: (len(rooms[g].evictable_bytes), ties[g]))
        offers = []
        num_evictions = freed_bytes = 0
        for num_gpus, gpu_id in enumerate(taken_order, start=1):
            num_evictions += len(rooms[gpu_id].evictable_bytes)
            freed_bytes += total_bytes - rooms[gpu_id].available_bytes
            if num_gpus >= 2:
                offers.append(
                    (num_gpus, num_evictions, node_free_bytes + freed_bytes - num_gpus * total_bytes)
                )
        return total_bytes, offers
