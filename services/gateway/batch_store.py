"""The Batch API's batches: records in the ``shoal_batches`` KV bucket (``batches.<id>``), each
with the gateway that runs it and until when its claim holds; every change by compare-and-swap,
so gateways never both run one batch and a cancel never crosses a runner's write. A batch with
work left also has a marker, ``active.<id>``, so runners look through the batches still to run,
not through every batch of the last 30 days.

The transitions are pure functions of a record and the time (`claim`, `cancel`, `started`,
...); the store only reads and CAS-writes them. A batch moves ``validating`` → ``in_progress``
→ ``finalizing`` → ``completed``; or to ``failed`` (its file is not a batch), ``cancelling`` →
``cancelled``, ``expired`` (not done within its 24 h window). A runner's step never writes over
a cancel: a batch cancelled while it is checked or sent ends ``cancelled``. A claim lapses
`LEASE_S` after its runner last wrote (it renews every `LEASE_S` / 3): a gateway that died
leaves its batches to another, which goes on from the answers its runner saved (`saved`:
parts in the ``shoal_files`` object store, batch_saves.py) and sends the rest. The lease
compares wall clocks: the gateways' clocks must agree to within seconds (NTP), as for any lease.

Ids are time-ordered (milliseconds, then random), so lists sort by id and a page's ``after``
places itself even if the batch it names has expired since.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import msgspec
from msgspec import Struct, structs
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shoal.services.gateway.batch_api import (
    ACTIVE_STATUSES,
    COMPLETION_WINDOW_S,
    Batch,
    BatchCreate,
    BatchError,
    BatchErrors,
    BatchList,
    BatchRequestCounts,
)
from shoal.services.gateway.errors import NotFound
from shoal.services.gateway.file_store import open_records_bucket, page_after, store_answers, time_ordered_id
from shoal.shared import subjects
from shoal.shared.bus import TypedBucket, Versioned, cas_update
from shoal.shared.config import GatewayConfig

LEASE_S = 30.0
"""A runner's claim on a batch holds this long after its last write."""
BATCH_KEY_PREFIX = "batches."
ACTIVE_KEY_PREFIX = "active."
BATCH_ID = re.compile(r"batch_[0-9a-f]{1,64}")
CANCELLABLE = frozenset({"validating", "in_progress"})
"""A batch still sending (a ``finalizing`` one has answered everything: it ends as it is)."""


class SavedRun(Struct, kw_only=True):
    """The answers one run of a batch saved: parts ``<batch id>.<run>.<k>``, k < `parts`."""

    run: str
    parts: int
    answers: int = 0
    """Answers in those parts."""


class StoredBatch(Struct, kw_only=True):
    batch: Batch
    owner: str = ""
    """The gateway running it ("" when none)."""
    lease_until: float = 0.0
    """Wall-clock time the owner's claim lapses."""
    saved: list[SavedRun] = []
    """Answers saved by its runs so far (a runner taking it over goes on from them)."""

    @property
    def num_saved_answers(self) -> int:
        return sum(saved.answers for saved in self.saved)

    @property
    def saved_parts(self) -> list[str]:
        return [part_name(self.batch.id, saved.run, k) for saved in self.saved for k in range(saved.parts)]


def part_name(batch_id: str, run: str, index: int) -> str:
    """A saved part's object name (never a file id: the Files API cannot reach it)."""
    return f"{batch_id}.{run}.{index}"


class ActiveMark(Struct, kw_only=True):
    """``active.<id>``: the batch has work left (gone once it ends)."""

    created_at: int


