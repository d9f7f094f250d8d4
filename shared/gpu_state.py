"""Pure changes to one GPU record: the bodies of the CAS mutations on ``shoal_gpus``.

Each function takes the record as read and returns the record to write, or None when
nothing changes (`shoal.shared.bus.cas_update` then writes nothing). The scheduler and
the node agent share them, so a park or a claim means the same thing wherever it is
written.
"""

from __future__ import annotations

import msgspec

from shoal.shared.messages import GpuRecord, PreemptionIntent, WakeLock


def mark_parked(record: GpuRecord | None, replica_id: str, residual_bytes: int, now: float) -> GpuRecord | None:
    """The replica's worker has parked (weights off the GPU): its occupant sleeps and holds only
    `residual_bytes` (what the worker still holds there, measured)."""
    if record is None or (occupant := record.find(replica_id)) is None:
        return None
    if occupant.state == "sleeping" and occupant.residual_bytes == residual_bytes:
        return None
    parked = msgspec.structs.replace(occupant, state="sleeping", since=now, residual_bytes=residual_bytes,
                                     owner=None, expires_at=None)
    occupants = [parked if o.replica_id == replica_id else o for o in record.occupants]
    return msgspec.structs.replace(record, occupants=occupants, updated_at=now)


def remove_occupant(record: GpuRecord | None, replica_id: str, now: float) -> GpuRecord | None:
    """The replica's worker has stopped: its occupant leaves the GPU."""
    if record is None or record.find(replica_id) is None:
        return None
    occupants = [o for o in record.occupants if o.replica_id != replica_id]
    return msgspec.structs.replace(record, occupants=occupants, updated_at=now)


def put_intent(record: GpuRecord | None, intent: PreemptionIntent, now: float) -> GpuRecord | None:
    """Add `intent`, or refresh its owner's expiry and its interest if its model has one here
    already (its `since`, the start of its fairness wait, stays the first one's)."""
    if record is None:
        return None
    current = next((i for i in record.intents if i.model == intent.model), None)
    if current is None:
        intents = [*record.intents, intent]
    else:
        refreshed = msgspec.structs.replace(current, owner=intent.owner, num_bytes=intent.num_bytes,
                                            expires_at=max(current.expires_at, intent.expires_at),
                                            interest_until=max(current.interest_until, intent.interest_until))
        if refreshed == current:
            return None
        intents = [refreshed if i.model == intent.model else i for i in record.intents]
    return msgspec.structs.replace(record, intents=intents, updated_at=now)


def note_interest(record: GpuRecord | None, model: str, until: float, now: float) -> GpuRecord | None:
    """Requests still wait for `model`: its intent here (if any) stays wanted until `until`."""
    if record is None:
        return None
    changed = False
    intents = []
    for intent in record.intents:
        if intent.model == model and intent.interest_until < until:
            intent = msgspec.structs.replace(intent, interest_until=until)
            changed = True
        intents.append(intent)
    return msgspec.structs.replace(record, intents=intents, updated_at=now) if changed else None


def drop_intent(record: GpuRecord | None, model: str, now: float) -> GpuRecord | None:
    """`model`'s wake is over here (claimed, failed or cancelled); lapsed intents go too."""
    if record is None:
        return None
    intents = [i for i in record.intents if i.model != model and i.expires_at > now]
    if len(intents) == len(record.intents):
        return None
    return msgspec.structs.replace(record, intents=intents, updated_at=now)


def take_wake_lock(record: GpuRecord | None, holder: str, now: float, ttl_s: float) -> GpuRecord | None:
    """`holder` takes (or renews) the GPU's wake lock; None when another live holder has it
    (the caller checks which, with `holds_wake_lock`)."""
    if record is None:
        return None
    lock = record.wake_lock
    if lock is not None and lock.holder != holder and lock.expires_at > now:
        return None
    taken = WakeLock(holder=holder, acquired_at=lock.acquired_at if lock and lock.holder == holder else now,
                     expires_at=now + ttl_s)
    return msgspec.structs.replace(record, wake_lock=taken, updated_at=now)


def holds_wake_lock(record: GpuRecord | None, holder: str, now: float) -> bool:
    return record is not None and record.wake_lock is not None and record.wake_lock.holder == holder \
        and record.wake_lock.expires_at > now


def release_wake_lock(record: GpuRecord | None, holder: str, now: float) -> GpuRecord | None:
    if record is None or record.wake_lock is None or record.wake_lock.holder != holder:
        return None
    return msgspec.structs.replace(record, wake_lock=None, updated_at=now)
