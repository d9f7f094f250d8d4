"""Best fit across the whole cluster without looking at every node: indexes whose answer is
exactly the best of every node's decision tree, with and without evictions.

A planning pass numbers every GPU once (`GpuSlots`): slot s is GPU ``gpu_id[s]`` of node
``node_pos[s]``, in (node, GPU index) order, and its *rank* is its place in the order of
the seeded tie keys. An index entry is one int, ``key << 32 | rank``: a sorted list of
them orders GPUs by key, then by tie key (the policy's own order), holds no object per
entry, and is built with one C-level sort:

    entry = [ key (bytes, may be negative) | rank (32 bits) ]

    FreeGpuIndex    no eviction,  one GPU       by_total[T] = [avail | rank, ...]
    WholeGpuIndex   no eviction,  whole GPUs    nodes grouped by the sizes of their free GPUs
    ReclaimIndex    evictions,    one GPU       by_reclaim[T] = [avail + all evictable | rank, ...]
                                                per k victims: [avail + total | rank, ...] for
                                                each total k victims can free on the GPU
    ClearingIndex   evictions,    whole GPUs    uniform nodes by (GPU size, number of GPUs):
                                                    (evictions, room left, tie, node)

For a replica reserving A bytes on a GPU of size T: the best fit without eviction is the
first entry >= A of ``by_total[T]`` (bisect), skipping the few GPUs already serving the
model. With evictions, k victims free one of the GPU's k-victim totals
(`node_eval.get_victim_totals`): the smallest that covers the deficit. So the first entry
>= A of list k is the GPU left with the least room after its own choice of k victims,
and list k is asked only when list k-1 has no entry >= A (no GPU does with fewer). GPUs
already serving the model are skipped: the model's own replicas are no victims for it,
which these model-independent lists cannot see, so the planner asks their node.

An update moves a GPU's few entries (bisect, then an O(GPUs) memmove in C).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

from shoal.shared.placement.node_eval import get_victim_totals

RANK_BITS = 32
_RANK_MASK = (1 << RANK_BITS) - 1


class GpuSlots:
    """Every GPU of a snapshot numbered in (node position, GPU index) order, with its tie rank."""

    __slots__ = ("gpu_id", "node_pos", "rank", "slot_by_gpu", "slot_by_rank", "tie_key", "total_bytes")

    def __init__(
        self, tie_keys_by_node: Sequence[Mapping[int, float]], totals_by_node: Sequence[Mapping[int, int]]
    ) -> None:
        """Args:
        tie_keys_by_node: per node position, each GPU's seeded tie key, in GPU index order.
        totals_by_node: per node position, each GPU's total bytes.
        """
        self.node_pos: list[int] = []
        self.gpu_id: list[int] = []
        self.total_bytes: list[int] = []
        self.tie_key: list[float] = []
        self.slot_by_gpu: list[dict[int, int]] = []
        """Per node position: GPU index -> slot."""
        for pos, (ties, totals) in enumerate(zip(tie_keys_by_node, totals_by_node, strict=True)):
            first = len(self.gpu_id)
            self.slot_by_gpu.append({gpu_id: first + i for i, gpu_id in enumerate(ties)})
            self.node_pos.extend([pos] * len(ties))
            self.gpu_id.extend(ties)
            self.total_bytes.extend(totals[gpu_id] for gpu_id in ties)
            self.tie_key.extend(ties.values())
        # Stable: equal tie keys keep (node, GPU) order, as the tuples this replaces did.
        self.slot_by_rank: list[int] = sorted(range(len(self.tie_key)), key=self.tie_key.__getitem__)
        self.rank: list[int] = [0] * len(self.slot_by_rank)
        for rank, slot in enumerate(self.slot_by_rank):
            self.rank[slot] = rank
        assert len(self.rank) <= _RANK_MASK, "too many GPUs for the rank bits"

    def __len__(self) -> int:
        return len(self.gpu_id)

    def encode(self, key: int, slot: int) -> int:
        """The index entry of `slot` with `key`."""
        return key << RANK_BITS | self.rank[slot]

    def get_slot(self, entry: int) -> int:
        return self.slot_by_rank[entry & _RANK_MASK]


def _move(entries: list[int], old: int | None, new: int | None) -> None:
    """Replace `old` by `new` in the sorted `entries` (either may be None: none)."""
    if old == new:
        return
    if old is not None:
        position = bisect.bisect_left(entries, old)
        assert position < len(entries) and entries[position] == old, "a GPU index lost an entry"
        del entries[position]
    if new is not None:
        bisect.insort(entries, new)


class BestFit(NamedTuple):
    """A single-GPU offer without evictions; tuples compare best first."""

    crowded: bool
    """The GPU already serves a replica of the same model."""
    room_left_bytes: int
    tie_key: float
    node_pos: int
    gpu_id: int
    alloc_bytes: int


class FreeGpuIndex:
    """Available bytes of every GPU of a cluster, sorted per GPU size."""

    __slots__ = ("_by_total", "_entries", "_slots")

    def __init__(self, slots: GpuSlots, available_bytes: Sequence[int]) -> None:
        """Args:
        slots: the cluster's GPUs.
        available_bytes: free bytes per slot (negative: over-committed).
        """
        self._slots = slots
        self._entries = [a << RANK_BITS | r for a, r in zip(available_bytes, slots.rank, strict=True)]
        self._by_total: dict[int, list[int]] = {}
        for entry, total_bytes in zip(self._entries, slots.total_bytes, strict=True):
            self._by_total.setdefault(total_bytes, []).append(entry)
        for entries in self._by_total.values():
            entries.sort()

    def get_available_bytes(self, slot: int) -> int:
        return self._entries[slot] >> RANK_BITS

    def update(self, slot: int, available_bytes: int) -> None:
        """Move one GPU's entry to its new available bytes."""
        new = self._slots.encode(available_bytes, slot)
        _move(self._by_total[self._slots.total_bytes[slot]], self._entries[slot], new)
        self._entries[slot] = new

    def find_best_fit(
        self, get_alloc_bytes: Callable[[int], int | None], crowded: Collection[int] = ()
    ) -> BestFit | None:
        """The GPU with the least room left after reserving its allocation, preferring GPUs
        not in `crowded`.

        Args:
            get_alloc_bytes: bytes the replica would reserve on a GPU of the given total,
                or None when it cannot use such a GPU alone.
            crowded: slots of GPUs already serving the same model; taken only when no
                other GPU has room.

        Returns:
            The best fit, or None when no GPU has the room.
        """
        slots = self._slots
        best: BestFit | None = None
        for total_bytes, entries in self._by_total.items():
            alloc_bytes = get_alloc_bytes(total_bytes)
            if alloc_bytes is None:
                continue
            for position in range(bisect.bisect_left(entries, alloc_bytes << RANK_BITS), len(entries)):
                entry = entries[position]
                slot = slots.slot_by_rank[entry & _RANK_MASK]
                is_crowded = slot in crowded
                found = BestFit(
                    is_crowded,
                    (entry >> RANK_BITS) - alloc_bytes,
                    slots.tie_key[slot],
                    slots.node_pos[slot],
                    slots.gpu_id[slot],
                    alloc_bytes,
                )
                if best is None or found < best:
                    best = found
                if not is_crowded:
                    break
        return best


