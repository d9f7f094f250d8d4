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

Only HOT, non-protected replicas of other models that this plan did not place are evicted.
A FREE option always beats a FULL one, so a replica that fits somewhere without evictions
is never given a placement that evicts.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.node_state import NodeWork, WorkReplica
from shoal.shared.placement.snapshot import CandidateLevel, ModelDemand

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


def pick_victims(
    sizes: Sequence[int], deficit_bytes: int, max_victims: int | None = None
) -> list[int] | None:
    """Positions in `sizes` (ascending) of the fewest entries whose sum covers `deficit_bytes`.

    With the count fixed at its minimum k, each slot takes the smallest size that still
    lets the remaining slots cover what is left: since k is minimal, that is the first
    size >= (still needed - the largest k-1-slot sizes left), found by bisect. The index
    of reclaimable bytes (`gpu_index.ReclaimIndex`) uses the same function, so its room
    figures equal the node's.

    Returns:
        Positions into `sizes`, or None when all of them would not cover the deficit, or
        when it would take more than `max_victims`.
    """
    assert deficit_bytes > 0, f"nothing to evict for a deficit of {deficit_bytes} bytes"
    num_sizes = len(sizes)
    covered_bytes, num_victims = 0, 0
    while covered_bytes < deficit_bytes and num_victims < num_sizes:
        num_victims += 1
        covered_bytes += sizes[num_sizes - num_victims]
    if covered_bytes < deficit_bytes or (max_victims is not None and num_victims > max_victims):
        return None
    if num_victims == 1:  # the common case: the smallest size that covers it alone
        return [bisect.bisect_left(sizes, deficit_bytes)]
    left = list(sizes)
    positions = list(range(num_sizes))
    picked: list[int] = []
    still_needed = deficit_bytes
    for num_after in range(num_victims - 1, -1, -1):
        top_after = sum(left[len(left) - num_after :]) if num_after else 0
        position = bisect.bisect_left(left, still_needed - top_after)
        still_needed -= left.pop(position)
        picked.append(positions.pop(position))
    return picked


def get_victim_totals(sizes: Sequence[int], num_victims: int) -> list[int]:
    """Every total `pick_victims` evicts with exactly `num_victims` victims, ascending.

    For the deficits that need exactly k victims (above the top k-1 sizes' sum, up to the
    top k sizes' sum), `pick_victims` takes the lexicographically smallest k sizes that
    cover the deficit. So its total is a non-decreasing step function of the deficit that
    returns each of its values unchanged: the total for deficit d is the smallest of these
    totals that is >= d. An index of ``free bytes + total`` per GPU and per k answers
    "least room left after k evictions" by bisect (`gpu_index.ReclaimIndex`).

    Args:
        sizes: evictable bytes on one GPU, ascending, all > 0.
        num_victims: k.
    """
    num_sizes = len(sizes)
    if num_victims > num_sizes:
        return []
    if num_victims == 1:
        return sorted(set(sizes))
    if num_victims == 2:
        return _get_two_victim_totals(sizes)
    top_bytes = sum(sizes[num_sizes - num_victims + 1 :])
    last_deficit_bytes = top_bytes + sizes[num_sizes - num_victims]
    totals = []
    deficit_bytes = top_bytes + 1
    while deficit_bytes <= last_deficit_bytes:
        picked = pick_victims(sizes, deficit_bytes)
        assert picked is not None and len(picked) == num_victims, "k victims cover these deficits"
        total_bytes = sum(sizes[p] for p in picked)
        totals.append(total_bytes)
        deficit_bytes = total_bytes + 1
    return totals


def _get_two_victim_totals(sizes: Sequence[int]) -> list[int]:
    """`get_victim_totals(sizes, 2)` without stepping: for deficits d in (max, max + v]
    above the previous first pick p, the first victim is v (the smallest size with
    v + max >= d) and the second any other size w >= d - v, so the totals are v + w for
    every other distinct size w > max + p - v."""
    largest = sizes[-1]
    values = sorted(set(sizes))
    totals = set()
    previous = 0
    for first in sorted(set(sizes[:-1])):
        alone = bisect.bisect_right(sizes, first) - bisect.bisect_left(sizes, first) == 1
        for position in range(bisect.bisect_right(values, largest + previous - first), len(values)):
            second = values[position]
            if not (second == first and alone):
                totals.add(first + second)
        previous = first
    return sorted(totals)


