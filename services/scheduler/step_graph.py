"""What each node step waits on (pure): the order rule of `executor.NodeSteps`.

Steps are added in commit order (a pass's delta, in `ReplicaDelta.steps()` order, right
after its commit). A step waits on

    * the previous step of the same replica (park before restore, create before stop), and
    * a from_cache or create only: every earlier to_cache or delete on any of its GPUs
      (memory is given back before it is reused).

A step that finished is forgotten: steps added later do not wait on it (the pass that
added them planned on records that already show it). Ids are ints counted from 0.

    add(to_cache x1 on n0.0)   -> #0 waits on nothing
    add(create   z1 on n0.0)   -> #1 waits on the GPU: #0
    add(from_cache x1 on n0.1) -> #2 waits on the replica: #0 (n0.1 frees nothing)
    forget(#0)
    add(create   y1 on n0.0)   -> #3 waits on nothing
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shoal.shared.placement.replicas import DeltaOp

FREEING_OPS: tuple[DeltaOp, ...] = ("to_cache", "delete")
"""Steps that give GPU memory back."""

GpuKey = tuple[str, int]
"""(node id, GPU index)."""


@dataclass(frozen=True, slots=True)
class StepWaits:
    """One added step: its id and the earlier steps it waits on."""

    step_id: int
    after_replica: int | None
    """The previous step of the same replica, still unfinished."""
    after_freeing: tuple[int, ...]
    """Unfinished to_cache / delete steps on any of its GPUs (from_cache and create only),
    in the order they were added."""


class StepGraph:
    """The unfinished steps, indexed by replica and by the GPUs they free."""

    def __init__(self) -> None:
        self._next_id = 0
        self._last_by_replica: dict[str, int] = {}
        self._freeing_by_gpu: dict[GpuKey, list[int]] = {}
        self._step_keys: dict[int, tuple[str, tuple[GpuKey, ...]]] = {}
        """Step id -> (replica id, GPU keys it frees): what to forget it from."""

    @property
    def num_unfinished(self) -> int:
        return len(self._step_keys)

    def add(self, op: DeltaOp, replica_id: str, gpu_keys: Iterable[GpuKey]) -> StepWaits:
        """Add the next step in commit order and say what it waits on."""
        step_id = self._next_id
        self._next_id += 1
        keys = tuple(sorted(set(gpu_keys)))
        after_replica = self._last_by_replica.get(replica_id)
        after_freeing: tuple[int, ...] = ()
        if op in FREEING_OPS:
            for key in keys:
                self._freeing_by_gpu.setdefault(key, []).append(step_id)
        else:
            waits = {i for key in keys for i in self._freeing_by_gpu.get(key, ())}
            after_freeing = tuple(sorted(waits))
        self._last_by_replica[replica_id] = step_id
        self._step_keys[step_id] = (replica_id, keys if op in FREEING_OPS else ())
        return StepWaits(step_id, after_replica, after_freeing)

    def has_unfinished(self, replica_id: str) -> bool:
        """Whether a step of `replica_id` was added and has not finished."""
        return replica_id in self._last_by_replica

    def forget(self, step_id: int) -> None:
        """A step finished (carried out, failed or skipped): later steps do not wait on it."""
        replica_id, freed_keys = self._step_keys.pop(step_id)
        if self._last_by_replica.get(replica_id) == step_id:
            del self._last_by_replica[replica_id]
        for key in freed_keys:
            remaining = [i for i in self._freeing_by_gpu[key] if i != step_id]
            if remaining:
                self._freeing_by_gpu[key] = remaining
            else:
                del self._freeing_by_gpu[key]
