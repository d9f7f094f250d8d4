"""Connecting to NATS, creating Shoal's streams and buckets, typed KV access with CAS.

`connect()` returns a `Bus`: the connection, its JetStream context and one
`TypedBucket` per KV bucket of the NATS contract. Every service calls it at start,
in any order: a stream or bucket that is missing is created (with
``nats.replicas`` replicas), one that exists is used as it is. Shoal never updates
an existing stream: an operator's changes (``nats stream edit``: replicas, limits)
survive every restart; differences from what Shoal would create are logged.
"""

from __future__ import annotations

import asyncio
import random
import ssl
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

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
from shoal.shared.config import NatsConfig
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
from shoal.shared.nats_connect import connect_options, redacted_url
from shoal.shared.nats_permissions import Role

log = structlog.get_logger(__name__)

T = TypeVar("T", bound=msgspec.Struct)
T2 = TypeVar("T2")

# JetStream API error codes Shoal branches on (nats-server's errors.json).
JS_STREAM_NAME_EXISTS = 10058
"""JSStreamNameExistErr: the stream (or KV bucket) exists with a different configuration."""
JS_WRONG_LAST_SEQUENCE = 10071
"""JSStreamWrongLastSequenceErrF: a CAS write lost (the key changed since the given revision)."""
JS_WRONG_LAST_SEQUENCE_CONSTANT = 10164
"""JSStreamWrongLastSequenceConstantErr: the same, from newer servers."""
JS_NO_MESSAGE_FOUND = 10037
"""JSNoMessageFoundErr: a stream message (to get) is not there (any more)."""
JS_SEQUENCE_NOT_FOUND = 10043
"""JSSequenceNotFoundErrF: what deleting a message that a purge (a model removed) took answers."""
JS_MESSAGE_DELETE_FAILED = 10057
"""JSStreamMsgDeleteFailedF: a delete failed; "no message found" when it was taken already."""

JS_CONSUMER_ALREADY_EXISTS = 10148
"""JSConsumerAlreadyExists: a consumer of that name exists with another configuration."""
MAX_DELIVERIES = 10
"""JetStream delivers a request at most this often: a backstop. Hand-backs (drains, barrier
NAKs) count here too, so it is well above the budget that matters, which the gateway keeps:
a request two replicas died running is given up (`gateway.dispatch.MAX_REPLICA_DEATHS`)."""
MOVED_ATTEMPT_OFFSET = MAX_DELIVERIES
"""`InferenceRequest.attempt_offset` of a request moved from a replica's own subject to the
shared one: the first replica's attempts were 1..MAX_DELIVERIES, the moved ones come after."""
REPLICA_CONSUMER_INACTIVE_S = 3600.0
"""A replica's own consumer that nobody pulls from this long (its worker died) is deleted
by the server; a worker that stops deletes its own."""
GET_ALL_INACTIVE_S = 5.0
"""Server-side lifetime of a `get_all` consumer once nothing reads it (a safety net:
`get_all` deletes it itself)."""
GET_ALL_BATCH = 256
"""KV entries fetched per round trip by `get_all`."""
GET_ALL_ATTEMPTS = 3
"""A `get_all` that JetStream answers with "unavailable" is tried this often."""