def choose_victims(
    evictable: Sequence[WorkReplica], gpu_id: int, deficit_bytes: int, max_victims: int | None = None
) -> list[WorkReplica] | None:
    """The fewest replicas whose bytes on `gpu_id` cover `deficit_bytes`.

    With the count fixed at its minimum, each slot takes the smallest replica that still
    lets the remaining slots cover the deficit (least memory evicted), least recently
    used first among equal sizes (`pick_victims`).

    Returns:
        The victims, or None when evicting all of `evictable` would not be enough, or when
        it would take more than `max_victims`.
    """
    ascending = sorted(evictable, key=lambda r: (r.gpu_bytes[gpu_id], r.last_accessed, r.replica_id))
    positions = pick_victims([r.gpu_bytes[gpu_id] for r in ascending], deficit_bytes, max_victims)
    return None if positions is None else [ascending[p] for p in positions]


def search_single_gpu(
    node: NodeWork, demand: ModelDemand, config: PlacementConfig, gpu_ids: Iterable[int] | None = None
) -> NodeCandidate | None:
    """The GPU of `node` taking one replica with the fewest evictions, then a GPU not yet
    serving the model, then best fit, then the seeded tie key.

    Args:
        gpu_ids: only these GPUs (the planner's indexes already know the best one);
            default every GPU of the node.
    """
    best_key: tuple[int, bool, int, float] | None = None
    best: tuple[AllocationKind, int, int, tuple[str, ...]] | None = None
    shapes: dict[int, tuple[AllocationKind, int] | None] = {}
    totals = node.gpus.total_bytes_by_gpu
    for gpu_id in totals if gpu_ids is None else gpu_ids:
        total_bytes = totals[gpu_id]
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
    clearable: list[ClearableGpu] = [(g, totals[g], node.gpu_tie_keys[g], ()) for g in free_ids]
    for gpu_id in totals:
        if not gpus.is_whole_gpu_free(gpu_id) and node.is_gpu_clearable(gpu_id, demand.model):
            clearable.append((gpu_id, totals[gpu_id], node.gpu_tie_keys[gpu_id], node.hot_ids_by_gpu[gpu_id]))
    ordered = order_clearable(clearable)
    num_gpus = count_whole_gpus([c[1] for c in ordered], need_bytes, num_extra, demand.min_num_gpus)
    if num_gpus is None:
        return None
    cleared = ordered[:num_gpus]
    eviction_ids = sorted({rid for c in cleared for rid in node.hot_ids_by_gpu[c[0]]})
    freed_bytes = sum(b for rid in eviction_ids for b in node.hot[rid].gpu_bytes.values())
    taken_bytes = sum(c[1] for c in cleared)
    return NodeCandidate(
        CandidateLevel.FULL,
        node.node_id,
        "multi_gpu",
        {c[0]: c[1] for c in cleared},
        tuple(eviction_ids),
        gpus.total_available_bytes + freed_bytes - taken_bytes,
        node.node_tie_key,
    )


ClearableGpu = tuple[int, int, float, Collection[Hashable]]
"""(GPU index, total bytes, tie key, ids of the HOT replicas on it): a GPU that is entirely
free or that evicting all of its replicas would clear."""


def order_clearable(clearable: Iterable[ClearableGpu]) -> list[ClearableGpu]:
    """The order a multi-GPU replica takes clearable GPUs in: fewest replicas to evict,
    then the largest, then the seeded tie key."""
    return sorted(clearable, key=lambda c: (len(c[3]), -c[1], c[2]))


def get_clearing_offers(
    ordered: Sequence[ClearableGpu], replica_bytes: Mapping[Hashable, int], node_free_bytes: int
) -> list[tuple[int, int, int]]:
    """What taking the first m clearable GPUs of a node costs, for every m >= 2.

    Args:
        ordered: the node's clearable GPUs, as `order_clearable` returns them.
        replica_bytes: every GPU byte each replica on those GPUs holds on the node (a
            multi-GPU victim frees its other GPUs too).
        node_free_bytes: free bytes of the node's GPUs now.

    Returns:
        (m, number of evictions, bytes left free on the node after placing) per m, as
        `search_multi_gpu` computes them for a model with no replica on the node.
    """
    offers = []
    evicted: set[Hashable] = set()
    freed_bytes = taken_bytes = 0
    for num_gpus, (_, total_bytes, _, replica_ids) in enumerate(ordered, start=1):
        for replica_id in replica_ids:
            if replica_id not in evicted:
                evicted.add(replica_id)
                freed_bytes += replica_bytes[replica_id]
        taken_bytes += total_bytes
        if num_gpus >= 2:
            offers.append((num_gpus, len(evicted), node_free_bytes + freed_bytes - taken_bytes))
    return offers


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
