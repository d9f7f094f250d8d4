"""Connecting to NATS, creating Shoal's streams and buckets, typed KV access with CAS.

`connect()` returns a `Bus`: the connection, its JetStream context and one
`TypedBucket` per KV bucket of the NATS contract. Creating streams and buckets
is idempotent: every service calls it at start, in any order.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE, KeyValue

from shoal.shared import subjects
from shoal.shared.errors import ShoalError
from shoal.shared.messages import (
    Event,
    GpuRecord,
    ModelSpec,
    NodeRecord,
    ReplicaRecord,
    encode_json,
    gpu_record_decoder,
    model_spec_decoder,
    node_record_decoder,
    replica_record_decoder,
)

log = structlog.get_logger(__name__)

T = TypeVar("T", bound=msgspec.Struct)

# JetStream API error codes Shoal branches on (nats-server's errors.json).
JS_STREAM_NAME_EXISTS = 10058
"""JSStreamNameExistErr: the stream (or KV bucket) exists with a different configuration."""
JS_WRONG_LAST_SEQUENCE = 10071
"""JSStreamWrongLastSequenceErrF: a CAS write lost (the key changed since the given revision)."""
JS_WRONG_LAST_SEQUENCE_CONSTANT = 10164
"""JSStreamWrongLastSequenceConstantErr: the same, from newer servers."""
JS_NO_MESSAGE_FOUND = 10057
"""JSNoMessageFoundErr: a stream message (to get or delete) is not there (any more)."""
JS_CONSUMER_ALREADY_EXISTS = 10148
"""JSConsumerAlreadyExists: a consumer of that name exists with another configuration."""
MAX_DELIVERIES = 10
"""JetStream delivers a request at most this often: a backstop. Hand-backs (drains, barrier
NAKs) count here too, so it is well above the budget that matters, which the gateway keeps:
a request two replicas died running is given up (`gateway.dispatch.MAX_REPLICA_DEATHS`)."""
GET_ALL_INACTIVE_S = 5.0
"""Server-side lifetime of a `get_all` consumer once nothing reads it (a safety net:
`get_all` deletes it itself)."""
GET_ALL_BATCH = 256
"""KV entries fetched per round trip by `get_all`."""


class BusError(ShoalError, RuntimeError):
    """NATS could not be reached or refused a request."""


@dataclass(frozen=True)
class Versioned(Generic[T]):
    """A decoded KV value and the revision it was read at (the CAS token)."""

    value: T
    revision: int


class TypedBucket(Generic[T]):
    """A KV bucket whose values are JSON-encoded `T` Structs.

    Values that do not decode are logged and treated as absent: one bad write
    by hand (`nats kv put`) must not take a service down.
    """

    def __init__(self, kv: KeyValue, decoder: msgspec.json.Decoder[T], name: str, js: JetStreamContext) -> None:
        self.kv = kv
        self.name = name
        self._decoder = decoder
        self._js = js
        self._subject_prefix = f"$KV.{name}."

    def decode(self, key: str, raw: bytes | None) -> T | None:
        """Decode a raw value of this bucket (None, and logged, if malformed)."""
        return self._decode(key, raw)

    def _decode(self, key: str, raw: bytes | None) -> T | None:
        if not raw:
            return None
        try:
            return self._decoder.decode(raw)
        except msgspec.DecodeError as exc:
            log.error("kv_value_malformed", bucket=self.name, key=key, error=str(exc))
            return None

    async def get(self, key: str) -> Versioned[T] | None:
        value, revision = await self.read(key)
        if value is None or revision is None:
            return None
        return Versioned(value, revision)

    async def read(self, key: str) -> tuple[T | None, int | None]:
        """(value, revision) of `key`: (None, None) when absent, (None, revision) when its
        value does not decode (logged) — a CAS write at that revision repairs it."""
        try:
            entry = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None, None
        return self._decode(key, entry.value), entry.revision

    async def get_all(self, prefix: str = ">", *, malformed: set[str] | None = None) -> dict[str, Versioned[T]]:
        """Current value of every key matching `prefix` (a KV key filter, e.g. ``node-a.*``).

        Reads through an ephemeral pull consumer (last value per key, no acks), deleted
        again before returning. Not nats-py's watcher: its "no more entries" marker rests
        on the consumer's pending count read while the server is already pushing, and can
        come before entries that exist (an empty read of a full bucket). A pull consumer
        delivers nothing until fetched, so its pending count at creation is exact; each
        message's own pending count then says when the read is complete.

        Args:
            malformed: if given, the keys whose current value does not decode are added to it
                (they are absent from the result, and logged).
        """
        stream = f"KV_{self.name}"
        config = ConsumerConfig(
            name=f"get-all-{uuid.uuid4().hex}",
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=AckPolicy.NONE,
            filter_subject=self._subject_prefix + prefix,
            inactive_threshold=GET_ALL_INACTIVE_S,
            mem_storage=True,
        )
        info = await self._js.add_consumer(stream, config)
        found: dict[str, Versioned[T]] = {}
        try:
            remaining = info.num_pending or 0
            if remaining:
                subscription = await self._js.pull_subscribe_bind(consumer=info.name, stream=stream)
                try:
                    while remaining:
                        for msg in await subscription.fetch(batch=min(remaining, GET_ALL_BATCH), timeout=5.0):
                            remaining = msg.metadata.num_pending
                            self._take_entry(msg, found, malformed)
                finally:
                    await subscription.unsubscribe()
        finally:
            try:
                await self._js.delete_consumer(stream, info.name)
            except (nats.errors.Error, TimeoutError) as exc:  # it lapses after GET_ALL_INACTIVE_S
                log.debug("kv_read_consumer_not_deleted", bucket=self.name, consumer=info.name, error=str(exc))
        return found

    def _take_entry(self, msg: Msg, found: dict[str, Versioned[T]], malformed: set[str] | None) -> None:
        """Records the value a KV stream message holds, or forgets its key if it is a delete."""
        key = msg.subject[len(self._subject_prefix) :]
        headers = msg.headers or {}
        if headers.get(KV_OP) in (KV_DEL, KV_PURGE) or KV_MARKER_REASON in headers:  # deleted, purged, expired
            found.pop(key, None)
            return
        value = self._decode(key, msg.data)
        if value is not None:
            found[key] = Versioned(value, msg.metadata.sequence.stream)
        elif malformed is not None and msg.data:
            malformed.add(key)

    async def put(self, key: str, value: T) -> int:
        """Unconditional write (not CAS): only for keys a single owner writes."""
        return await self.kv.put(key, encode_json(value))

    async def create(self, key: str, value: T) -> int | None:
        """Write only if absent; None if the key exists."""
        try:
            return await self.kv.create(key, encode_json(value))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def update(self, key: str, value: T, revision: int) -> int | None:
        """CAS write; None if the key changed since `revision`."""
        try:
            return await self.kv.update(key, encode_json(value), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def delete(self, key: str, revision: int | None = None) -> bool:
        """Delete (CAS when `revision` is given); False on a conflict."""
        try:
            await self.kv.delete(key, last=revision)
        except nats.js.errors.APIError as exc:
            if exc.err_code in (JS_WRONG_LAST_SEQUENCE, JS_WRONG_LAST_SEQUENCE_CONSTANT):
                return False
            raise
        return True


class CasConflict(ShoalError, RuntimeError):
    """A compare-and-swap kept losing races past its retry budget."""


Mutation = Callable[[T | None], T | None]


async def cas_update(
    bucket: TypedBucket[T],
    key: str,
    mutate: Mutation[T],
    *,
    max_attempts: int = 12,
    on_conflict: Callable[[], None] | None = None,
    rng: random.Random | None = None,
    read: Versioned[T] | None = None,
) -> Versioned[T] | None:
    """Read-modify-write one key with compare-and-swap.

    `mutate` gets the current value (None if absent, or if its value does not decode)
    and returns the new value, or None to leave the key as it is. It must be pure: it
    is re-run on the fresh value after every conflict. A value that does not decode is
    overwritten by revision when `mutate` returns one (repaired), never fought over.

    Args:
        read: the value as the caller already read it (e.g. in a snapshot a plan was
            made on); the first attempt writes against its revision, so any change
            since counts as a conflict.

    Returns the written (or unchanged current) value, or None when `mutate`
    declined and the key is absent. Raises CasConflict after `max_attempts`.
    """
    rand = rng or random
    for attempt in range(max_attempts):
        value: T | None
        current_revision: int | None
        if attempt == 0 and read is not None:
            value, current_revision = read.value, read.revision
        else:
            value, current_revision = await bucket.read(key)
        current = Versioned(value, current_revision) if value is not None and current_revision is not None else None
        new_value = mutate(value)
        if new_value is None:
            return current
        if current_revision is None:
            revision = await bucket.create(key, new_value)
        else:
            if value is None:
                log.warning("kv_value_repaired", bucket=bucket.name, key=key, revision=current_revision)
            revision = await bucket.update(key, new_value, current_revision)
        if revision is not None:
            return Versioned(new_value, revision)
        if on_conflict is not None:
            on_conflict()
        await asyncio.sleep(rand.uniform(0.0, 0.002 * (2 ** min(attempt, 6))))
    raise CasConflict(f"{bucket.name}/{key}: compare-and-swap lost {max_attempts} races in a row")


@dataclass
class Bus:
    """One NATS connection and every stream/bucket handle a service needs."""

    nc: NATS
    js: JetStreamContext
    models: TypedBucket[ModelSpec]
    gpus: TypedBucket[GpuRecord]
    replicas: TypedBucket[ReplicaRecord]
    nodes: TypedBucket[NodeRecord]

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()


NODE_TTL_S = 15.0
"""A node whose agent has not heartbeated for this long disappears from ``shoal_nodes``."""


def _stream_configs() -> list[StreamConfig]:
    return [
        StreamConfig(
            name=subjects.REQUESTS_STREAM,
            description="Shoal inference requests; one durable pull consumer per model, shared by its replicas",
            subjects=[f"{subjects.INFER_PREFIX}.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            duplicate_window=120.0,
            max_age=3600.0,
        ),
        StreamConfig(
            name=subjects.EVENTS_STREAM,
            description="Shoal cluster events: placement, eviction, sleep, wake, preemption, failure",
            subjects=[f"{subjects.EVENT_PREFIX}.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_msgs=100_000,
            max_age=7 * 24 * 3600.0,
        ),
    ]


def _bucket_configs(node_ttl_s: float) -> list[KeyValueConfig]:
    return [
        KeyValueConfig(
            bucket=subjects.MODELS_BUCKET,
            description="Shoal models: ModelSpec per model token, with measured serving memory",
            history=5,
            storage=StorageType.FILE,
        ),
        KeyValueConfig(
            bucket=subjects.GPUS_BUCKET,
            description="Shoal GPUs: one key per <node>.<index>; occupants, intents, wake lock; CAS only",
            history=5,
            storage=StorageType.FILE,
        ),
        KeyValueConfig(
            bucket=subjects.REPLICAS_BUCKET,
            description="Shoal replicas: <model token>.<replica id> -> node, GPUs, bytes, level, state",
            history=5,
            storage=StorageType.FILE,
        ),
        KeyValueConfig(
            bucket=subjects.NODES_BUCKET,
            description="Shoal nodes: capacity and heartbeat (entries expire without heartbeats)",
            history=1,
            ttl=node_ttl_s,
            storage=StorageType.FILE,
        ),
    ]


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != JS_STREAM_NAME_EXISTS:
            raise
        # Exists with another configuration (an older or newer Shoal): bring it to ours.
        await js.update_stream(config)


async def _ensure_bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    try:
        return await js.create_key_value(config)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != JS_STREAM_NAME_EXISTS:
            raise
        log.warning("kv_bucket_config_differs", bucket=config.bucket, detail=exc.description)
        return await js.key_value(config.bucket)


async def ensure_resources(js: JetStreamContext, *, node_ttl_s: float = NODE_TTL_S) -> dict[str, KeyValue]:
    """Create (or leave as they are) every stream and bucket of the NATS contract."""
    for stream in _stream_configs():
        await _ensure_stream(js, stream)
    buckets: dict[str, KeyValue] = {}
    for bucket in _bucket_configs(node_ttl_s):
        buckets[bucket.bucket] = await _ensure_bucket(js, bucket)
    return buckets


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    node_ttl_s: float = NODE_TTL_S,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
) -> Bus:
    """Connect to NATS as `name`, create Shoal's streams and buckets, return the handles."""

    async def error_cb(exc: Exception) -> None:
        log.warning("nats_error", client=name, error=repr(exc))

    async def disconnected_cb() -> None:
        log.info("nats_disconnected", client=name)
        if on_disconnect is not None:
            await on_disconnect()

    try:
        nc = await nats.connect(
            url,
            name=name,
            connect_timeout=connect_timeout_s,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            allow_reconnect=True,
        )
    except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
        raise BusError(f"cannot connect to NATS at {url}: {exc}") from exc
    js = nc.jetstream(timeout=10.0)
    try:
        kvs = await ensure_resources(js, node_ttl_s=node_ttl_s)
    except Exception:
        await nc.close()
        raise
    return Bus(
        nc=nc,
        js=js,
        models=TypedBucket(kvs[subjects.MODELS_BUCKET], model_spec_decoder, subjects.MODELS_BUCKET, js),
        gpus=TypedBucket(kvs[subjects.GPUS_BUCKET], gpu_record_decoder, subjects.GPUS_BUCKET, js),
        replicas=TypedBucket(kvs[subjects.REPLICAS_BUCKET], replica_record_decoder, subjects.REPLICAS_BUCKET, js),
        nodes=TypedBucket(kvs[subjects.NODES_BUCKET], node_record_decoder, subjects.NODES_BUCKET, js),
    )