def is_message_gone(exc: nats.js.errors.APIError) -> bool:
    """Whether getting or deleting a stream message failed because it is not there any more
    (acked, deleted, purged), not for another reason."""
    if exc.err_code in (JS_NO_MESSAGE_FOUND, JS_SEQUENCE_NOT_FOUND):
        return True
    description = (exc.description or "").lower()
    return exc.err_code == JS_MESSAGE_DELETE_FAILED and ("no message found" in description
                                                         or "not found" in description)


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

        A read that JetStream answers with "unavailable" (a cluster moving a leader) is
        started over, up to GET_ALL_ATTEMPTS times.

        Args:
            malformed: if given, the keys whose current value does not decode are added to it
                (they are absent from the result, and logged).
        """
        for attempt in range(1, GET_ALL_ATTEMPTS + 1):
            try:
                return await self._read_all(prefix, malformed)
            except nats.js.errors.ServiceUnavailableError:
                if attempt == GET_ALL_ATTEMPTS:
                    raise
                log.info("kv_read_retrying", bucket=self.name, attempt=attempt)
                await asyncio.sleep(0.2 * attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _read_all(self, prefix: str, malformed: set[str] | None) -> dict[str, Versioned[T]]:
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


def _stream_configs(replicas: int = 1) -> list[StreamConfig]:
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
            num_replicas=replicas,
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
            num_replicas=replicas,
        ),
    ]


def _bucket_configs(node_ttl_s: float, replicas: int = 1) -> list[KeyValueConfig]:
    return [
        KeyValueConfig(
            bucket=subjects.MODELS_BUCKET,
            description="Shoal models: ModelSpec per model token, with measured serving memory",
            history=5,
            storage=StorageType.FILE,
            replicas=replicas,
        ),
        KeyValueConfig(
            bucket=subjects.GPUS_BUCKET,
            description="Shoal GPUs: one key per <node>.<index>; occupants, intents, wake lock; CAS only",
            history=5,
            storage=StorageType.FILE,
            replicas=replicas,
        ),
        KeyValueConfig(
            bucket=subjects.REPLICAS_BUCKET,
            description="Shoal replicas: <model token>.<replica id> -> node, GPUs, bytes, level, state",
            history=5,
            storage=StorageType.FILE,
            replicas=replicas,
        ),
        KeyValueConfig(
            bucket=subjects.NODES_BUCKET,
            description="Shoal nodes: capacity and heartbeat (entries expire without heartbeats)",
            history=1,
            ttl=node_ttl_s,
            storage=StorageType.FILE,
            replicas=replicas,
        ),
    ]


_COMPARED_FIELDS = ("subjects", "retention", "storage", "num_replicas", "max_age", "max_msgs",
                    "duplicate_window", "discard")
_CONTRACT_FIELDS = ("subjects", "retention")
"""Fields Shoal relies on: a stream that differs there is logged as an error (and kept)."""


_COMPARED_BUCKET_FIELDS = ("subjects", "storage", "num_replicas", "max_age")


def _differences(ours: StreamConfig, theirs: StreamConfig, fields: tuple[str, ...]
                 ) -> dict[str, tuple[object, object]]:
    """Field -> (what Shoal would create, what the stream has), for the `fields` that differ."""
    found = {}
    for name in fields:
        mine, have = getattr(ours, name), getattr(theirs, name)
        if mine not in (None, 0) and mine != have:  # None, 0: the server's default
            found[name] = (mine, have)
    return found


class StreamMissing(BusError):
    """A stream or bucket of the NATS contract does not exist, and this connection may not
    (or was told not to) create it."""


class CreateRefused(BusError):
    """The server refused this NATS user the creation of a stream (its permissions)."""


@dataclass
class PermissionRefusals:
    """The subjects the server refused this connection (its ``-ERR`` lines, lower-cased by
    nats-py), so a refused JetStream request fails at once instead of at its timeout."""

    subjects: set[str] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def note(self, error: Exception) -> None:
        text = str(error)
        marker = "permissions violation for publish to "
        if marker in text.lower():
            self.subjects.add(text.lower().split(marker, 1)[1].strip().strip("'\"").strip('"'))
            self.changed.set()

    async def guard(self, request: Awaitable[T2], subject: str) -> T2:
        """`request`'s result, or CreateRefused as soon as the server refuses `subject`."""
        task = asyncio.ensure_future(request)
        wanted = subject.lower()
        while wanted not in self.subjects:
            self.changed.clear()
            waiter = asyncio.ensure_future(self.changed.wait())
            done, _ = await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if task in done:
                return task.result()
        task.cancel()
        raise CreateRefused(f"this NATS user may not publish to {subject}")


async def _ensure_stream(js: JetStreamContext, config: StreamConfig, refusals: PermissionRefusals | None,
                         *, create: bool) -> None:
    """Create `config`'s stream if it is missing; an existing one is kept as it is."""
    assert config.name is not None, "every Shoal stream has a name"
    try:
        info = await js.stream_info(config.name)
    except nats.js.errors.NotFoundError:
        if not create:
            raise StreamMissing(f"stream {config.name} does not exist") from None
        try:
            request = js.add_stream(config)
            await (refusals.guard(request, f"$JS.API.STREAM.CREATE.{config.name}") if refusals else request)
            log.info("stream_created", stream=config.name, replicas=config.num_replicas)
            return
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != JS_STREAM_NAME_EXISTS:  # else: another process created it meanwhile
                raise
        info = await js.stream_info(config.name)
    _log_kept(config, info.config, _COMPARED_FIELDS)


def _log_kept(ours: StreamConfig, theirs: StreamConfig, fields: tuple[str, ...]) -> None:
    differences = _differences(ours, theirs, fields)
    if not differences:
        return
    shown = {name: {"shoal": str(mine), "stream": str(have)} for name, (mine, have) in differences.items()}
    if any(name in _CONTRACT_FIELDS for name in differences):
        log.error("stream_contract_differs", stream=ours.name, differences=shown,
                  detail="Shoal relies on these fields; fix the stream (nats stream edit) or delete it")
    else:
        log.info("stream_config_kept", stream=ours.name, differences=shown)


