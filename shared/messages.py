"""Every message Shoal puts on NATS, as msgspec Structs, in one module.

Channels and encodings:

* hot path (msgpack): `InferenceRequest` on ``shoal.infer.<model>``; `Reply`
  (`TokenChunk` | `FinalReply` | `ErrorReply`) on the request's reply subject;
  `CancelRequest` on ``shoal.cancel.<model>``.
* control plane (JSON, what `nats kv get` shows): the KV records `ModelSpec`,
  `GpuRecord`, `ReplicaRecord`, `NodeRecord`; `SchedulerCommand` and
  `NodeCommand` requests with their replies; `WorkerEvent`; `Event`.

Wire Structs never forbid unknown fields: an older service skips the fields a
newer one added (rolling upgrades). Decoders are built once, here.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec
from msgspec import Struct, field

from shoal.shared.subjects import replica_name

# --------------------------------------------------------------------------- hot path


class ChatMessage(Struct, omit_defaults=True):
    role: str
    content: str
    name: str | None = None


class SamplingParams(Struct, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    top_k: int = 0
    """Sample among the k most likely tokens; 0: no limit."""
    min_p: float = 0.0
    """Drop tokens less likely than this fraction of the most likely one."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def is_reproducible(self) -> bool:
        """Greedy or seeded sampling: a redelivered attempt yields the same tokens."""
        return self.temperature == 0.0 or self.seed is not None


class InferenceRequest(Struct, tag="infer", tag_field="type", omit_defaults=True):
    """One OpenAI request, as the gateway publishes it to ``SHOAL_REQUESTS``."""

    request_id: str
    model: str
    params: SamplingParams
    deadline: float
    """Unix time after which nobody waits for the answer: workers term the message."""
    reply_to: str
    prompt: str | None = None
    """Completions: the prompt text."""
    prompt_token_ids: list[int] | None = None
    """Completions: a prompt given as token ids."""
    messages: list[ChatMessage] | None = None
    """Chat completions: rendered with the model's chat template by the worker."""
    stream: bool = False
    gateway_id: str = ""
    created: float = 0.0
    session_id: str | None = None


class TokenChunk(Struct, tag="chunk", tag_field="type", omit_defaults=True):
    """Text of one or more new tokens. (request_id, attempt, seq) orders chunks;
    seq counts chunks within one attempt from 0."""

    request_id: str
    attempt: int
    seq: int
    text: str
    num_tokens: int = 1
    replica_id: str = ""


class FinalReply(Struct, tag="final", tag_field="type", omit_defaults=True):
    """Last message of a successful attempt, with exact usage counts."""

    request_id: str
    attempt: int
    seq: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    replica_id: str = ""


class ErrorReply(Struct, tag="error", tag_field="type", omit_defaults=True):
    """A request that failed in the worker; `status` is the HTTP status the gateway answers."""

    request_id: str
    attempt: int
    status: int
    message: str
    error_type: str = "server_error"
    code: str | None = None
    replica_id: str = ""
    param: str | None = None
    """The request field at fault, when the worker knows it (OpenAI's ``error.param``)."""


Reply = TokenChunk | FinalReply | ErrorReply


class CancelRequest(Struct, tag="cancel", tag_field="type"):
    request_id: str
    reason: str = "client disconnected"


# --------------------------------------------------------------------------- KV records

Level = Literal["HOT", "WARM", "COLD"]
ReplicaState = Literal["pending", "loading", "ready", "draining", "sleeping", "stopping", "failed"]
OccupantState = Literal["reserved", "loading", "serving", "draining", "sleeping"]


class FairnessSpec(Struct, omit_defaults=True):
    min_runtime_s: float = 10.0
    """A replica serves at least this long before it can be preempted."""
    max_wait_s: float = 5.0
    """A waiting model waits this long for memory to free up before it preempts."""
    popular: bool = False
    """Never preempted."""