def new_batch(request: BatchCreate, now: float) -> Batch:
    created_at = int(now)
    return Batch(id=f"batch_{time_ordered_id(now)}", endpoint=request.endpoint, input_file_id=request.input_file_id,
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
    return structs.replace(stored, owner=owner, lease_until=now + LEASE_S)


def renewed(stored: StoredBatch | None, owner: str, now: float, change: Callable[[Batch], Batch] | None = None
            ) -> StoredBatch | None:
    """`stored` still `owner`'s, its claim extended and `change` applied; None if another
    runner took it (or it is gone)."""
    if stored is None or stored.owner != owner:
        return None
    batch = change(stored.batch) if change is not None else stored.batch
    return structs.replace(stored, batch=batch, lease_until=now + LEASE_S)


def part_saved(stored: StoredBatch | None, owner: str, now: float, run: str, part: int, answers_through: int
               ) -> StoredBatch | None:
    """`stored` renewed by `owner`, with `run`'s part `part` saved (its parts up to that one
    hold `answers_through` answers); None if another runner took it. Idempotent: a write
    tried again, or a part written again after a failed save, counts once."""
    kept = renewed(stored, owner, now)
    if kept is None:
        return None
    others = [s for s in kept.saved if s.run != run]
    before = next((s for s in kept.saved if s.run == run), SavedRun(run=run, parts=0))
    entry = SavedRun(run=run, parts=max(before.parts, part + 1), answers=max(before.answers, answers_through))
    return structs.replace(kept, saved=[*others, entry])


def without_saves(stored: StoredBatch | None, owner: str) -> StoredBatch | None:
    """`stored` (still `owner`'s) forgetting its saved parts (its files hold the answers now)."""
    if stored is None or stored.owner != owner:
        return None
    return structs.replace(stored, saved=[])


def released(stored: StoredBatch | None, owner: str) -> StoredBatch | None:
    """`stored` let go by `owner` (a stopping gateway), for another runner to take at once."""
    if stored is None or stored.owner != owner:
        return None
    return structs.replace(stored, owner="", lease_until=0.0)


def cancel(stored: StoredBatch | None, now: float) -> StoredBatch | None:
    """`stored` asked to stop: ``cancelling`` (its runner, or the next to claim it when it has
    answers saved, writes what was answered, then ``cancelled``), or at once ``cancelled`` when
    no runner holds it and nothing was saved. None when there is nothing to change (ended,
    finalizing, or cancelling already)."""
    if stored is None or stored.batch.status not in CANCELLABLE:
        return None
    if is_claimable(stored, now) and not stored.saved:  # nothing answered is kept: no file to write
        return StoredBatch(batch=abandoned(stored.batch, now))
    return structs.replace(stored, batch=structs.replace(stored.batch, status="cancelling", cancelling_at=int(now)))


def abandoned(batch: Batch, now: float) -> Batch:
    """A batch cancelled with no runner and no saved answer: ``cancelled``, no files."""
    stamp = int(now)
    return structs.replace(batch, status="cancelled", cancelling_at=batch.cancelling_at or stamp, cancelled_at=stamp)


def started(batch: Batch, now: float, total: int) -> Batch:
    """A batch whose file checked out, sending (unless cancelled meanwhile)."""
    if batch.status != "validating":
        return batch
    return structs.replace(batch, status="in_progress", in_progress_at=int(now),
                           request_counts=BatchRequestCounts(total=total))


def failed(batch: Batch, now: float, errors: list[BatchError]) -> Batch:
    """A batch whose file is not a batch (or whose answers could not be kept): ``failed``, or
    ``cancelled`` if it was cancelled meanwhile."""
    if batch.status == "cancelling":
        return abandoned(batch, now)
    return structs.replace(batch, status="failed", failed_at=int(now), errors=BatchErrors(data=errors))


def finalizing(batch: Batch, now: float) -> Batch:
    """Every request answered: the files are being written (a cancel that came first stands)."""
    if batch.status != "in_progress":
        return batch
    return structs.replace(batch, status="finalizing", finalizing_at=int(now))


class BatchStore:
    """Reads and CAS-writes ``batches.<id>`` records (see the module doc)."""

    def __init__(self, records: TypedBucket[StoredBatch], marks: TypedBucket[ActiveMark],
                 clock: Callable[[], float] = time.time) -> None:
        self._records = records
        self._marks = marks
        self.clock = clock

    async def create(self, batch: Batch) -> None:
        with store_answers():
            await self._records.put(BATCH_KEY_PREFIX + batch.id, StoredBatch(batch=batch))
            await self._marks.put(ACTIVE_KEY_PREFIX + batch.id, ActiveMark(created_at=batch.created_at))

    async def read(self, batch_id: str) -> Versioned[StoredBatch] | None:
        return await self._records.get(BATCH_KEY_PREFIX + batch_id)

    async def get(self, batch_id: str) -> Batch:
        """The batch; a 404 when there is none."""
        with store_answers():
            found = await self.read(_checked(batch_id))
        if found is None:
            raise NotFound(f"no batch {batch_id!r} (never made, or expired)")
        return found.value.batch

    async def update(self, batch_id: str, mutate: Callable[[StoredBatch | None], StoredBatch | None]
                     ) -> Versioned[StoredBatch] | None:
        """`mutate` applied by compare-and-swap; the value written (or the current one when
        `mutate` declined; None when the batch is gone). A batch that ended loses its mark."""
        written = await cas_update(self._records, BATCH_KEY_PREFIX + batch_id, mutate)
        if written is None or written.value.batch.status not in ACTIVE_STATUSES:
            await self._marks.delete(ACTIVE_KEY_PREFIX + batch_id)
        return written

    async def active(self, *, tidy: bool = True) -> list[StoredBatch]:
        """The batches with work left, oldest first; `tidy`: drop the marks of batches that
        ended (a runner that died between a batch's end and its mark's removal)."""
        ids = sorted(key.removeprefix(ACTIVE_KEY_PREFIX) for key in await self._marks.get_all(ACTIVE_KEY_PREFIX + "*"))
        found = [(batch_id, await self.read(batch_id)) for batch_id in ids]
        for batch_id, stored in found:
            if tidy and (stored is None or stored.value.batch.status not in ACTIVE_STATUSES):
                await self._marks.delete(ACTIVE_KEY_PREFIX + batch_id)
        return [stored.value for _, stored in found if stored is not None and
                stored.value.batch.status in ACTIVE_STATUSES]

    async def newest_first(self) -> list[Batch]:
        with store_answers():
            everything = await self._records.get_all(BATCH_KEY_PREFIX + "*")
        return sorted((found.value.batch for found in everything.values()), key=lambda b: b.id, reverse=True)

    async def list(self, *, limit: int, after: str | None) -> BatchList:
        """Newest first, as OpenAI lists them."""
        batches = await self.newest_first()
        chosen, has_more = page_after(batches, [batch.id for batch in batches], limit=limit, after=after,
                                      descending=True)
        return BatchList(data=chosen, has_more=has_more, first_id=chosen[0].id if chosen else None,
                         last_id=chosen[-1].id if chosen else None)

    async def delete(self, batch_id: str) -> None:
        """Forget a batch (its files are the caller's to delete)."""
        with store_answers():
            await self._records.delete(BATCH_KEY_PREFIX + _checked(batch_id))
            await self._marks.delete(ACTIVE_KEY_PREFIX + batch_id)

    async def cancel(self, batch_id: str) -> Batch:
        """Ask the batch to stop (a 404 when there is none); the batch as it is then."""
        now = self.clock()
        with store_answers():
            written = await self.update(_checked(batch_id), lambda stored: cancel(stored, now))
        if written is None:
            raise NotFound(f"no batch {batch_id!r} (never made, or expired)")
        return written.value.batch


async def open_batch_store(js: JetStreamContext, config: GatewayConfig) -> BatchStore:
    return batch_store_on(js, await open_records_bucket(js, config.files_ttl_s))


def batch_store_on(js: JetStreamContext, kv: KeyValue) -> BatchStore:
    """The batches of the ``shoal_batches`` bucket `kv`."""
    return BatchStore(TypedBucket(kv, msgspec.json.Decoder(StoredBatch), subjects.BATCHES_BUCKET, js),
                      TypedBucket(kv, msgspec.json.Decoder(ActiveMark), subjects.BATCHES_BUCKET, js))


def _checked(batch_id: str) -> str:
    if not BATCH_ID.fullmatch(batch_id):
        raise NotFound(f"no batch {batch_id[:80]!r} (batch ids look like batch_0193a4c2...)")
    return batch_id
