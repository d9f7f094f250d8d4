"""Files for the Batch API: their bytes in the ``shoal_files`` object store, their records
(`FileObject`) in the ``shoal_batches`` KV bucket under ``files.<id>`` (listed reliably by
`TypedBucket.get_all`; an object store's own listing rests on a watcher). Any gateway serves
any file. Both forget a file `files_ttl_s` after it was written, as OpenAI lets files expire.

A file is written whole before its record: a record always names bytes that are there. A
record whose bytes expired or were lost reads as absent (404).
"""

from __future__ import annotations

import io
import re
import time
import uuid
from typing import TypeVar

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectStoreConfig, StorageType
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from shoal.services.gateway.batch_api import FileList, FileObject
from shoal.services.gateway.errors import BadRequest, NotFound, PayloadTooLarge, Unavailable
from shoal.shared import subjects
from shoal.shared.bus import TypedBucket, ensure_expiring_bucket
from shoal.shared.config import GatewayConfig

log = structlog.get_logger(__name__)

FILE_ID = re.compile(r"file-[A-Za-z0-9]{1,64}")
FILE_KEY_PREFIX = "files."
RECORDS_MAX_BYTES = 256 * 1024 * 1024
"""The ``shoal_batches`` bucket's bound (records only: a file's bytes are in ``shoal_files``)."""
T = TypeVar("T")


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def check_file_id(file_id: str, param: str | None = None) -> str:
    """`file_id` if it can name a file (a 404 naming `param` otherwise: no such file)."""
    if not FILE_ID.fullmatch(file_id):
        raise NotFound(f"no file {file_id[:80]!r} (file ids look like file-abc123)", param=param)
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


async def open_file_store(js: JetStreamContext, config: GatewayConfig) -> FileStore:
    objects = await ensure_object_store(js, ttl_s=config.files_ttl_s, max_bytes=config.files_max_bytes)
    records = TypedBucket(await open_records_bucket(js, config.files_ttl_s), msgspec.json.Decoder(FileObject),
                          subjects.BATCHES_BUCKET, js)
    return FileStore(objects, records, max_file_bytes=config.max_file_bytes, ttl_s=config.files_ttl_s)


class FileStore:
    """The Batch API's files (see the module doc)."""

    def __init__(self, objects: ObjectStore, records: TypedBucket[FileObject], *, max_file_bytes: int,
                 ttl_s: float) -> None:
        self._objects = objects
        self._records = records
        self.max_file_bytes = max_file_bytes
        self.ttl_s = ttl_s

    async def create(self, source: io.BufferedIOBase, *, filename: str, purpose: str, num_bytes: int) -> FileObject:
        """Keep `source` (read from its start) as a new file."""
        created_at = int(time.time())
        record = FileObject(id=new_file_id(), bytes=num_bytes, created_at=created_at, filename=filename,
                            purpose=purpose, expires_at=created_at + int(self.ttl_s))
        try:
            await self._objects.put(record.id, source, meta=ObjectMeta(name=record.id, description=filename))
            await self._records.put(FILE_KEY_PREFIX + record.id, record)
        except (TimeoutError, nats.errors.Error) as exc:  # the store full, NATS away
            log.warning("file_not_stored", file_id=record.id, error=str(exc))
            raise Unavailable(f"the file could not be stored ({type(exc).__name__}: {exc}); try again later") from exc
        return record

    async def create_from_bytes(self, data: bytes, *, filename: str, purpose: str) -> FileObject:
        return await self.create(io.BytesIO(data), filename=filename, purpose=purpose, num_bytes=len(data))

    async def get(self, file_id: str, param: str | None = None) -> FileObject:
        """The file's record; a 404 naming `param` when there is none."""
        found = await self._records.get(FILE_KEY_PREFIX + check_file_id(file_id, param))
        if found is None:
            raise NotFound(f"no file {file_id!r} (never uploaded, deleted, or expired after {self.ttl_s:g} s)",
                           param=param)
        return found.value

    async def read(self, file_id: str, param: str | None = None) -> bytes:
        """The file's bytes; a 404 naming `param` when there are none."""
        await self.get(file_id, param)
        try:
            result = await self._objects.get(file_id)
        except nats.js.errors.ObjectNotFoundError as exc:
            raise NotFound(f"file {file_id!r} has no content (expired or lost)", param=param) from exc
        return result.data or b""

    async def delete(self, file_id: str) -> None:
        """Forget the file (a 404 when there is none)."""
        await self.get(file_id)
        await self._records.delete(FILE_KEY_PREFIX + file_id)
        try:
            await self._objects.delete(file_id)
        except nats.js.errors.ObjectNotFoundError:
            pass

    async def list(self, *, purpose: str | None, limit: int, order: str, after: str | None) -> FileList:
        records = [found.value for found in (await self._records.get_all(FILE_KEY_PREFIX + "*")).values()]
        records = [record for record in records if purpose is None or record.purpose == purpose]
        records.sort(key=lambda record: (record.created_at, record.id), reverse=order == "desc")
        chosen, has_more = page(records, [record.id for record in records], limit=limit, after=after)
        return FileList(data=chosen, has_more=has_more, first_id=chosen[0].id if chosen else None,
                        last_id=chosen[-1].id if chosen else None)


def page(items: list[T], ids: list[str], *, limit: int, after: str | None) -> tuple[list[T], bool]:
    """(up to `limit` of `items`, from the one after the one whose id is `after`; whether
    more follow). An `after` that names none of them is a 400."""
    start = 0
    if after is not None:
        if after not in ids:
            raise BadRequest(f"after: {after[:128]!r} is not in this list", param="after")
        start = ids.index(after) + 1
    return items[start:start + limit], start + limit < len(items)


def file_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the file is larger than gateway.max_file_bytes ({limit} bytes)", param="file")