class ModelSpec(Struct, kw_only=True, omit_defaults=True):
    """A served model, as kept in ``shoal_models`` under its model token."""

    key: str
    """The name clients use (``model`` in OpenAI requests)."""
    path: str
    """Directory of the transformers checkpoint, relative to the models root."""
    dtype: str = "auto"
    max_model_len: int | None = None
    kv_cache_tokens: int = 4096
    """KV budget: tokens of KV cache the replica reserves beyond its weights."""
    memory_override_bytes: int | None = None
    """Operator-given serving memory per replica; beats the estimate, not a measurement."""
    estimated_bytes: int | None = None
    """From the model's config: parameters x dtype bytes + KV budget + runtime overhead."""
    measured_serving_bytes: int | None = None
    """Measured on a node after load and warm-up; beats everything else."""
    measured_at: float | None = None
    weight_bytes: int | None = None
    """Raw checkpoint size: what a WARM replica holds in CPU RAM (filled in by inspection)."""
    num_parameters: int | None = None
    num_gpus: int = 1
    dedicated: bool = False
    """Dedicated replicas are never evicted under memory pressure."""
    desired_replicas: int = 0
    max_queue: int | None = None
    lease_owner: str | None = None
    """The scheduler committing a plan that changes this model's replicas right now."""
    lease_until: float | None = None
    """A lease left by a crashed scheduler lapses at this time."""
    num_failures: int = 0
    """Replicas that failed in a row (reset when one becomes ready)."""
    last_error: str | None = None
    hold_until: float | None = None
    """After repeated failures, no new replica is placed before this time."""
    fairness: FairnessSpec = field(default_factory=FairnessSpec)
    idle_timeout_s: float | None = None
    source: str = "config"
    registered_at: float = 0.0


class Occupant(Struct, omit_defaults=True):
    """One replica's share of one GPU, inside a `GpuRecord`."""

    replica_id: str
    model: str
    num_bytes: int
    state: OccupantState
    since: float
    last_accessed: float = 0.0
    dedicated: bool = False
    owner: str | None = None
    """The scheduler that reserved it."""
    expires_at: float | None = None
    """A reservation not yet backed by a replica record lapses after this time."""


class PreemptionIntent(Struct, omit_defaults=True):
    model: str
    replica_id: str
    bytes: int
    since: float


class WakeLock(Struct):
    holder: str
    acquired_at: float
    expires_at: float


class GpuRecord(Struct, kw_only=True, omit_defaults=True):
    """One GPU in ``shoal_gpus`` under ``<node>.<index>``; every change is a CAS."""

    node_id: str
    index: int
    total_bytes: int
    name: str = ""
    virtual: bool = False
    occupants: list[Occupant] = field(default_factory=list)
    intents: list[PreemptionIntent] = field(default_factory=list)
    wake_lock: WakeLock | None = None
    updated_at: float = 0.0

    @property
    def reserved_bytes(self) -> int:
        """Bytes held by occupants that hold GPU memory (sleeping ones hold none)."""
        return sum(o.num_bytes for o in self.occupants if o.state != "sleeping")

    @property
    def available_bytes(self) -> int:
        return self.total_bytes - self.reserved_bytes

    def find(self, replica_id: str) -> Occupant | None:
        return next((o for o in self.occupants if o.replica_id == replica_id), None)


class ReplicaRecord(Struct, kw_only=True, omit_defaults=True):
    """One replica in ``shoal_replicas`` under ``<model token>.<replica id>``."""

    replica_id: str
    model: str
    node_id: str
    gpu_bytes: dict[int, int] = field(default_factory=dict)
    """Bytes reserved per GPU index on `node_id`."""
    gpu_memory_fraction: float | None = None
    """Single-GPU replicas: the fraction of the GPU they may use; None for multi-GPU."""
    level: Level = "HOT"
    state: ReplicaState = "pending"
    dedicated: bool = False
    cpu_bytes: int = 0
    """Host RAM the replica's weights take when parked WARM."""
    created_at: float = 0.0
    updated_at: float = 0.0
    scheduler_id: str = ""
    pid: int | None = None
    error: str | None = None
    measured_bytes: int | None = None
    ready_at: float | None = None
    """When it first served; a replica that fails before that never came up."""

    @property
    def name(self) -> str:
        return replica_name(self.model, self.replica_id)

    @property
    def serving(self) -> bool:
        return self.level == "HOT" and self.state == "ready"


class GpuInfo(Struct, omit_defaults=True):
    index: int
    total_bytes: int
    name: str = ""
    virtual: bool = False


class NodeRecord(Struct, kw_only=True, omit_defaults=True):
    """A node agent in ``shoal_nodes`` (a bucket with TTL: heartbeats keep it alive)."""

    node_id: str
    hostname: str
    gpus: list[GpuInfo]
    cpu_ram_bytes: int
    virtual: bool = False
    heartbeat_at: float = 0.0
    started_at: float = 0.0
    version: str = ""
    num_workers: int = 0


# --------------------------------------------------------------------------- commands


class EnsureModel(Struct, tag="ensure", tag_field="type"):
    """Gateway -> scheduler: make sure `model` has at least `min_replicas` replicas placed."""

    model: str
    min_replicas: int = 1


class RegisterModel(Struct, tag="register", tag_field="type"):
    spec: ModelSpec


class RemoveModel(Struct, tag="remove", tag_field="type"):
    model: str


class ScaleModel(Struct, tag="scale", tag_field="type"):
    model: str
    num_replicas: int