WholeGpuEntry = tuple[int, float, int]
"""(node free bytes, node tie key, node position)."""


class WholeGpuIndex:
    """Nodes with two or more entirely free GPUs, for multi-GPU best fit.

    Nodes are grouped by the sizes of their entirely free GPUs, largest first (a cluster
    has few distinct groups: (80, 80), (80, 80, 80), ...). Inside a group every node
    gives a multi-GPU replica the same GPUs' worth of bytes, so the best fit of the group
    is its node with the fewest free bytes: each group is kept sorted by
    (free bytes, tie key, node).
    """

    __slots__ = ("_entry_by_node", "_groups")

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], list[WholeGpuEntry]] = {}
        self._entry_by_node: dict[int, tuple[tuple[int, ...], WholeGpuEntry]] = {}

    def set_node(
        self, node_pos: int, free_gpu_totals: tuple[int, ...], node_free_bytes: int, tie_key: float
    ) -> None:
        """Record a node's entirely free GPUs (sizes, largest first) and its free bytes."""
        old = self._entry_by_node.pop(node_pos, None)
        if old is not None:
            members = self._groups[old[0]]
            position = bisect.bisect_left(members, old[1])
            assert members[position] == old[1], f"whole-GPU index lost node {node_pos}"
            del members[position]
            if not members:
                del self._groups[old[0]]
        if len(free_gpu_totals) >= 2:
            entry = (node_free_bytes, tie_key, node_pos)
            bisect.insort(self._groups.setdefault(free_gpu_totals, []), entry)
            self._entry_by_node[node_pos] = (free_gpu_totals, entry)

    def find_best_fit(self, count_gpus: Callable[[tuple[int, ...]], int | None]) -> WholeGpuEntry | None:
        """The node with the least room left after a multi-GPU replica takes its GPUs.

        Args:
            count_gpus: how many of the given free GPU sizes (largest first) the replica
                takes, or None when they cannot hold it.

        Returns:
            (room left bytes, tie key, node position), or None when no node has the GPUs.
        """
        best: WholeGpuEntry | None = None
        for free_gpu_totals, members in self._groups.items():
            num_gpus = count_gpus(free_gpu_totals)
            if num_gpus is None:
                continue
            node_free_bytes, tie_key, node_pos = members[0]
            found = (node_free_bytes - sum(free_gpu_totals[:num_gpus]), tie_key, node_pos)
            if best is None or found < best:
                best = found
        return best


