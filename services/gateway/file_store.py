"""Files for the Batch API: their bytes in the ``shoal_files`` object store, their records
(`FileObject`) in the ``shoal_batches`` KV bucket under ``files.<id>`` (listed reliably by
`TypedBucket.get_all`; an object store's own listing rests on a watcher). Any gateway serves
any file. Both forget a file `files_ttl_s` after it was written, as OpenAI lets files expire.

A file is written whole before its record: a record always names bytes that are there. A
record whose bytes expired or were lost reads as absent (404).
Reads and writes go through temporary files (a 200 MiB file is never whole in memory), each
within `TRANSFER_TIMEOUT_S`. Ids are time-ordered, as batches' are (batch_store.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import IO, TypeVar

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectStoreConfig, StorageType
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from shoal.services.gateway.batch_api import FileList, FileObject
from shoal.services.gateway.errors import NotFound, PayloadTooLarge, Unavailable
from shoal.shared import subjects
from shoal.shared.bus import CasConflict, TypedBucket, ensure_expiring_bucket
from shoal.shared.config import GatewayConfig

log = structlog.get_logger(__name__)

FILE_ID = re.compile(r"file-[0-9a-f]{1,64}")
FILE_KEY_PREFIX = "files."
TRANSFER_TIMEOUT_S = 600.0
"""A file's whole read or write (NATS away, chunks lost: a 503 rather than a wait for ever)."""
NATS_ERRORS = (TimeoutError, nats.errors.Error)
RECORDS_MAX_BYTES = 256 * 1024 * 1024
"""The ``shoal_batches`` bucket's bound (records only: a file's bytes are in ``shoal_files``)."""
T = TypeVar("T")


def time_ordered_id(now: float) -> str:
    """24 hex digits: the time in milliseconds, then random ones (ids sort as they were made)."""
    return f"{int(now * 1000):012x}{uuid.uuid4().hex[:12]}"


def check_file_id(file_id: str, param: str | None = None) -> str:
    """`file_id` if it can name a file (a 404 naming `param` otherwise: no such file)."""
    if not FILE_ID.fullmatch(file_id):
        raise NotFound(f"no file {file_id[:80]!r} (file ids look like file-0193a4c2...)", param=param)
    return file_id