class EvictReplicas(Struct, tag="evict", tag_field="type"):
    """Evict one replica (`replica_id`) or every replica of `model`."""

    model: str
    replica_id: str | None = None


class ReplicaFailed(Struct, tag="replica_failed", tag_field="type"):
    """Node agent -> scheduler: a replica's worker failed; free it and re-place."""

    model: str
    replica_id: str
    error: str


SchedulerCommand = EnsureModel | RegisterModel | RemoveModel | ScaleModel | EvictReplicas | ReplicaFailed


class SchedulerReply(Struct, omit_defaults=True):
    ok: bool
    status: str
    """``placed`` | ``serving`` | ``pending`` | ``cant_accommodate`` | ``not_found`` | ``invalid`` | ``ok``."""
    message: str = ""
    model: ModelSpec | None = None
    replicas: list[ReplicaRecord] = field(default_factory=list)
    retry_after_s: float | None = None


class CreateReplica(Struct, tag="create", tag_field="type"):
    """Scheduler -> node agent: start a worker process for `replica` of `model`."""

    replica: ReplicaRecord
    model: ModelSpec


class StopReplica(Struct, tag="stop", tag_field="type"):
    replica_id: str
    reason: str = ""


class CacheReplica(Struct, tag="to_cache", tag_field="type"):
    """Park a replica WARM: drain, weights to CPU RAM, GPU memory given back."""

    replica_id: str


class RestoreReplica(Struct, tag="from_cache", tag_field="type"):
    """Bring a WARM replica back onto the GPUs of its (new) allocation and serve again."""

    replica: ReplicaRecord


class InspectModel(Struct, tag="inspect", tag_field="type"):
    """Scheduler -> any node agent (they hold the models): read a model's config and size."""

    path: str
    dtype: str = "auto"
    kv_cache_tokens: int = 4096


NodeCommand = CreateReplica | StopReplica | CacheReplica | RestoreReplica | InspectModel


class ModelFacts(Struct, omit_defaults=True):
    """What a node agent learned of a model from its files, without loading weights."""

    weight_bytes: int
    num_parameters: int
    estimated_bytes: int
    max_model_len: int | None = None
    architecture: str = ""


class NodeReply(Struct, omit_defaults=True):
    ok: bool
    message: str = ""
    pid: int | None = None


class WorkerReply(Struct, omit_defaults=True):
    ok: bool
    message: str = ""
    measured_bytes: int | None = None


class WorkerEvent(Struct, tag="worker_event", tag_field="type", omit_defaults=True):
    """Worker -> its node agent: lifecycle of one replica."""

    replica_id: str
    kind: Literal["loading", "ready", "failed", "cached", "restored", "stopped"]
    message: str = ""
    measured_bytes: int | None = None
    weight_bytes: int | None = None
    pid: int | None = None


class Event(Struct, omit_defaults=True):
    """A record in ``SHOAL_EVENTS`` (``shoal.event.<kind>``): placement, eviction, failure..."""

    kind: str
    at: float
    message: str = ""
    model: str | None = None
    replica_id: str | None = None
    node_id: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- codecs

msgpack_encoder = msgspec.msgpack.Encoder()
json_encoder = msgspec.json.Encoder()

request_decoder = msgspec.msgpack.Decoder(InferenceRequest)
reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)  # type: ignore[arg-type]
cancel_decoder = msgspec.msgpack.Decoder(CancelRequest)
scheduler_command_decoder: msgspec.json.Decoder[SchedulerCommand] = msgspec.json.Decoder(
    SchedulerCommand  # type: ignore[arg-type]
)
scheduler_reply_decoder = msgspec.json.Decoder(SchedulerReply)
node_command_decoder: msgspec.json.Decoder[NodeCommand] = msgspec.json.Decoder(NodeCommand)  # type: ignore[arg-type]
node_reply_decoder = msgspec.json.Decoder(NodeReply)
worker_reply_decoder = msgspec.json.Decoder(WorkerReply)
model_facts_decoder = msgspec.json.Decoder(ModelFacts)
worker_event_decoder = msgspec.json.Decoder(WorkerEvent)
event_decoder = msgspec.json.Decoder(Event)

model_spec_decoder = msgspec.json.Decoder(ModelSpec)
gpu_record_decoder = msgspec.json.Decoder(GpuRecord)
replica_record_decoder = msgspec.json.Decoder(ReplicaRecord)
node_record_decoder = msgspec.json.Decoder(NodeRecord)


def encode_msgpack(message: Struct) -> bytes:
    return msgpack_encoder.encode(message)


def encode_json(message: Struct) -> bytes:
    return json_encoder.encode(message)


def now() -> float:
    """Wall-clock seconds; records and deadlines cross processes, so not monotonic."""
    return time.time()