async def ensure_expiring_bucket(js: JetStreamContext, bucket: str, description: str, *, ttl_s: float,
                                 max_bytes: int, storage: StorageType) -> KeyValue:
    """`ensure_bucket` for a cache: one revision per key, each gone `ttl_s` after its last
    write, at most `max_bytes` in all."""
    config = KeyValueConfig(bucket=bucket, description=description, history=1, ttl=ttl_s, max_bytes=max_bytes,
                            storage=storage)
    return await ensure_bucket(js, config)


async def ensure_bucket(js: JetStreamContext, config: KeyValueConfig, refusals: PermissionRefusals | None = None,
                        *, create: bool = True) -> KeyValue:
    """Create `config`'s bucket if it is missing; an existing one is kept as it is (what
    differs from `config` is logged)."""
    try:
        kv = await js.key_value(config.bucket)
    except nats.js.errors.BucketNotFoundError:
        if not create:
            raise StreamMissing(f"KV bucket {config.bucket} does not exist") from None
        try:
            request = js.create_key_value(config)
            kv = await (refusals.guard(request, f"$JS.API.STREAM.CREATE.KV_{config.bucket}") if refusals
                        else request)
            log.info("kv_bucket_created", bucket=config.bucket, replicas=config.replicas)
            return kv
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != JS_STREAM_NAME_EXISTS:  # else: another process created it meanwhile
                raise
        kv = await js.key_value(config.bucket)
    info = await js.stream_info(f"KV_{config.bucket}")
    ours = StreamConfig(name=f"KV_{config.bucket}", subjects=[f"$KV.{config.bucket}.>"], storage=config.storage,
                        num_replicas=config.replicas, max_age=config.ttl or None)
    _log_kept(ours, info.config, _COMPARED_BUCKET_FIELDS)
    return kv


async def ensure_resources(js: JetStreamContext, *, node_ttl_s: float = NODE_TTL_S, replicas: int = 1,
                           create: bool = True, refusals: PermissionRefusals | None = None
                           ) -> dict[str, KeyValue]:
    """Create every stream and bucket of the NATS contract that is missing (with `replicas`
    replicas); leave the ones that exist as they are.

    Args:
        create: False: only find them (StreamMissing for one that is not there).
        refusals: the connection's refused subjects: a create the server refuses raises
            CreateRefused at once.
    """
    for stream in _stream_configs(replicas):
        await _ensure_stream(js, stream, refusals, create=create)
    buckets: dict[str, KeyValue] = {}
    for bucket in _bucket_configs(node_ttl_s, replicas):
        buckets[bucket.bucket] = await ensure_bucket(js, bucket, refusals, create=create)
    return buckets


SETUP_TIMEOUT_S = 30.0
"""How long `connect` retries creating or finding the streams while JetStream is unavailable
(a cluster electing its leaders)."""
STREAMS_WAIT_S = 120.0
"""How long a connection whose user may not create streams waits for them to appear."""


