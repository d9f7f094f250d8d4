"""Seed 000's ``Node.evaluate()``: where on one node a replica would go, and at what cost.

    Is the replica already HOT on this node?                      -> DEPLOYED
    Can one GPU hold it (single-GPU shape, see below)?
        search every GPU: the one needing the fewest evictions;
        among equals a GPU not already serving the model, then the
        best fit (least room left after placing);
        exact ties: a seeded random key per GPU
        found without evictions                                   -> FREE
    Otherwise (or when the single-GPU search needs evictions):
        whole GPUs, at least two: free GPUs first                  -> FREE
        then GPUs that evictions can clear                         -> FULL
    The single-GPU option needing evictions                       -> FULL
    Nothing                                                       -> CANT_ACCOMMODATE

Single-GPU shape on a GPU of T bytes, for a figure of R required bytes:
    fits        R <= T   (a guessed figure: weight bytes <= T, as seed 000 checks the raw size)
    fractional  R <  fraction_threshold x T   reserve R bytes
    full GPU    otherwise                      reserve all T bytes (the GPU must be empty)

Multi-GPU shape: whole GPUs whose totals add up to R (a guessed figure: to the weight
bytes, plus ``unknown_extra_gpus`` more, seed 000's ``ceil(size / gpu) + 1``), and at
least the model's ``min_num_gpus``.

Only HOT, non-dedicated replicas of other models that this plan did not place are evicted.
A FREE option always beats a FULL one, so a replica that fits somewhere without evictions
is never given a placement that evicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from shoal.shared.policy.cluster_state import CandidateLevel, ModelDemand
from shoal.shared.policy.node_state import NodeWork, WorkReplica
from shoal.shared.policy.placement_config import PlacementConfig

AllocationKind = Literal["fractional", "full_gpu", "multi_gpu"]

_KIND_RANK: dict[AllocationKind | None, int] = {"fractional": 0, "full_gpu": 0, "multi_gpu": 1, None: 2}
"""Same level, same number of evictions: one GPU beats several."""


@dataclass(frozen=True, slots=True)
class NodeCandidate:
    """One node's best offer for one replica."""

    level: CandidateLevel
    node_id: str
    kind: AllocationKind | None = None
    gpu_bytes: Mapping[int, int] = field(default_factory=dict)
    """What the replica would reserve, per GPU index."""
    eviction_ids: tuple[str, ...] = ()
    """HOT replicas of this node to evict first."""
    room_left_bytes: int = 0
    """Best fit: bytes left free after placing (on the GPU, or on the node for multi-GPU)."""
    tie_key: float = 0.0
    """Seeded random number breaking exact ties."""
    crowded: bool = False
    """The GPU already serves a replica of the same model (they would share its compute)."""

    @property
    def sort_key(self) -> tuple[int, int, int, bool, int, float]:
        """Lower is better: level, fewest evictions, one GPU before several, a GPU not yet
        serving the model, best fit, tie."""
        return (
            self.level,
            len(self.eviction_ids),
            _KIND_RANK[self.kind],
            self.crowded,
            self.room_left_bytes,
            self.tie_key,
        )


def get_single_gpu_allocation(
    demand: ModelDemand, gpu_total_bytes: int, config: PlacementConfig
) -> tuple[AllocationKind, int] | None:
    """Bytes one replica reserves on a GPU of `gpu_total_bytes`, or None when it cannot use one GPU."""
    figure = demand.figure
    if demand.min_num_gpus > 1:
        return None
    fit_bytes = figure.weight_bytes if figure.is_guess else figure.required_bytes
    if fit_bytes > gpu_total_bytes:
        return None
    if figure.required_bytes < config.fraction_threshold * gpu_total_bytes:
        return "fractional", figure.required_bytes
    return "full_gpu", gpu_total_bytes


def get_multi_gpu_need(demand: ModelDemand, config: PlacementConfig) -> tuple[int, int]:
    """Returns (bytes the chosen GPUs' totals must cover, extra whole GPUs on top)."""
    figure = demand.figure
    if figure.is_guess:
        return figure.weight_bytes, config.unknown_extra_gpus
    return figure.required_bytes, 0


