"""Cluster state in the KV buckets: snapshots, GPU reservations by CAS, replica records.

A plan touches one key per GPU. CAS is per key, so a plan's GPU changes are
applied key by key in a fixed (sorted) order; when one key no longer has room
the keys already changed are rolled back and the caller re-plans. New
occupants are reservations carrying their owner and an expiry: a scheduler
that crashes between reserving and writing the replica record leaves nothing
behind for longer than the reservation TTL (the reconciler removes lapsed ones).

Whatever ends a replica gives its memory back before its record goes, never after
(`free_replica`, `roll_back_placement`; a plan's GPU changes before its record deletes).

Every write of a replica record is a CAS at the revision read (`write_replicas`,
`hold_replica`, `mark_lost`, `free_replica`): an interleaving with a node agent's or a
worker's write never resurrects a deleted record or loses a ``failed``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import structlog

from shoal.services.scheduler.records import (
    GpuChange,
    apply_gpu_change,
    get_unbacked_reservations,
    merge_planned_record,
)
from shoal.shared import subjects
from shoal.shared.bus import Bus, CasConflict, Versioned, cas_update
from shoal.shared.messages import GpuRecord, ModelSpec, NodeRecord, Occupant, ReplicaRecord, now
from shoal.shared.metrics import Counter
from shoal.shared.replica_state import mark_lost

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StoredCluster:
    """Everything placement reads, as of one moment (each value with its revision)."""

    nodes: dict[str, NodeRecord]
    gpus: dict[str, Versioned[GpuRecord]]
    replicas: dict[str, Versioned[ReplicaRecord]]
    models: dict[str, Versioned[ModelSpec]]
    malformed_replica_ids: frozenset[str] = frozenset()
    """Replicas whose record does not decode (logged): their memory is never freed here."""
    malformed_gpu_keys: frozenset[str] = frozenset()
    """GPU keys whose record does not decode (logged): left out of placement."""

    def replicas_of(self, model: str) -> list[ReplicaRecord]:
        return [v.value for v in self.replicas.values() if v.value.model == model]


class _NoRoom(Exception):
    """Raised inside a CAS mutation when the GPU no longer has the room the plan assumed."""


class ClusterStore:
    """Reads and CAS-writes cluster state for one scheduler (`owner`)."""

    def __init__(
        self,
        bus: Bus,
        owner: str,
        *,
        conflicts: Counter,
        spec_conflicts: Counter,
        reservation_ttl_s: float = 60.0,
        clock: Callable[[], float] = now,
        rng: random.Random | None = None,
    ) -> None:
        self._bus = bus
        self._owner = owner
        self._conflicts = conflicts
        self._spec_conflicts = spec_conflicts
        self._ttl_s = reservation_ttl_s
        self._clock = clock
        self._rng = rng or random.Random()

    def _count_conflict(self) -> None:
        self._conflicts.inc(scheduler=self._owner)

    async def snapshot(self) -> StoredCluster:
        # The specs first: a pass commits its specs' leases (a CAS from the revisions read
        # here), then GPU keys and replica records, and releases the leases last. Specs read
        # before the rest are either older than another pass's lease (the CAS loses) or newer
        # than its release, so the records read after them include that pass's replicas.
        # Read last, specs newer than the records let two passes both place one model's
        # missing replicas on GPUs the other did not touch (a model got 18 of 10). So a model
        # registered meanwhile may have records here and no spec: look it up before calling
        # it unregistered (the reconciler does).
        models = await self._bus.models.get_all()
        nodes = {k: v.value for k, v in (await self._bus.nodes.get_all()).items()}
        malformed: set[str] = set()
        bad_gpus: set[str] = set()
        return StoredCluster(
            nodes=nodes,
            gpus=await self._bus.gpus.get_all(malformed=bad_gpus),
            replicas=await self._bus.replicas.get_all(malformed=malformed),
            models=models,
            malformed_replica_ids=frozenset(key.split(".", 1)[-1] for key in malformed),
            malformed_gpu_keys=frozenset(bad_gpus),
        )

    # ------------------------------------------------------------------ GPU records

    async def release(self, replica_id: str, keys: list[str]) -> None:
        """Remove `replica_id` from each GPU key (memory given back)."""
        for key in keys:

            def mutate(current: GpuRecord | None) -> GpuRecord | None:
                if current is None or current.find(replica_id) is None:
                    return None
                occupants = [o for o in current.occupants if o.replica_id != replica_id]
                return msgspec.structs.replace(current, occupants=occupants, updated_at=self._clock())

            await cas_update(self._bus.gpus, key, mutate, on_conflict=self._count_conflict, rng=self._rng)

    async def apply_gpu_changes(self, changes: dict[str, GpuChange],
                                read: Mapping[str, Versioned[GpuRecord]]) -> bool:
        """Carry out a plan's GPU changes key by key, in sorted key order, each a CAS
        against the revision the plan read (`read`).

        A key whose record moved on so far that the change would over-commit it stops the
        whole commit: the keys already changed are rolled back and False is returned
        (re-read and re-plan). A plain CAS conflict re-reads the key and retries the
        same change (`apply_gpu_change` re-checks the room).
        """
        applied: list[tuple[str, GpuChange, list[Occupant]]] = []
        for key in sorted(changes):
            change = changes[key]
            removed: list[Occupant] = []

            def mutate(current: GpuRecord | None, change: GpuChange = change, removed: list[Occupant] = removed
                       ) -> GpuRecord:
                if current is None:
                    raise _NoRoom()
                updated = apply_gpu_change(current, change, now=self._clock())
                if updated is None:
                    raise _NoRoom()
                removed[:] = [o for o in current.occupants if o.replica_id in change.remove_replica_ids]
                return updated

            try:
                await cas_update(self._bus.gpus, key, mutate, on_conflict=self._count_conflict, rng=self._rng,
                                 read=read.get(key))
            except (_NoRoom, CasConflict) as exc:
                log.info("gpu_commit_lost_race", key=key, reason=type(exc).__name__)
                for done_key, done_change, done_removed in reversed(applied):
                    await self._undo(done_key, done_change, done_removed)
                return False
            applied.append((key, change, removed))
        return True

    async def _undo(self, key: str, change: GpuChange, removed: list[Occupant]) -> None:
        added_ids = {o.replica_id for o in change.add}

        def mutate(current: GpuRecord | None) -> GpuRecord | None:
            if current is None:
                return None
            kept = [o for o in current.occupants if o.replica_id not in added_ids]
            present = {o.replica_id for o in kept}
            restored = kept + [o for o in removed if o.replica_id not in present]
            return msgspec.structs.replace(current, occupants=restored, updated_at=self._clock())

        await cas_update(self._bus.gpus, key, mutate, on_conflict=self._count_conflict, rng=self._rng)

    async def commit_specs(self, updates: dict[str, tuple[int, ModelSpec]]) -> bool:
        """CAS each model spec from the revision the plan read: False when another
        scheduler changed one since (that plan and this one raced for the same model)."""
        for model in sorted(updates):
            revision, spec = updates[model]
            if await self._bus.models.update(subjects.model_token(model), spec, revision) is None:
                self._spec_conflicts.inc(scheduler=self._owner)
                return False
        return True

    async def write_replicas(self, puts: Sequence[ReplicaRecord], delete_keys: Sequence[str],
                             read: Mapping[str, Versioned[ReplicaRecord]]) -> set[str]:
        """Write a plan's replica records, each a CAS from the revision the plan read (`read`,
        by KV key; re-read on a conflict): see `records.merge_planned_record`.

        Returns:
            The ids of the replicas whose change no longer applied and was not written.
        """
        skipped: set[str] = set()
        for record in puts:
            key = subjects.replica_kv_key(record.model, record.replica_id)
            before = read.get(key)
            if not await self._write_planned(key, record, before.value if before else None,
                                             before.revision if before else None):
                log.info("replica_write_skipped", model=record.model, replica=record.replica_id)
                skipped.add(record.replica_id)
        for key in delete_keys:
            before = read.get(key)
            if not await self._delete_planned(key, before):
                skipped.add(key.split(".", 1)[-1])
        return skipped

    async def _write_planned(self, key: str, planned: ReplicaRecord, read: ReplicaRecord | None,
                             revision: int | None) -> bool:
        current: ReplicaRecord | None = read
        for _ in range(12):
            merged = merge_planned_record(current, read, planned)
            if merged is None:
                return False
            if revision is None:
                written = await self._bus.replicas.create(key, merged)
            else:
                written = await self._bus.replicas.update(key, merged, revision)
            if written is not None:
                return True
            entry = await self._bus.replicas.get(key)
            current, revision = (entry.value, entry.revision) if entry else (None, None)
        raise CasConflict(f"{key}: the record kept changing while a plan was written")

    async def _delete_planned(self, key: str, read: Versioned[ReplicaRecord] | None) -> bool:
        """Delete a WARM replica's record that the plan dropped, unless it changed since."""
        entry = read
        for _ in range(12):
            if entry is None or entry.value.level != "WARM" or entry.value.state in ("failed", "stopping", "lost"):
                return False
            if await self._bus.replicas.delete(key, entry.revision):
                return True
            entry = await self._bus.replicas.get(key)
        raise CasConflict(f"{key}: the record kept changing while a plan deleted it")

    async def mark_lost(self, record: ReplicaRecord, error: str) -> bool:
        """Its node's heartbeats lapsed: the replica is ``lost`` (by CAS), its memory still
        counted until the node agent confirms the worker is gone. False when the record
        changed first (gone, or already given up)."""
        result = await cas_update(self._bus.replicas, subjects.replica_kv_key(record.model, record.replica_id),
                                  lambda current: mark_lost(current, error, self._clock()), rng=self._rng)
        return result is not None and result.value.state == "lost"

    async def release_replica(self, record: ReplicaRecord) -> None:
        await self.release(record.replica_id, [subjects.gpu_kv_key(record.node_id, i) for i in record.gpu_bytes])

    async def hold_replica(self, record: ReplicaRecord, error: str) -> None:
        """Keep the memory of a replica whose worker may still hold it (a to_cache or stop
        that failed) accounted: its record goes back to `record` (its allocation before the
        plan) with state ``stopping``, and its occupants hold their bytes again as
        ``draining``. Pinned so (see records.py); the reconciler frees it once the node
        agent confirms the worker stopped."""
        stamp = self._clock()

        def hold(current: ReplicaRecord | None) -> ReplicaRecord | None:
            if current is None or current.state == "failed":
                return None  # freed meanwhile, or being freed: its claim releases the memory
            return msgspec.structs.replace(record, state="stopping", error=error, updated_at=stamp,
                                           last_request_at=current.last_request_at)

        held = await cas_update(self._bus.replicas, subjects.replica_kv_key(record.model, record.replica_id), hold,
                                rng=self._rng)
        if held is None or held.value.state != "stopping":
            return
        gpu_bytes = record.gpu_bytes if record.level == "HOT" else {}
        for index, num_bytes in sorted(gpu_bytes.items()):

            def mutate(current: GpuRecord | None, num_bytes: int = num_bytes) -> GpuRecord | None:
                if current is None:
                    return None
                before = current.find(record.replica_id)
                occupant = Occupant(
                    replica_id=record.replica_id, model=record.model, num_bytes=num_bytes, state="draining",
                    since=stamp, last_accessed=before.last_accessed if before else 0.0,
                )
                occupants = [o for o in current.occupants if o.replica_id != record.replica_id] + [occupant]
                return msgspec.structs.replace(current, occupants=occupants, updated_at=stamp)

            await cas_update(self._bus.gpus, subjects.gpu_kv_key(record.node_id, index), mutate,
                             on_conflict=self._count_conflict, rng=self._rng)

    async def roll_back_placement(self, record: ReplicaRecord, *, created: bool) -> None:
        """Undo a placement whose node step never ran: its reservation is released, and its
        record deleted (`created`: a new replica) or put back WARM (a restore), unless a
        later pass has changed the record since."""
        await self.release_replica(record)
        key = subjects.replica_kv_key(record.model, record.replica_id)
        entry = await self._bus.replicas.get(key)
        if entry is None:
            return
        current = entry.value
        if current.level != "HOT" or current.state != "pending" or current.gpu_bytes != record.gpu_bytes:
            return
        if created:
            await self._bus.replicas.delete(key, entry.revision)
        else:
            await self._bus.replicas.update(key, msgspec.structs.replace(
                current, level="WARM", state="sleeping", gpu_bytes={}, gpu_memory_fraction=None,
                updated_at=self._clock()), entry.revision)

    async def free_replica(self, model: str, replica_id: str, *, error: str) -> ReplicaRecord | None:
        """Give a replica's GPU memory back, then delete its record; each replica is freed once.

        The memory goes before the record, so no reader ever finds memory reserved for a
        replica that has no record, nor a live record whose memory is gone:

        1. claim: the record is CAS-updated to ``failed`` (with `error`), unless it already
           is ``failed`` or ``stopping``. From then on no pass plans with it, a node agent's
           late report does not revive it, and if this scheduler dies here the reconciler
           finishes the job;
        2. its occupants leave its GPU keys (idempotent);
        3. its record is deleted by the revision step 1 left. When the record changed in
           between (a node agent marked it failed, another report claimed it), start over
           at 1.

        Returns:
            The record as read before the claim, to the one caller whose delete succeeded;
            None when the record is gone (another report of the same failure, from this
            or another scheduler, freed it first).
        """
        key = subjects.replica_kv_key(model, replica_id)
        for _ in range(12):
            entry = await self._bus.replicas.get(key)
            if entry is None:
                return None
            record, revision = entry.value, entry.revision
            if record.state not in ("failed", "stopping"):
                claimed = msgspec.structs.replace(record, state="failed", error=error, updated_at=self._clock())
                claimed_revision = await self._bus.replicas.update(key, claimed, revision)
                if claimed_revision is None:
                    continue
                revision = claimed_revision
            await self.release_replica(record)
            if await self._bus.replicas.delete(key, revision):
                return record
        raise CasConflict(f"{key}: the record kept changing while it was being freed")

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

    async def remove_lapsed_reservations(self, snapshot: StoredCluster) -> int:
        """Drop occupants no replica record backs once their reservation expired (a scheduler
        crashed between reserving and recording): `records.get_unbacked_reservations`."""
        stale = get_unbacked_reservations((v.value for v in snapshot.gpus.values()),
                                          (v.value for v in snapshot.replicas.values()), now=self._clock(),
                                          malformed_replica_ids=snapshot.malformed_replica_ids)
        removed = 0
        for key, replica_ids in stale.items():
            for replica_id in replica_ids:
                log.warning("reservation_removed", gpu=key, replica=replica_id)
                await self.release(replica_id, [key])
                removed += 1
        return removed
