"""Best fit across the whole cluster without looking at every GPU: two indexes that give
exactly the FREE-level answer of scanning every node's decision tree.

`FreeGpuIndex` (single-GPU placements): every GPU of the cluster is one entry, kept
sorted by free bytes inside a list per GPU size (a cluster has few distinct GPU sizes):

    by_total[80 GiB] = [(  2 GiB, tie, node, gpu), ( 9 GiB, ...), (80 GiB, ...), ...]
    by_total[24 GiB] = [(  0 GiB, ...), ...]
                          ^ avail  ^ seeded random number: the order among equal avail

For a replica reserving A bytes on a GPU of size T, the best fit of that size is the
first entry with avail >= A (bisect) that does not already serve the same model (skipping
at most that model's few replicas); the best fit overall is the best of those firsts.
A lookup is O(sizes x (log GPUs + replicas of the model)); an update moves one entry
(O(GPUs) memmove, in C).
The answer equals the single-GPU FREE branch of `evaluate_node` over every node.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Mapping
from typing import NamedTuple

IndexEntry = tuple[int, float, int, int]
"""(available bytes, tie key, node position, GPU index)."""


class BestFit(NamedTuple):
    """A single-GPU offer from the index; tuples compare best first."""

    crowded: bool
    """The GPU already serves a replica of the same model."""
    room_left_bytes: int
    tie_key: float
    node_pos: int
    gpu_id: int
    alloc_bytes: int


class FreeGpuIndex:
    """Available bytes of every GPU of a cluster, sorted per GPU size."""

    __slots__ = ("_by_total", "_entry_by_gpu")

    def __init__(self) -> None:
        self._by_total: dict[int, list[IndexEntry]] = {}
        self._entry_by_gpu: dict[tuple[int, int], tuple[int, IndexEntry]] = {}

    def add_node(
        self,
        node_pos: int,
        total_bytes_by_gpu: Mapping[int, int],
        available_bytes_by_gpu: Mapping[int, int],
        tie_keys: Mapping[int, float],
    ) -> None:
        """Index every GPU of one node (built in bulk, then sorted once by `freeze`)."""
        for gpu_id, total_bytes in total_bytes_by_gpu.items():
            entry = (available_bytes_by_gpu[gpu_id], tie_keys[gpu_id], node_pos, gpu_id)
            self._by_total.setdefault(total_bytes, []).append(entry)
            self._entry_by_gpu[(node_pos, gpu_id)] = (total_bytes, entry)

    def freeze(self) -> None:
        """Sort after the bulk `add_node` calls."""
        for entries in self._by_total.values():
            entries.sort()

    def update(self, node_pos: int, gpu_id: int, available_bytes: int) -> None:
        """Move one GPU's entry to its new available bytes."""
        total_bytes, old = self._entry_by_gpu[(node_pos, gpu_id)]
        if old[0] == available_bytes:
            return
        entries = self._by_total[total_bytes]
        position = bisect.bisect_left(entries, old)
        assert entries[position] == old, f"GPU index lost node {node_pos} GPU {gpu_id}"
        del entries[position]
        new = (available_bytes, old[1], node_pos, gpu_id)
        bisect.insort(entries, new)
        self._entry_by_gpu[(node_pos, gpu_id)] = (total_bytes, new)

    def find_best_fit(
        self, get_alloc_bytes: Callable[[int], int | None], crowded: Collection[tuple[int, int]] = ()
    ) -> BestFit | None:
        """The GPU with the least room left after reserving its allocation, preferring GPUs
        not in `crowded`.

        Args:
            get_alloc_bytes: bytes the replica would reserve on a GPU of the given total,
                or None when it cannot use such a GPU alone.
            crowded: (node position, GPU index) of GPUs already serving the same model;
                taken only when no other GPU has room.

        Returns:
            The best fit, or None when no GPU has the room.
        """
        best: BestFit | None = None
        for total_bytes, entries in self._by_total.items():
            alloc_bytes = get_alloc_bytes(total_bytes)
            if alloc_bytes is None:
                continue
            for position in range(bisect.bisect_left(entries, (alloc_bytes,)), len(entries)):
                available_bytes, tie_key, node_pos, gpu_id = entries[position]
                is_crowded = (node_pos, gpu_id) in crowded
                found = BestFit(
                    is_crowded, available_bytes - alloc_bytes, tie_key, node_pos, gpu_id, alloc_bytes
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