async def connect(
    url: str,
    name: str,
    *,
    nats_config: NatsConfig | None = None,
    role: Role | None = None,
    connect_timeout_s: float = 5.0,
    node_ttl_s: float = NODE_TTL_S,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
) -> Bus:
    """Connect to NATS as `name`, create what is missing of Shoal's streams and buckets, return
    the handles.

    Args:
        url: the server URL, or several comma-separated (a cluster: the client reconnects to
            another server when its own goes).
        nats_config: credentials, TLS and stream replicas (`NatsConfig`; its own `url` is not
            read: `url` is the one to use, e.g. an embedded server's).
        role: which Shoal service connects: its inbox prefix, for the per-service permissions
            (`shared/nats_permissions.py`); None for tools and tests (nats-py's default).
    """
    settings = nats_config or NatsConfig()
    shown_url = redacted_url(url)

    refusals = PermissionRefusals()
    refused_at_connect: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

    async def error_cb(exc: Exception) -> None:
        refusals.note(exc)
        if not refused_at_connect.done() and not nc.is_connected and _is_permanent_refusal(exc):
            refused_at_connect.set_result(exc)
        log.warning("nats_error", client=name, error=repr(exc))

    async def disconnected_cb() -> None:
        log.info("nats_disconnected", client=name)
        if on_disconnect is not None:
            await on_disconnect()

    async def reconnected_cb() -> None:
        server = nc.connected_url.geturl() if nc.connected_url else ""
        log.info("nats_reconnected", client=name, server=redacted_url(server))

    servers = [s.strip() for s in url.split(",") if s.strip()]
    nc = NATS()
    # nats-py annotates both timeouts as int but takes them as float seconds.
    timeouts: dict[str, Any] = {"connect_timeout": connect_timeout_s, "reconnect_time_wait": 0.5}
    connecting = asyncio.ensure_future(nc.connect(
        servers=servers,
        name=name,
        max_reconnect_attempts=-1,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
        allow_reconnect=True,
        **timeouts,
        **connect_options(settings, role),
    ))
    try:
        # nats-py retries a refused first connect for ever: a wrong password never gets right.
        racing: list[asyncio.Future[Any]] = [connecting, refused_at_connect]
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            await nc.close()
            raise BusError(f"NATS at {shown_url} refused {name}: {refused_at_connect.result()} (check the "
                           f"[nats] credentials and TLS settings)")
        connecting.result()
    except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
        raise BusError(f"cannot connect to NATS at {shown_url}: {exc}") from exc
    except nats.errors.Error as exc:  # authorization refused, TLS required...
        raise BusError(f"NATS at {shown_url} refused {name}: {exc}") from exc
    js = nc.jetstream(timeout=10.0)
    try:
        kvs = await _set_up(js, node_ttl_s=node_ttl_s, replicas=settings.replicas, refusals=refusals)
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


def _is_permanent_refusal(error: Exception) -> bool:
    """A connect error no retry cures: wrong credentials, a certificate the other side refuses."""
    text = str(error).lower()
    return isinstance(error, ssl.SSLError) or "authorization violation" in text or "authentication" in text


async def _set_up(js: JetStreamContext, *, node_ttl_s: float, replicas: int, refusals: PermissionRefusals
                  ) -> dict[str, KeyValue]:
    """`ensure_resources`, retried while JetStream is unavailable (a cluster electing its
    leaders: up to SETUP_TIMEOUT_S). A user that may not create streams (a gateway, a worker)
    waits for them instead, up to STREAMS_WAIT_S (a scheduler or node agent creates them)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETUP_TIMEOUT_S
    create = True
    while True:
        try:
            return await ensure_resources(js, node_ttl_s=node_ttl_s, replicas=replicas, create=create,
                                          refusals=refusals)
        except CreateRefused as exc:
            log.info("waiting_for_streams", reason=str(exc),
                     detail="this NATS user may not create Shoal's streams; a scheduler or node agent does")
            create, deadline = False, loop.time() + STREAMS_WAIT_S
        except StreamMissing as exc:
            if loop.time() > deadline:
                raise StreamMissing(f"{exc}, and this NATS user may not create it: start a scheduler or a "
                                    f"node agent (their users may)") from exc
            await asyncio.sleep(1.0)
        except (TimeoutError, nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
            if loop.time() > deadline:
                raise BusError(f"JetStream did not answer while setting up Shoal's streams: {exc!r}") from exc
            log.info("jetstream_unavailable_retrying", error=repr(exc))
            await asyncio.sleep(0.5)


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


async def ensure_replica_consumer(js: JetStreamContext, model_key: str, replica_id: str, *,
                                  ack_wait_s: float = 30.0) -> str:
    """Create (idempotently) the durable pull consumer of one replica's own subject
    (`subjects.replica_infer_subject`): the session turns gateways send to this replica."""
    name = subjects.replica_consumer_name(replica_id)
    config = ConsumerConfig(
        durable_name=name,
        description=f"Shoal replica {replica_id} of {model_key}: session turns sent to it",
        filter_subject=subjects.replica_infer_subject(model_key, replica_id),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=MAX_DELIVERIES,
        max_ack_pending=4096,
        max_waiting=64,
        inactive_threshold=REPLICA_CONSUMER_INACTIVE_S,
    )
    try:
        await js.add_consumer(subjects.REQUESTS_STREAM, config)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != JS_CONSUMER_ALREADY_EXISTS:
            raise
        log.warning("consumer_config_differs", consumer=name, detail=exc.description)
    return name


async def publish_event(js: JetStreamContext, event: Event) -> None:
    """Record `event` in ``SHOAL_EVENTS``; a failure to record is logged, never raised."""
    try:
        await js.publish(subjects.event_subject(event.kind), encode_json(event))
    except (TimeoutError, nats.errors.Error) as exc:
        log.warning("event_publish_failed", kind=event.kind, error=str(exc))