async def ensure_model_consumer(js: JetStreamContext, model_key: str, *, ack_wait_s: float = 30.0) -> str:
    """Create (idempotently) the durable pull consumer every replica of `model_key` shares.

    Replicas send in-progress acks while generating, so `ack_wait_s` only
    bounds how long a dead worker's message waits before redelivery.
    """
    durable = subjects.consumer_name(model_key)
    config = ConsumerConfig(
        durable_name=durable,
        description=f"Shoal replicas of {model_key}",
        filter_subject=subjects.infer_subject(model_key),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=MAX_DELIVERIES,
        max_ack_pending=4096,
        max_waiting=512,
    )
    try:
        await js.add_consumer(subjects.REQUESTS_STREAM, config)
    except nats.js.errors.BadRequestError as exc:
        # 10148: exists with another config (an older Shoal); keep serving with it.
        if exc.err_code != JS_CONSUMER_ALREADY_EXISTS:
            raise
        log.warning("consumer_config_differs", consumer=durable, detail=exc.description)
    return durable


async def publish_event(js: JetStreamContext, event: Event) -> None:
    """Record `event` in ``SHOAL_EVENTS``; a failure to record is logged, never raised."""
    try:
        await js.publish(subjects.event_subject(event.kind), encode_json(event))
    except (TimeoutError, nats.errors.Error) as exc:
        log.warning("event_publish_failed", kind=event.kind, error=str(exc))
