"""Cluster state in the KV buckets: snapshots, GPU reservations by CAS, replica records.

A placement touches one key per GPU. CAS is per key, so a multi-GPU replica
is reserved key by key in a fixed (sorted) order; when one key no longer has
room the keys already reserved are rolled back and the caller re-plans.
Reservations carry their owner and an expiry: a scheduler that crashes
between reserving and writing the replica record leaves nothing behind for
longer than the reservation TTL (the reconciler removes lapsed ones).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import structlog

from shoal.shared import subjects
from shoal.shared.bus import Bus, CasConflict, Versioned, cas_update
from shoal.shared.messages import GpuRecord, ModelSpec, NodeRecord, Occupant, ReplicaRecord, now
from shoal.shared.metrics import Counter

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ClusterSnapshot:
    """Everything placement reads, as of one moment (each value with its revision)."""

    nodes: dict[str, NodeRecord]
    gpus: dict[str, Versioned[GpuRecord]]
    replicas: dict[str, Versioned[ReplicaRecord]]
    models: dict[str, Versioned[ModelSpec]]

    def replicas_of(self, model: str) -> list[ReplicaRecord]:
        return [v.value for v in self.replicas.values() if v.value.model == model]


class _NoRoom(Exception):
    """Raised inside a CAS mutation when the GPU no longer has the room the plan assumed."""


@dataclass(frozen=True)
class Reservation:
    """Bytes to reserve for one replica on each GPU key (sorted keys are reserved in order)."""

    replica_id: str
    model: str
    node_id: str
    gpu_bytes: dict[int, int]
    dedicated: bool = False

    def gpu_keys(self) -> list[tuple[str, int]]:
        return sorted((subjects.gpu_kv_key(self.node_id, index), b) for index, b in self.gpu_bytes.items())


class ClusterStore:
    """Reads and CAS-writes cluster state for one scheduler (`owner`)."""

    def __init__(
        self,
        bus: Bus,
        owner: str,
        *,
        conflicts: Counter,
        reservation_ttl_s: float = 60.0,
        clock: Callable[[], float] = now,
        rng: random.Random | None = None,
    ) -> None:
        self._bus = bus
        self._owner = owner
        self._conflicts = conflicts
        self._ttl_s = reservation_ttl_s
        self._clock = clock
        self._rng = rng or random.Random()

    def _count_conflict(self) -> None:
        self._conflicts.inc(scheduler=self._owner)

    async def snapshot(self) -> ClusterSnapshot:
        nodes = {k: v.value for k, v in (await self._bus.nodes.get_all()).items()}
        return ClusterSnapshot(
            nodes=nodes,
            gpus=await self._bus.gpus.get_all(),
            replicas=await self._bus.replicas.get_all(),
            models=await self._bus.models.get_all(),
        )

    # ------------------------------------------------------------------ GPU reservations

    async def reserve(self, reservation: Reservation) -> bool:
        """Reserve every GPU share of `reservation`, all or nothing. False: some GPU filled up."""
        reserved: list[str] = []
        for key, num_bytes in reservation.gpu_keys():
            try:
                await cas_update(
                    self._bus.gpus,
                    key,
                    self._add_occupant(reservation, num_bytes),
                    on_conflict=self._count_conflict,
                    rng=self._rng,
                )
            except (_NoRoom, CasConflict) as exc:
                log.info("reservation_lost_race", key=key, replica=reservation.replica_id, reason=type(exc).__name__)
                await self.release(reservation.replica_id, reserved)
                return False
            reserved.append(key)
        return True

    def _add_occupant(self, reservation: Reservation, num_bytes: int) -> Callable[[GpuRecord | None], GpuRecord]:
        def mutate(current: GpuRecord | None) -> GpuRecord:
            if current is None or current.find(reservation.replica_id) is not None:
                raise _NoRoom()
            if current.available_bytes < num_bytes:
                raise _NoRoom()
            stamp = self._clock()
            occupant = Occupant(
                replica_id=reservation.replica_id,
                model=reservation.model,
                bytes=num_bytes,
                state="reserved",
                since=stamp,
                last_accessed=stamp,
                dedicated=reservation.dedicated,
                owner=self._owner,
                expires_at=stamp + self._ttl_s,
            )
            return msgspec.structs.replace(current, occupants=[*current.occupants, occupant], updated_at=stamp)

        return mutate

    async def release(self, replica_id: str, keys: list[str]) -> None:
        """Remove `replica_id` from each GPU key (memory given back)."""
        for key in keys:

            def mutate(current: GpuRecord | None) -> GpuRecord | None:
                if current is None or current.find(replica_id) is None:
                    return None
                occupants = [o for o in current.occupants if o.replica_id != replica_id]
                return msgspec.structs.replace(current, occupants=occupants, updated_at=self._clock())

            await cas_update(self._bus.gpus, key, mutate, on_conflict=self._count_conflict, rng=self._rng)

    async def release_replica(self, record: ReplicaRecord) -> None:
        await self.release(record.replica_id, [subjects.gpu_kv_key(record.node_id, i) for i in record.gpu_bytes])

    # ------------------------------------------------------------------ replica records

    async def create_replica(self, record: ReplicaRecord) -> bool:
        key = subjects.replica_kv_key(record.model, record.replica_id)
        return await self._bus.replicas.create(key, record) is not None

    async def delete_replica(self, record: ReplicaRecord) -> None:
        await self._bus.replicas.delete(subjects.replica_kv_key(record.model, record.replica_id))

    async def update_replica(
        self, model: str, replica_id: str, mutate: Callable[[ReplicaRecord | None], ReplicaRecord | None]
    ) -> ReplicaRecord | None:
        result = await cas_update(
            self._bus.replicas, subjects.replica_kv_key(model, replica_id), mutate, rng=self._rng
        )
        return result.value if result else None

    # ------------------------------------------------------------------ models

    async def update_model(
        self, model: str, mutate: Callable[[ModelSpec | None], ModelSpec | None]
    ) -> ModelSpec | None:
        result = await cas_update(self._bus.models, subjects.model_token(model), mutate, rng=self._rng)
        return result.value if result else None

    async def get_model(self, model: str) -> ModelSpec | None:
        entry = await self._bus.models.get(subjects.model_token(model))
        return entry.value if entry else None

    # ------------------------------------------------------------------ reconciliation

    async def remove_lapsed_reservations(self, snapshot: ClusterSnapshot) -> int:
        """Drop occupants no replica record backs once their reservation expired
        (a scheduler crashed between reserving and recording)."""
        recorded = {v.value.replica_id for v in snapshot.replicas.values()}
        stamp = self._clock()
        removed = 0
        for key, entry in snapshot.gpus.items():
            stale = [
                o.replica_id
                for o in entry.value.occupants
                if o.replica_id not in recorded and (o.expires_at is None or o.expires_at < stamp)
            ]
            for replica_id in stale:
                await self.release(replica_id, [key])
                removed += 1
        return removed