class GpuRoom(NamedTuple):
    """What one GPU offers a model with no replica on it."""

    available_bytes: int
    """Free now (negative: the input over-committed it)."""
    evictable_bytes: tuple[int, ...]
    """Bytes of each replica pressure may evict there (not protected, not placed by this
    pass), ascending."""

    @property
    def reclaimable_bytes(self) -> int:
        """Free after evicting every replica pressure may evict."""
        return self.available_bytes + sum(self.evictable_bytes)


class EvictionFit(NamedTuple):
    """A single-GPU offer that needs evictions; tuples compare best first."""

    num_victims: int
    room_left_bytes: int
    tie_key: float
    node_pos: int
    gpu_id: int
    alloc_bytes: int


class _VictimLists:
    """The entries of `ReclaimIndex` for one number of victims k, per GPU size.

    A GPU can only offer A bytes with k victims if its free bytes plus its k largest
    evictable replicas reach A, so entries exist only for GPUs whose *top* (that sum)
    reaches the lowest allocation asked so far, ``covered_from``; a lower allocation
    first adds the GPUs between (found by bisect in the sorted tops).

        tops[T]     = [avail + top k bytes | rank, ...]              every GPU with >= k victims
        entries[T]  = [avail + total | rank, ...]   for each total of `get_victim_totals`,
                                                     GPUs whose top >= covered_from[T]
    """

    __slots__ = ("_covered_from", "_entries", "_num_victims", "_slots", "_tops")

    def __init__(
        self,
        slots: GpuSlots,
        num_victims: int,
        available_bytes: Sequence[int],
        sizes: Sequence[tuple[int, ...]],
    ) -> None:
        self._slots = slots
        self._num_victims = num_victims
        totals = dict.fromkeys(slots.total_bytes)
        self._tops: dict[int, list[int]] = {total: [] for total in totals}
        self._entries: dict[int, list[int]] = {total: [] for total in totals}
        self._covered_from: dict[int, int | None] = dict.fromkeys(totals)
        """None: no GPU covered yet."""
        tops_by_total, ranks = self._tops, slots.rank
        for slot, (available, slot_sizes, total_bytes) in enumerate(
            zip(available_bytes, sizes, slots.total_bytes, strict=True)
        ):
            if len(slot_sizes) >= num_victims:
                top_bytes = available + sum(slot_sizes[len(slot_sizes) - num_victims :])
                tops_by_total[total_bytes].append(top_bytes << RANK_BITS | ranks[slot])
        for tops in self._tops.values():
            tops.sort()

    def find_first(
        self,
        total_bytes: int,
        alloc_bytes: int,
        excluded: Collection[int],
        available_bytes: Sequence[int],
        sizes: Sequence[tuple[int, ...]],
    ) -> tuple[int, int] | None:
        """(entry, slot) of the first entry >= `alloc_bytes` on GPUs of `total_bytes`
        outside `excluded`, covering more GPUs first if needed."""
        key = alloc_bytes << RANK_BITS
        covered_from = self._covered_from[total_bytes]
        entries = self._entries[total_bytes]
        if covered_from is None or key < covered_from:
            tops = self._tops[total_bytes]
            end = len(tops) if covered_from is None else bisect.bisect_left(tops, covered_from)
            slot_by_rank, num_victims = self._slots.slot_by_rank, self._num_victims
            for position in range(bisect.bisect_left(tops, key), end):
                rank = tops[position] & _RANK_MASK
                slot = slot_by_rank[rank]
                available = available_bytes[slot]
                entries.extend(
                    (available + total) << RANK_BITS | rank
                    for total in get_victim_totals(sizes[slot], num_victims)
                )
            entries.sort()
            self._covered_from[total_bytes] = key
        slot_by_rank = self._slots.slot_by_rank
        for position in range(bisect.bisect_left(entries, key), len(entries)):
            entry = entries[position]
            slot = slot_by_rank[entry & _RANK_MASK]
            if slot not in excluded:
                return entry, slot
        return None

    def update(self, slot: int, old: tuple[int, tuple[int, ...]], new: tuple[int, tuple[int, ...]]) -> None:
        """Move a GPU's entries from (free, evictable sizes) `old` to `new`."""
        total_bytes = self._slots.total_bytes[slot]
        old_top, new_top = self._get_top(slot, *old), self._get_top(slot, *new)
        _move(self._tops[total_bytes], old_top, new_top)
        covered_from = self._covered_from[total_bytes]
        if covered_from is None:
            return
        entries = self._entries[total_bytes]
        if old_top is not None and old_top >= covered_from:
            for entry in self._get_entries(slot, *old):
                _move(entries, entry, None)
        if new_top is not None and new_top >= covered_from:
            for entry in self._get_entries(slot, *new):
                _move(entries, None, entry)

    def _get_top(self, slot: int, available_bytes: int, sizes: tuple[int, ...]) -> int | None:
        if len(sizes) < self._num_victims:
            return None
        return self._slots.encode(available_bytes + sum(sizes[len(sizes) - self._num_victims :]), slot)

    def _get_entries(self, slot: int, available_bytes: int, sizes: tuple[int, ...]) -> list[int]:
        rank = self._slots.rank[slot]
        return [
            (available_bytes + total) << RANK_BITS | rank
            for total in get_victim_totals(sizes, self._num_victims)
        ]


