"""The node agent's half of a two-phase eviction: memory is given back in the cluster state
only once the worker has let it go.

A scheduler marks a victim ``draining`` (its record and its occupants, bytes still
counted) and asks the node agent to park or stop it. When the worker has parked,
`record_parked` puts its occupants to sleep holding only their measured residue and
makes its record WARM; when it has stopped, `record_stopped` removes its occupants and
its record. Nothing else frees an evicted replica's memory.
"""

from __future__ import annotations

import functools

import msgspec

from shoal.shared import subjects
from shoal.shared.bus import Bus, cas_update
from shoal.shared.gpu_state import mark_parked, remove_occupant
from shoal.shared.messages import ReplicaRecord, now


async def record_parked(
    bus: Bus, record: ReplicaRecord, residual_by_gpu: dict[int, int], *, weights_dropped: bool
) -> None:
    """`record`'s worker has parked, its weights dropped or not (a cold sleep that could not drop
    them holds them in host RAM, and is charged for them): see the module doc."""
    stamp = now()
    for index, residual in sorted(residual_by_gpu.items()):
        await cas_update(bus.gpus, subjects.gpu_kv_key(record.node_id, index),
                         functools.partial(mark_parked, replica_id=record.replica_id, residual_bytes=residual,
                                           now=stamp))

    def mutate(current: ReplicaRecord | None) -> ReplicaRecord | None:
        if current is None or current.state in ("failed", "stopping") or current.level == "WARM":
            return None
        return msgspec.structs.replace(current, level="WARM", state="sleeping", gpu_bytes={},
                                       gpu_memory_fraction=None, leaving_to=None, num_in_flight=0,
                                       weights_dropped=weights_dropped, updated_at=stamp)

    await cas_update(bus.replicas, subjects.replica_kv_key(record.model, record.replica_id), mutate)


async def record_stopped(bus: Bus, record: ReplicaRecord) -> None:
    """`record`'s worker has stopped. Only a replica evicted to COLD (``draining``, leaving to
    COLD) leaves here; a failed one is freed by the scheduler (`ClusterStore.free_replica`)."""
    key = subjects.replica_kv_key(record.model, record.replica_id)
    entry = await bus.replicas.get(key)
    if entry is None or entry.value.state != "draining" or entry.value.leaving_to != "COLD":
        return
    for index in sorted(entry.value.gpu_bytes):
        await cas_update(bus.gpus, subjects.gpu_kv_key(record.node_id, index),
                         functools.partial(remove_occupant, replica_id=record.replica_id, now=now()))
    await bus.replicas.delete(key, entry.revision)
