"""Memory accounting of one node: free bytes per GPU, and the CPU RAM WARM replicas hold.

`GpuResources` is seed 000's ``Resources``: available bytes per GPU, the set of
"available" GPUs (at least ``min_available_gpu_fraction`` free), assignment to a given GPU or to
the one with the most room, whole-GPU assignment, and memory given back on eviction,
which re-evaluates the available set. It is a working copy the planner mutates; the
snapshot it was built from is never touched.

Running out is an expected outcome (``try_*`` returns None / False); assigning more than
a GPU has or giving back more than was taken is a bug (an assert naming the invariant).

An over-committed GPU in the input (its recorded occupants exceed its total, e.g. a node
re-registered with smaller GPUs) is not a bug of the policy: its available bytes start
negative, so it has no room, and an eviction on it must cover the excess as well before
anything new fits. The policy never makes a GPU more over-committed than it found it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class GpuResources:
    """Free bytes per GPU of one node."""

    __slots__ = (
        "_min_available_gpu_fraction",
        "available_bytes_by_gpu",
        "available_gpu_ids",
        "total_bytes_by_gpu",
    )

    def __init__(
        self,
        total_bytes_by_gpu: Mapping[int, int],
        reserved_bytes_by_gpu: Mapping[int, int],
        min_available_gpu_fraction: float,
    ) -> None:
        """Args:
        total_bytes_by_gpu: each GPU's capacity, by GPU index.
        reserved_bytes_by_gpu: bytes already held on each GPU (missing: 0); may exceed
            the GPU's total (over-committed input: no room until evictions cover the excess).
        min_available_gpu_fraction: a GPU is "available" while at least this fraction is free.
        """
        self.total_bytes_by_gpu: dict[int, int] = dict(total_bytes_by_gpu)
        self.available_bytes_by_gpu: dict[int, int] = {
            gpu_id: total - reserved_bytes_by_gpu.get(gpu_id, 0)
            for gpu_id, total in self.total_bytes_by_gpu.items()
        }
        self.available_gpu_ids: set[int] = set()
        """GPUs with at least ``min_available_gpu_fraction`` of their memory free."""
        self._min_available_gpu_fraction = min_available_gpu_fraction
        for gpu_id in self.total_bytes_by_gpu:
            self._update_available(gpu_id)

    def get_available_bytes(self, gpu_id: int) -> int:
        """Free bytes of the GPU; negative when the input over-committed it."""
        return self.available_bytes_by_gpu[gpu_id]

    def is_whole_gpu_free(self, gpu_id: int) -> bool:
        """Nothing at all is reserved on the GPU."""
        return self.available_bytes_by_gpu[gpu_id] == self.total_bytes_by_gpu[gpu_id]

    @property
    def total_available_bytes(self) -> int:
        return sum(self.available_bytes_by_gpu.values())

    def try_assign_memory(self, required_bytes: int, gpu_id: int | None = None) -> int | None:
        """Reserve `required_bytes` on `gpu_id`, or, when it is None, on the available GPU
        with the most room that can hold it (seed 000's ``assign_memory``).

        Returns:
            The GPU charged, or None (nothing changed) when no such GPU has the room.
        """
        assert required_bytes >= 0, f"cannot assign a negative amount ({required_bytes})"
        if gpu_id is None:
            roomy = [g for g in self.available_gpu_ids if self.available_bytes_by_gpu[g] >= required_bytes]
            if not roomy:
                return None
            gpu_id = max(roomy, key=lambda g: (self.available_bytes_by_gpu[g], -g))
        elif self.available_bytes_by_gpu[gpu_id] < required_bytes:
            return None
        self.available_bytes_by_gpu[gpu_id] -= required_bytes
        assert self.available_bytes_by_gpu[gpu_id] >= 0, f"GPU {gpu_id} over-committed by an assignment"
        self._update_available(gpu_id)
        return gpu_id

    def try_assign_whole_gpus(self, gpu_ids: Iterable[int]) -> bool:
        """Reserve every byte of each GPU in `gpu_ids`; all or nothing.

        Returns:
            False (nothing changed) unless every GPU was entirely free.
        """
        gpu_ids = list(gpu_ids)
        if not all(self.is_whole_gpu_free(gpu_id) for gpu_id in gpu_ids):
            return False
        for gpu_id in gpu_ids:
            self.available_bytes_by_gpu[gpu_id] = 0
            self._update_available(gpu_id)
        return True

    def release(self, gpu_bytes: Mapping[int, int]) -> None:
        """Give back memory a replica held (eviction, move to WARM, deletion)."""
        for gpu_id, num_bytes in gpu_bytes.items():
            available_bytes = self.available_bytes_by_gpu[gpu_id] + num_bytes
            assert available_bytes <= self.total_bytes_by_gpu[gpu_id], (
                f"GPU {gpu_id}: giving back {num_bytes} bytes frees more than the GPU has"
            )
            self.available_bytes_by_gpu[gpu_id] = available_bytes
            self._update_available(gpu_id)

    def _update_available(self, gpu_id: int) -> None:
        # No ">= 0" assert here: an over-committed input starts negative. The try_* methods
        # only take bytes a GPU has, so the policy never adds to an over-commit.
        available_bytes = self.available_bytes_by_gpu[gpu_id]
        if available_bytes >= self._min_available_gpu_fraction * self.total_bytes_by_gpu[gpu_id]:
            self.available_gpu_ids.add(gpu_id)
        else:
            self.available_gpu_ids.discard(gpu_id)


class CpuCacheResources:
    """Host RAM of one node that WARM replicas may hold."""

    __slots__ = ("capacity_bytes", "used_bytes")

    def __init__(self, capacity_bytes: int, used_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = used_bytes
        """May start above capacity (the budget shrank); the policy never adds beyond it."""

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)

    def try_hold(self, num_bytes: int) -> bool:
        """Account `num_bytes` of parked weights; False (nothing changed) when they do not fit."""
        if num_bytes > self.free_bytes:
            return False
        self.used_bytes += num_bytes
        return True

    def release(self, num_bytes: int) -> None:
        assert num_bytes <= self.used_bytes, f"releasing {num_bytes} CPU bytes of {self.used_bytes} held"
        self.used_bytes -= num_bytes