class ReclaimIndex:
    """Every GPU's free bytes and evictable replicas' bytes, for single-GPU placements that
    need evictions.

    Per GPU size, one sorted list of reclaimable bytes (one entry per GPU: can it take the
    allocation at all?) and, per number of victims k, one sorted list of ``free + total``
    for every total that `get_victim_totals` says k victims can free on a GPU. For an
    allocation of A bytes, when fewer than k victims suffice on no GPU, the first entry
    >= A of list k is the GPU left with the least room after its own choice of k
    victims. List k is built when a decision first needs k victims, for the GPUs that
    can reach the allocations asked (`_VictimLists`).
    """

    __slots__ = ("_available", "_by_reclaim", "_by_victims", "_sizes", "_slots")

    def __init__(
        self, slots: GpuSlots, available_bytes: Sequence[int], evictable_bytes: Sequence[tuple[int, ...]]
    ) -> None:
        """Args:
        slots: the cluster's GPUs.
        available_bytes: free bytes per slot.
        evictable_bytes: per slot, the bytes of each evictable replica, ascending.
        """
        self._slots = slots
        self._available = list(available_bytes)
        self._sizes = list(evictable_bytes)
        assert len(self._available) == len(self._sizes) == len(slots), "one room per GPU slot"
        self._by_reclaim: dict[int, list[int]] = {total: [] for total in slots.total_bytes}
        by_reclaim, ranks = self._by_reclaim, slots.rank
        for slot, (available, sizes, total_bytes) in enumerate(
            zip(self._available, self._sizes, slots.total_bytes, strict=True)
        ):
            by_reclaim[total_bytes].append((available + sum(sizes)) << RANK_BITS | ranks[slot])
        for entries in by_reclaim.values():
            entries.sort()
        self._by_victims: list[_VictimLists] = []
        """Index k-1: the lists for k victims, built on first need."""

    def get_room(self, slot: int) -> GpuRoom:
        return GpuRoom(self._available[slot], self._sizes[slot])

    def set_room(self, slot: int, available_bytes: int, evictable_bytes: tuple[int, ...]) -> None:
        """Move one GPU's entries to its new free and evictable bytes."""
        old = (self._available[slot], self._sizes[slot])
        new = (available_bytes, evictable_bytes)
        if old == new:
            return
        for victim_lists in self._by_victims:
            victim_lists.update(slot, old, new)
        _move(
            self._by_reclaim[self._slots.total_bytes[slot]],
            self._slots.encode(old[0] + sum(old[1]), slot),
            self._slots.encode(available_bytes + sum(evictable_bytes), slot),
        )
        self._available[slot], self._sizes[slot] = new

    def count_victims(self, slot: int, alloc_bytes: int) -> int | None:
        """Fewest evictions that leave `alloc_bytes` free on the GPU when any evictable
        replica may go (a lower bound for a model that has replicas there); None when
        even all of them would not."""
        deficit_bytes = alloc_bytes - self._available[slot]
        num_victims = 0
        for num_bytes in reversed(self._sizes[slot]):
            if deficit_bytes <= 0:
                break
            deficit_bytes -= num_bytes
            num_victims += 1
        return num_victims if deficit_bytes <= 0 else None

    def find_best_fit(
        self, get_alloc_bytes: Callable[[int], int | None], excluded: Collection[int] = ()
    ) -> EvictionFit | None:
        """The GPU outside `excluded` that takes one replica with the fewest evictions, then
        the least room left, then the seeded tie key, each GPU choosing its own victims
        with `pick_victims`.

        Valid only when no GPU has room without evictions (the FREE indexes found none).

        Args:
            get_alloc_bytes: bytes the replica reserves on a GPU of the given total, or None.
            excluded: slots not to consider (GPUs serving the same model: ask their node).

        Returns:
            The best offer, or None when no GPU can take the replica even after evictions.
        """
        allocs = [(t, a) for t in self._by_reclaim if (a := get_alloc_bytes(t)) is not None]
        if all(self._find_reclaimable(t, a, excluded) is None for t, a in allocs):
            return None
        num_victims = 0
        while True:  # ends: some GPU's reclaimable bytes cover the allocation
            num_victims += 1
            if num_victims > len(self._by_victims):
                assert num_victims <= max(map(len, self._sizes)), "the reclaimable check found a GPU"
                self._by_victims.append(_VictimLists(self._slots, num_victims, self._available, self._sizes))
            victim_lists = self._by_victims[num_victims - 1]
            best: EvictionFit | None = None
            for total_bytes, alloc_bytes in allocs:
                hit = victim_lists.find_first(
                    total_bytes, alloc_bytes, excluded, self._available, self._sizes
                )
                if hit is not None:
                    entry, slot = hit
                    slots = self._slots
                    found = EvictionFit(
                        num_victims,
                        (entry >> RANK_BITS) - alloc_bytes,
                        slots.tie_key[slot],
                        slots.node_pos[slot],
                        slots.gpu_id[slot],
                        alloc_bytes,
                    )
                    if best is None or found < best:
                        best = found
            if best is not None:
                return best

    def _find_reclaimable(self, total_bytes: int, alloc_bytes: int, excluded: Collection[int]) -> int | None:
        """A slot outside `excluded` whose reclaimable bytes reach `alloc_bytes`, if any."""
        entries = self._by_reclaim[total_bytes]
        for position in range(bisect.bisect_left(entries, alloc_bytes << RANK_BITS), len(entries)):
            slot = self._slots.get_slot(entries[position])
            if slot not in excluded:
                return slot
        return None


