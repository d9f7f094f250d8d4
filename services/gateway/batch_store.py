"""The Batch API's batches: records in the ``shoal_batches`` KV bucket (``batches.<id>``), each
with the gateway that runs it and until when its claim holds; every change by compare-and-swap,
so gateways never both run one batch and a cancel never crosses a runner's write.

The transitions are pure functions of a record and the time (`claim`, `cancel`, ...), the
store only reads and CAS-writes them. A batch moves ``validating`` → ``in_progress`` →
``finalizing`` → ``completed``; or to ``failed`` (its file is not a batch), ``cancelling`` →
``cancelled``, ``expired`` (not done within its 24 h window). A claim lapses `LEASE_S` after
its runner last wrote: a gateway that died leaves its batches to another, which starts them
over.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import msgspec
from msgspec import Struct, structs
from nats.js import JetStreamContext

from shoal.services.gateway.batch_api import (
    ACTIVE_STATUSES,
    COMPLETION_WINDOW_S,
    Batch,
    BatchCreate,
    BatchList,
    BatchRequestCounts,
)
from shoal.services.gateway.errors import NotFound
from shoal.services.gateway.file_store import open_records_bucket, page
from shoal.shared import subjects
from shoal.shared.bus import TypedBucket, Versioned, cas_update
from shoal.shared.config import GatewayConfig

LEASE_S = 30.0
"""A runner's claim on a batch holds this long after its last write (it writes every few seconds)."""
BATCH_KEY_PREFIX = "batches."
CANCELLABLE = frozenset({"validating", "in_progress", "finalizing"})


class StoredBatch(Struct, kw_only=True):
    batch: Batch
    owner: str = ""
    """The gateway running it ("" when none)."""
    lease_until: float = 0.0
    """Wall-clock time the owner's claim lapses."""


def new_batch(request: BatchCreate, now: float) -> Batch:
    created_at = int(now)
    return Batch(id=f"batch_{uuid.uuid4().hex[:24]}", endpoint=request.endpoint, input_file_id=request.input_file_id,
                 completion_window=request.completion_window, status="validating", created_at=created_at,
                 expires_at=created_at + int(COMPLETION_WINDOW_S), request_counts=BatchRequestCounts(),
                 metadata=request.metadata)


def is_claimable(stored: StoredBatch, now: float) -> bool:
    """Work is left on it and no runner holds it."""
    return stored.batch.status in ACTIVE_STATUSES and (not stored.owner or stored.lease_until < now)


def claim(stored: StoredBatch | None, owner: str, now: float) -> StoredBatch | None:
    """`stored` run by `owner` from now on; None if it is not free to claim."""
    if stored is None or not is_claimable(stored, now):
        return None
    return StoredBatch(batch=stored.batch, owner=owner, lease_until=now + LEASE_S)


def renewed(stored: StoredBatch | None, owner: str, now: float, change: Callable[[Batch], Batch] | None = None
            ) -> StoredBatch | None:
    """`stored` still `owner`'s, its claim extended and `change` applied; None if another
    runner took it (or it is gone)."""
    if stored is None or stored.owner != owner:
        return None
    batch = change(stored.batch) if change is not None else stored.batch
    return StoredBatch(batch=batch, owner=owner, lease_until=now + LEASE_S)


def released(stored: StoredBatch | None, owner: str) -> StoredBatch | None:
    """`stored` let go by `owner` (a stopping gateway), for another runner to take at once."""
    if stored is None or stored.owner != owner:
        return None
    return StoredBatch(batch=stored.batch)


def cancel(stored: StoredBatch | None, now: float) -> StoredBatch | None:
    """`stored` asked to stop: ``cancelling`` (its runner writes what was answered, then
    ``cancelled``), or at once ``cancelled`` when no runner has started it. None when there is
    nothing to change (already final, or cancelling)."""
    if stored is None or stored.batch.status not in CANCELLABLE:
        return None
    stamp = int(now)
    if stored.batch.status == "validating" and is_claimable(stored, now):  # waiting for a runner
        return StoredBatch(batch=structs.replace(stored.batch, status="cancelled", cancelling_at=stamp,
                                                 cancelled_at=stamp))
    return structs.replace(stored, batch=structs.replace(stored.batch, status="cancelling", cancelling_at=stamp))


class BatchStore:
    """Reads and CAS-writes ``batches.<id>`` records (see the module doc)."""

    def __init__(self, records: TypedBucket[StoredBatch], clock: Callable[[], float] = time.time) -> None:
        self._records = records
        self.clock = clock

    async def create(self, batch: Batch) -> None:
        await self._records.put(BATCH_KEY_PREFIX + batch.id, StoredBatch(batch=batch))

    async def read(self, batch_id: str) -> Versioned[StoredBatch] | None:
        return await self._records.get(BATCH_KEY_PREFIX + batch_id)

    async def get(self, batch_id: str) -> Batch:
        """The batch; a 404 when there is none."""
        found = await self.read(_checked(batch_id))
        if found is None:
            raise NotFound(f"no batch {batch_id!r} (never made, or expired)")
        return found.value.batch

    async def update(self, batch_id: str, mutate: Callable[[StoredBatch | None], StoredBatch | None]
                     ) -> Versioned[StoredBatch] | None:
        """`mutate` applied by compare-and-swap; the value written (or the current one when
        `mutate` declined; None when the batch is gone)."""
        return await cas_update(self._records, BATCH_KEY_PREFIX + batch_id, mutate)

    async def all(self) -> list[StoredBatch]:
        return [found.value for found in (await self._records.get_all(BATCH_KEY_PREFIX + "*")).values()]

    async def list(self, *, limit: int, after: str | None) -> BatchList:
        """Newest first, as OpenAI lists them."""
        batches = sorted((stored.batch for stored in await self.all()), key=lambda b: (b.created_at, b.id),
                         reverse=True)
        chosen, has_more = page(batches, [batch.id for batch in batches], limit=limit, after=after)
        return BatchList(data=chosen, has_more=has_more, first_id=chosen[0].id if chosen else None,
                         last_id=chosen[-1].id if chosen else None)

    async def cancel(self, batch_id: str) -> Batch:
        """Ask the batch to stop (a 404 when there is none); the batch as it is then."""
        now = self.clock()
        written = await self.update(_checked(batch_id), lambda stored: cancel(stored, now))
        if written is None:
            raise NotFound(f"no batch {batch_id!r} (never made, or expired)")
        return written.value.batch


async def open_batch_store(js: JetStreamContext, config: GatewayConfig) -> BatchStore:
    records = TypedBucket(await open_records_bucket(js, config.files_ttl_s), msgspec.json.Decoder(StoredBatch),
                          subjects.BATCHES_BUCKET, js)
    return BatchStore(records)


def _checked(batch_id: str) -> str:
    if not batch_id.startswith("batch_") or not batch_id[6:].isalnum() or len(batch_id) > 80:
        raise NotFound(f"no batch {batch_id[:80]!r} (batch ids look like batch_abc123)")
    return batch_id