def choose_victims(
    evictable: Sequence[WorkReplica], gpu_id: int, deficit_bytes: int, max_victims: int | None = None
) -> list[WorkReplica] | None:
    """The fewest replicas whose bytes on `gpu_id` cover `deficit_bytes`.

    With the count fixed at its minimum, each slot takes the smallest replica that still
    lets the remaining slots cover the deficit (least memory evicted), least recently
    used first among equal sizes.

    Returns:
        The victims, or None when evicting all of `evictable` would not be enough, or when
        it would take more than `max_victims`.
    """
    single = [r for r in evictable if r.gpu_bytes[gpu_id] >= deficit_bytes]
    if single:  # one victim is enough: the smallest that is, least recently used first
        return [min(single, key=lambda r: (r.gpu_bytes[gpu_id], r.last_accessed, r.replica_id))]
    if max_victims is not None and max_victims < 2:
        return None
    ascending = sorted(evictable, key=lambda r: (r.gpu_bytes[gpu_id], r.last_accessed, r.replica_id))
    covered_bytes, num_victims = 0, 0
    for replica in reversed(ascending):
        if covered_bytes >= deficit_bytes:
            break
        covered_bytes += replica.gpu_bytes[gpu_id]
        num_victims += 1
    if covered_bytes < deficit_bytes or (max_victims is not None and num_victims > max_victims):
        return None
    victims: list[WorkReplica] = []
    still_needed = deficit_bytes
    for slot in range(num_victims):
        num_after = num_victims - slot - 1
        sizes = [r.gpu_bytes[gpu_id] for r in ascending]
        top_after = sum(sizes[len(sizes) - num_after :]) if num_after else 0
        top_after_plus_one = sum(sizes[len(sizes) - num_after - 1 :])
        for position, num_bytes in enumerate(sizes):
            # The largest `num_after` of the others: the top ones, unless this is among them.
            is_top = position >= len(sizes) - num_after
            best_after = top_after_plus_one - num_bytes if is_top else top_after
            if num_bytes + best_after >= still_needed:
                victims.append(ascending.pop(position))
                still_needed -= num_bytes
                break
    assert len(victims) == num_victims, f"GPU {gpu_id}: chose {len(victims)} victims, needed {num_victims}"
    return victims


def search_single_gpu(node: NodeWork, demand: ModelDemand, config: PlacementConfig) -> NodeCandidate | None:
    """The GPU of `node` taking one replica with the fewest evictions, then a GPU not yet
    serving the model, then best fit, then the seeded tie key."""
    best_key: tuple[int, bool, int, float] | None = None
    best: tuple[AllocationKind, int, int, tuple[str, ...]] | None = None
    shapes: dict[int, tuple[AllocationKind, int] | None] = {}
    for gpu_id, total_bytes in node.gpus.total_bytes_by_gpu.items():
        if total_bytes not in shapes:
            shapes[total_bytes] = get_single_gpu_allocation(demand, total_bytes, config)
        shape = shapes[total_bytes]
        if shape is None:
            continue
        kind, alloc_bytes = shape
        available_bytes = node.gpus.available_bytes_by_gpu[gpu_id]
        if available_bytes >= alloc_bytes:
            victim_ids: tuple[str, ...] = ()
            room_bytes = available_bytes - alloc_bytes
        elif best_key is not None and best_key[0] == 0:
            continue  # an option without evictions exists; evicting cannot beat it
        else:
            max_victims = None if best_key is None else best_key[0]  # more cannot win
            evictable = node.get_evictable_on_gpu(gpu_id, demand.model)
            victims = choose_victims(evictable, gpu_id, alloc_bytes - available_bytes, max_victims)
            if victims is None:
                continue
            victim_ids = tuple(v.replica_id for v in victims)
            room_bytes = available_bytes + sum(v.gpu_bytes[gpu_id] for v in victims) - alloc_bytes
        key = (
            len(victim_ids),
            node.serves_model_on_gpu(gpu_id, demand.model),
            room_bytes,
            node.gpu_tie_keys[gpu_id],
        )
        if best_key is None or key < best_key:
            best_key, best = key, (kind, gpu_id, alloc_bytes, victim_ids)
    if best_key is None or best is None:
        return None
    kind, gpu_id, alloc_bytes, victim_ids = best
    return NodeCandidate(
        CandidateLevel.FULL if victim_ids else CandidateLevel.FREE,
        node.node_id,
        kind,
        {gpu_id: alloc_bytes},
        victim_ids,
        best_key[2],
        best_key[3],
        best_key[1],
    )