ClearingEntry = tuple[int, int, float, int]
"""(number of evictions, room left bytes, node tie key, node position)."""


class ClearingIndex:
    """Uniform nodes (all GPUs of one size) by what clearing whole GPUs costs, for
    multi-GPU replicas that need evictions.

    On a uniform node a replica needing m GPUs takes the node's first m clearable GPUs
    (`node_eval.order_clearable`) whatever the model, unless the model has replicas there
    (the planner asks those nodes, and nodes of mixed sizes, directly). So each node has
    one entry per m, and each (GPU size, m) group is kept sorted: its first entry is the
    group's best fit.
    """

    __slots__ = ("_by_group", "_entries_by_node")

    def __init__(self, nodes: Iterable[tuple[int, int, Iterable[tuple[int, int, int]], float]] = ()) -> None:
        """Args:
        nodes: (node position, GPU size, offers, tie key) per uniform node, as `set_node`
            takes them (sorted once here).
        """
        self._by_group: dict[tuple[int, int], list[ClearingEntry]] = {}
        self._entries_by_node: dict[int, list[tuple[tuple[int, int], ClearingEntry]]] = {}
        for node_pos, total_bytes, offers, tie_key in nodes:
            added = []
            for num_gpus, num_evictions, room_left_bytes in offers:
                group, entry = (total_bytes, num_gpus), (num_evictions, room_left_bytes, tie_key, node_pos)
                self._by_group.setdefault(group, []).append(entry)
                added.append((group, entry))
            if added:
                self._entries_by_node[node_pos] = added
        for members in self._by_group.values():
            members.sort()

    def set_node(
        self, node_pos: int, total_bytes: int, offers: Iterable[tuple[int, int, int]], tie_key: float
    ) -> None:
        """Replace a node's entries.

        Args:
            node_pos: the node.
            total_bytes: the size of each of its GPUs.
            offers: (m GPUs, evictions, room left) from `node_eval.get_clearing_offers`.
            tie_key: the node's seeded tie key.
        """
        for group, old in self._entries_by_node.pop(node_pos, ()):
            members = self._by_group[group]
            position = bisect.bisect_left(members, old)
            assert members[position] == old, f"clearing index lost node {node_pos}"
            del members[position]
            if not members:
                del self._by_group[group]
        added = []
        for num_gpus, num_evictions, room_left_bytes in offers:
            group, entry = (total_bytes, num_gpus), (num_evictions, room_left_bytes, tie_key, node_pos)
            bisect.insort(self._by_group.setdefault(group, []), entry)
            added.append((group, entry))
        if added:
            self._entries_by_node[node_pos] = added

    def find_best_fit(
        self, count_gpus: Callable[[int], int | None], excluded: Collection[int] = ()
    ) -> ClearingEntry | None:
        """The uniform node outside `excluded` where one multi-GPU replica needs the fewest
        evictions, then leaves the least room, then wins the tie.

        Args:
            count_gpus: GPUs the replica takes on a node of the given GPU size (None: not
                a multi-GPU shape there).
            excluded: node positions not to consider.
        """
        num_gpus_by_total: dict[int, int | None] = {}
        best: ClearingEntry | None = None
        for (total_bytes, num_gpus), members in self._by_group.items():
            if total_bytes not in num_gpus_by_total:
                num_gpus_by_total[total_bytes] = count_gpus(total_bytes)
            if num_gpus_by_total[total_bytes] != num_gpus:
                continue
            for entry in members:
                if entry[3] in excluded:
                    continue
                if best is None or entry < best:
                    best = entry
                break
        return best