async def ensure_object_store(js: JetStreamContext, *, ttl_s: float, max_bytes: int) -> ObjectStore:
    """The ``shoal_files`` object store, created if missing (an existing one kept as it is)."""
    try:
        return await js.object_store(subjects.FILES_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        pass
    config = ObjectStoreConfig(bucket=subjects.FILES_BUCKET, description="Shoal's Batch API files: <file id> -> bytes",
                               ttl=ttl_s, max_bytes=max_bytes, storage=StorageType.FILE)
    try:
        store = await js.create_object_store(subjects.FILES_BUCKET, config=config)  # nats-py sets config.bucket from it
        log.info("object_store_created", bucket=subjects.FILES_BUCKET)
        return store
    except nats.js.errors.BadRequestError:  # another gateway created it meanwhile
        return await js.object_store(subjects.FILES_BUCKET)


async def open_records_bucket(js: JetStreamContext, ttl_s: float) -> KeyValue:
    """The ``shoal_batches`` KV bucket (files' and batches' records), created if missing."""
    return await ensure_expiring_bucket(
        js, subjects.BATCHES_BUCKET, "Shoal's Batch API: files.<file id> and batches.<batch id> -> their records",
        ttl_s=ttl_s, max_bytes=RECORDS_MAX_BYTES, storage=StorageType.FILE)


async def open_file_store(js: JetStreamContext, config: GatewayConfig, records_kv: KeyValue | None = None
                          ) -> FileStore:
    """The files; `records_kv`: the ``shoal_batches`` bucket, if already open."""
    objects = await ensure_object_store(js, ttl_s=config.files_ttl_s, max_bytes=config.files_max_bytes)
    kv = records_kv or await open_records_bucket(js, config.files_ttl_s)
    records = TypedBucket(kv, msgspec.json.Decoder(FileObject), subjects.BATCHES_BUCKET, js)
    return FileStore(objects, records, max_file_bytes=config.max_file_bytes, ttl_s=config.files_ttl_s)


class FileStore:
    """The Batch API's files (see the module doc)."""

    def __init__(self, objects: ObjectStore, records: TypedBucket[FileObject], *, max_file_bytes: int,
                 ttl_s: float) -> None:
        self._objects = objects
        self._records = records
        self.max_file_bytes = max_file_bytes
        self.ttl_s = ttl_s

    async def create(self, source: IO[bytes], *, filename: str, purpose: str, num_bytes: int) -> FileObject:
        """Keep `source` (read from its start) as a new file; a 503 when NATS cannot take it."""
        now = time.time()
        record = FileObject(id=f"file-{time_ordered_id(now)}", bytes=num_bytes, created_at=int(now),
                            filename=filename, purpose=purpose, expires_at=int(now + self.ttl_s))
        try:
            async with asyncio.timeout(TRANSFER_TIMEOUT_S):
                await self._objects.put(record.id, source,  # type: ignore[arg-type]
                                        meta=ObjectMeta(name=record.id, description=filename))
            await self._records.put(FILE_KEY_PREFIX + record.id, record)
        except NATS_ERRORS as exc:  # the store full, NATS away
            log.warning("file_not_stored", file_id=record.id, error=str(exc))
            raise Unavailable(f"the file could not be stored ({type(exc).__name__}: {exc}); try again later",
                              retry_after_s=5.0) from exc
        return record

    async def create_from_bytes(self, data: bytes, *, filename: str, purpose: str) -> FileObject:
        return await self.create(io.BytesIO(data), filename=filename, purpose=purpose, num_bytes=len(data))

    async def get(self, file_id: str, param: str | None = None) -> FileObject:
        """The file's record; a 404 naming `param` when there is none."""
        with store_answers():
            found = await self._records.get(FILE_KEY_PREFIX + check_file_id(file_id, param))
        if found is None:
            raise NotFound(f"no file {file_id!r} (never uploaded, deleted, or expired after {self.ttl_s:g} s)",
                           param=param)
        return found.value

    async def read_into(self, file_id: str, out: IO[bytes], param: str | None = None) -> FileObject:
        """The file's bytes written to `out`; its record. A 404 naming `param` when there are none."""
        record = await self.get(file_id, param)
        try:
            await self._download(file_id, out)
        except nats.js.errors.ObjectNotFoundError as exc:
            raise NotFound(f"file {file_id!r} has no content (expired or lost)", param=param) from exc
        except (*NATS_ERRORS, nats.js.errors.BadObjectMetaError, nats.js.errors.DigestMismatchError) as exc:
            raise _unavailable(exc) from exc
        return record

    async def _download(self, name: str, out: IO[bytes]) -> None:
        """Object `name`'s bytes into `out` (chunk by chunk, never whole in memory), rewound."""
        async with asyncio.timeout(TRANSFER_TIMEOUT_S):
            await self._objects.get(name, writeinto=out)  # type: ignore[arg-type]
        out.flush()
        out.seek(0)

    async def read(self, file_id: str, param: str | None = None) -> bytes:
        """A small file's bytes (tests, tools)."""
        with tempfile.TemporaryFile() as out:
            await self.read_into(file_id, out, param)
            return out.read()

    async def delete(self, file_id: str) -> None:
        """Forget the file (a 404 when there is none)."""
        await self.get(file_id)
        with store_answers(), contextlib.suppress(nats.js.errors.ObjectNotFoundError):
            await self._records.delete(FILE_KEY_PREFIX + file_id)
            await self._objects.delete(file_id)

    async def put_object(self, name: str, data: bytes) -> None:
        """Keep `data` under `name`, outside the Files API (no record: a batch's saved answers)."""
        async with asyncio.timeout(TRANSFER_TIMEOUT_S):
            await self._objects.put(name, data, meta=ObjectMeta(name=name))

    async def read_object(self, name: str) -> bytes | None:
        """What `put_object` kept under `name`; None when nothing is (expired, or deleted)."""
        with tempfile.TemporaryFile() as out:
            try:
                await self._download(name, out)
            except nats.js.errors.ObjectNotFoundError:
                return None
            return out.read()

    async def delete_object(self, name: str) -> None:
        with contextlib.suppress(nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            await self._objects.delete(name)

    async def list(self, *, purpose: str | None, limit: int, order: str, after: str | None) -> FileList:
        with store_answers():
            records = [found.value for found in (await self._records.get_all(FILE_KEY_PREFIX + "*")).values()]
        records = [record for record in records if purpose is None or record.purpose == purpose]
        descending = order == "desc"
        records.sort(key=lambda record: record.id, reverse=descending)
        chosen, has_more = page_after(records, [record.id for record in records], limit=limit, after=after,
                                      descending=descending)
        return FileList(data=chosen, has_more=has_more, first_id=chosen[0].id if chosen else None,
                        last_id=chosen[-1].id if chosen else None)


@contextlib.contextmanager
def store_answers() -> Iterator[None]:
    """NATS errors in the block (the store away, a timeout, a compare-and-swap that kept
    losing) as a 503 for the client."""
    try:
        yield
    except (*NATS_ERRORS, CasConflict) as exc:
        raise _unavailable(exc) from exc


def _unavailable(exc: Exception) -> Unavailable:
    return Unavailable(f"the Batch API's store did not answer ({type(exc).__name__}: {exc}); try again later",
                       retry_after_s=5.0)


def page_after(items: list[T], ids: list[str], *, limit: int, after: str | None, descending: bool
               ) -> tuple[list[T], bool]:
    """(up to `limit` of `items`, sorted by their `ids`, from the first past `after`; whether
    more follow). `after` need not be among them (it may have expired): time-ordered ids place it."""
    start = 0
    if after is not None:
        start = sum(1 for item_id in ids if (item_id >= after if descending else item_id <= after))
    return items[start:start + limit], start + limit < len(items)


def file_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the file is larger than gateway.max_file_bytes ({limit} bytes)", param="file")