def count_whole_gpus(
    ordered_totals: Sequence[int], need_bytes: int, num_extra: int, num_min: int
) -> int | None:
    """How many whole GPUs, taken in the given order, one multi-GPU replica takes.

    Args:
        ordered_totals: the candidate GPUs' sizes, in the order they would be taken.
        need_bytes: the taken GPUs' sizes must add up to this.
        num_extra: GPUs taken beyond those covering `need_bytes`.
        num_min: at least this many GPUs.

    Returns:
        The count (always >= 2: one GPU is the single-GPU search's job), or None when the
        candidates cannot provide it.
    """
    covered_bytes, num_covering = 0, 0
    for total_bytes in ordered_totals:
        if covered_bytes >= need_bytes:
            break
        covered_bytes += total_bytes
        num_covering += 1
    if covered_bytes < need_bytes:
        return None
    num_gpus = max(num_covering + num_extra, num_min)
    if num_gpus < 2 or num_gpus > len(ordered_totals):
        return None
    return num_gpus


def get_free_gpu_order(node: NodeWork) -> list[int]:
    """The node's entirely free GPUs in the order a multi-GPU replica takes them: largest
    first, exact ties by the seeded key."""
    totals = node.gpus.total_bytes_by_gpu
    free_ids = [g for g in totals if node.gpus.is_whole_gpu_free(g)]
    return sorted(free_ids, key=lambda g: (-totals[g], node.gpu_tie_keys[g]))


def search_multi_gpu(
    node: NodeWork, demand: ModelDemand, config: PlacementConfig, *, free_only: bool = False
) -> NodeCandidate | None:
    """Whole GPUs of `node` for one replica: entirely free GPUs if they suffice (FREE), else
    free GPUs plus GPUs that evictions can clear, fewest evictions first (FULL)."""
    gpus = node.gpus
    need_bytes, num_extra = get_multi_gpu_need(demand, config)
    totals = gpus.total_bytes_by_gpu
    if num_extra == 0 and demand.min_num_gpus <= 1 and need_bytes <= min(totals.values()):
        return None  # any one GPU covers the need: that is the single-GPU search's job
    free_ids = get_free_gpu_order(node)
    num_gpus = count_whole_gpus([totals[g] for g in free_ids], need_bytes, num_extra, demand.min_num_gpus)
    if num_gpus is not None:
        chosen = free_ids[:num_gpus]
        taken_bytes = sum(totals[g] for g in chosen)
        return NodeCandidate(
            CandidateLevel.FREE,
            node.node_id,
            "multi_gpu",
            {g: totals[g] for g in chosen},
            (),
            gpus.total_available_bytes - taken_bytes,
            node.node_tie_key,
        )
    if free_only:
        return None
    cost_by_gpu: dict[int, set[str]] = {g: set() for g in free_ids}
    for gpu_id in totals:
        if gpu_id not in cost_by_gpu and node.is_gpu_clearable(gpu_id, demand.model):
            cost_by_gpu[gpu_id] = set(node.hot_ids_by_gpu[gpu_id])
    ordered = sorted(cost_by_gpu, key=lambda g: (len(cost_by_gpu[g]), -totals[g], node.gpu_tie_keys[g]))
    num_gpus = count_whole_gpus([totals[g] for g in ordered], need_bytes, num_extra, demand.min_num_gpus)
    if num_gpus is None:
        return None
    chosen = ordered[:num_gpus]
    eviction_ids = sorted(set().union(*(cost_by_gpu[g] for g in chosen)))
    freed_bytes = sum(b for rid in eviction_ids for b in node.hot[rid].gpu_bytes.values())
    taken_bytes = sum(totals[g] for g in chosen)
    return NodeCandidate(
        CandidateLevel.FULL,
        node.node_id,
        "multi_gpu",
        {g: totals[g] for g in chosen},
        tuple(eviction_ids),
        gpus.total_available_bytes + freed_bytes - taken_bytes,
        node.node_tie_key,
    )


def evaluate_node(
    node: NodeWork, demand: ModelDemand, replica_id: str, config: PlacementConfig
) -> NodeCandidate:
    """The decision tree in the module docstring, for one replica on one node."""
    if replica_id in node.hot:
        return NodeCandidate(
            CandidateLevel.DEPLOYED, node.node_id, gpu_bytes=dict(node.hot[replica_id].gpu_bytes)
        )
    single = search_single_gpu(node, demand, config)
    if single is not None and single.level == CandidateLevel.FREE:
        return single
    multi = search_multi_gpu(node, demand, config)
    options = [c for c in (single, multi) if c is not None]
    if not options:
        return NodeCandidate(CandidateLevel.CANT_ACCOMMODATE, node.node_id)
    return min(options, key=lambda c: c.sort_key)
