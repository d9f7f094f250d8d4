"""Every message Shoal puts on NATS, as msgspec Structs, in one module.

Channels and encodings:

* hot path (msgpack): `InferenceRequest` on ``shoal.infer.<model>`` (any replica) or
  ``shoal.infer.<model>.<replica>`` (a session's turn sent to the replica holding its KV); `Reply`
  (`TokenChunk` | `FinalReply` | `ErrorReply` | `AttemptNotice`) on the request's reply subject;
  `CancelRequest` on ``shoal.cancel.<model>``.
* worker stats (JSON, what ``nats sub 'shoal.stats.>'`` shows): `WorkerStats` on
  ``shoal.stats.<model>.<replica>``, every few seconds from each worker; gateways serve
  them on ``/metrics`` and the dashboard.
* control plane (JSON, what `nats kv get` shows): the KV records `ModelSpec`,
  `GpuRecord`, `ReplicaRecord`, `NodeRecord`, `SessionRoute` (``shoal_sessions``);
  `Event` on ``shoal.event.<kind>``;
  the commands of the micro services, one type per subject:

      shoal.scheduler.ensure            EnsureModel      -> SchedulerReply
      shoal.scheduler.register          RegisterModel    -> SchedulerReply
      shoal.scheduler.remove            RemoveModel      -> SchedulerReply
      shoal.scheduler.scale             ScaleModel       -> SchedulerReply
      shoal.scheduler.evict             EvictReplicas    -> SchedulerReply
      shoal.scheduler.replica_failed    ReplicaFailed    -> SchedulerReply
      shoal.node.<node>.create          CreateReplica    -> NodeReply
      shoal.node.<node>.stop            StopReplica      -> NodeReply
      shoal.node.<node>.to_cache        CacheReplica     -> NodeReply
      shoal.node.<node>.from_cache      RestoreReplica   -> NodeReply
      shoal.node.<node>.worker_event    WorkerEvent      -> NodeReply
      shoal.node.inspect                InspectModel     -> ModelFacts   (any node agent)
      shoal.worker.<replica>.to_cache   CacheReplica     -> WorkerReply
      shoal.worker.<replica>.from_cache RestoreReplica   -> WorkerReply
      shoal.worker.<replica>.sessions   ListSessions     -> SessionList
      shoal.worker.<replica>.drop_session DropSession    -> DropSessionReply

  (`SCHEDULER_COMMANDS` maps each scheduler verb to its type.)

Wire Structs never forbid unknown fields: an older service skips the fields a
newer one added (rolling upgrades). Decoders are built once, here.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from shoal.shared.model_settings import DEFAULT_KV_CACHE_TOKENS, MAX_REPLICAS, ModelSettings
from shoal.shared.subjects import REPLICA_ID_PATTERN, replica_name

ReplicaId = Annotated[str, Meta(pattern=REPLICA_ID_PATTERN)]
"""Every replica id on the wire or in a record: a decoder refuses any other (a forged id
must never become a subject, a KV key or a log file name)."""
ReplyReplicaId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{0,64}$")]
"""A reply's replica id ("" when unknown)."""
NumReplicas = Annotated[int, Meta(ge=0, le=MAX_REPLICAS)]
"""A replica count a command or a record may ask for (the scheduler refuses more)."""

# --------------------------------------------------------------------------- hot path


class ToolCall(Struct, omit_defaults=True):
    """A function call an assistant message made (OpenAI's ``tool_calls[]``)."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text, as the model wrote them."""


class ChatMessage(Struct, omit_defaults=True):
    role: str
    content: str
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant turn's function calls."""
    tool_call_id: str | None = None
    """A ``tool`` turn: the call whose result it holds."""


class ToolSpec(Struct, omit_defaults=True):
    """A function the model may call (OpenAI's ``tools[].function``), rendered into the prompt
    by the model's chat template."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """Its arguments' JSON schema."""


GREEDY_BELOW_TEMPERATURE = 1e-5
"""A temperature (or top_p) below this samples greedily (vLLM's ``_SAMPLING_EPS``)."""


class SamplingParams(Struct, omit_defaults=True):
    max_tokens: int = 16
    max_tokens_must_fit: bool = False
    """`max_tokens` is the client's own (OpenAI's chat and completions): a prompt that leaves
    less room than that in the context is refused (400, ``context_length_exceeded``), as OpenAI
    and vLLM refuse it; False: the answer stops where the context ends (finish reason "length")."""
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    """Generate at least this many tokens: until then the tokens that end generation are
    masked out of the choice and stop strings are not looked for (vLLM's)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """More tokens that end generation (finish reason "stop"), whatever `ignore_eos` says."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0: no limit."""
    min_p: float = 0.0
    """Drop tokens less likely than this fraction of the most likely one."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to these tokens' logits before sampling (OpenAI's ``logit_bias``: -100..100)."""
    logprobs: int | None = None
    """Report each generated token's log probability and this many most likely alternatives
    (0..20); None: no log probabilities."""
    json_schema: str | None = None
    """Structured output: the text must be JSON matching this schema (JSON text;
    ``response_format``, or a forced ``tool_choice``); None: free text."""
    regex: str | None = None
    """Structured output: the text must match this regular expression (vLLM's ``guided_regex``
    and ``guided_choice``); at most one of `json_schema` and `regex`."""
    grammar_after: str | None = None
    """The grammar shapes only the text after this marker (a reasoning model's ``</think>``):
    from the first token when the prompt ends with it (thinking off), else from the token after
    the one that completes it; None: all the text."""
    thinking_budget: int | None = None
    """A reasoning model's think block holds at most this many tokens; then the engine closes it
    and the answer starts (services/worker/engine/thinking.py). None: no bound."""
    thinking_start: str | None = None
    """With `thinking_budget`: the marker the answer opens its block with (Qwen3's ``<think>``);
    None: the prompt opened it (DeepSeek-R1's template)."""
    thinking_end: str = "</think>"
    """With `thinking_budget`: the marker that closes the block."""
    grammar_param: str = "response_format"
    """The request field the grammar (`json_schema` or `regex`) came from, named by an error about it."""
    echo: bool = False
    """Send the prompt back (`PromptEcho`) with the first chunk (completions' ``echo``)."""
    prompt_logprobs: int | None = None
    """With `echo`: each prompt token's log probability and this many alternatives; the
    prompt is then computed whole (no prefix-cache or session reuse)."""
    embed: bool = False
    """``/v1/embeddings``: no text; the prompt's embedding (its last token's final hidden
    state, L2-normalized, as vLLM pools a decoder model by default) ends the request."""
    embed_normalize: bool = True
    """With `embed`: the vector L2-normalized (False: as the model computed it; vLLM's
    ``normalize``, Ollama's older ``/api/embeddings``)."""
    truncate_prompt_tokens: int | None = None
    """Cut a longer prompt to this many tokens (-1: as many as the model's context takes with
    room for one more); None: a prompt too long for the context is a 400 (vLLM's)."""
    truncation_side: Literal["left", "right"] = "left"
    """Which end a cut prompt loses: ``left``, its start (vLLM's, for generation: the latest
    words stay), or ``right``, its end (Ollama's for embeddings)."""
    fit_context: bool = False
    """A prompt too long for the context is cut to fit, leaving room to answer, as Ollama's
    ``truncate`` does (services/worker/prompts.py `prompt_budget`): a chat first loses its oldest
    messages (system messages and the last one kept), then what is still too long loses the
    tokens after its first few; False: a prompt too long is a 400."""

    @property
    def has_grammar(self) -> bool:
        """Structured output: a JSON schema or a regular expression shapes the text."""
        return self.json_schema is not None or self.regex is not None

    def __post_init__(self) -> None:
        if self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_p < GREEDY_BELOW_TEMPERATURE:
            # Logits divided by a temperature this small overflow float32 (1e-45 is 0 there):
            # the softmax would be NaN; a top_p this small rounds to 0 in float32 and keeps no
            # token. Both mean "the most likely token": greedy, as vLLM does for temperatures.
            self.temperature = 0.0

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
    tools: list[ToolSpec] | None = None
    """Chat completions: the functions the chat template tells the model about."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Chat completions: more variables for the chat template (``enable_thinking``...)."""
    add_generation_prompt: bool = True
    """Chat completions: the template opens the assistant's turn after the messages."""
    continue_final_message: bool = False
    """Chat completions: the template leaves the last message (the assistant's) open, to be
    gone on with (vLLM's; without `add_generation_prompt`)."""
    stream: bool = False
    gateway_id: str = ""
    created: float = 0.0
    session_id: str | None = None
    """The chat session this request is a turn of (``X-Session-Id`` or the body's
    ``session_id``): a replica with a session cache keeps the turn's KV for the next turn."""
    attempt_offset: int = 0
    """Added to the delivery count to number this request's attempts: a request moved from a
    replica's own subject to the shared one (that replica went away or sleeps) is published
    again with `shoal.shared.bus.MOVED_ATTEMPT_OFFSET`, so its new attempts are newer than
    any the first replica made (the gateway's redelivery rule, `services/gateway/attempts.py`)."""


class TokenLogprob(Struct, array_like=True):
    """One generated token's log probability and the most likely alternatives at its place
    (the model's distribution, before penalties, bias and temperature); tokens as their bytes
    (`services/worker/token_bytes.py`)."""

    token: bytes
    logprob: float
    top: list[tuple[bytes, float]] = field(default_factory=list)


class PromptEcho(Struct, omit_defaults=True):
    """A request's prompt, sent back with its first chunk (``echo``)."""

    text: str
    """A prompt sent as token ids, decoded; "" for a text prompt (the gateway echoes it as the
    client sent it)."""
    first_token: bytes = b""
    """With log probabilities: the prompt's first token, which has none (nothing precedes it)."""
    logprobs: list[TokenLogprob] | None = None
    """Every later prompt token's, in order (asked by ``params.prompt_logprobs``)."""


class TokenChunk(Struct, tag="chunk", tag_field="type", omit_defaults=True):
    """Text of one or more new tokens. (request_id, attempt, seq) orders chunks;
    seq counts chunks within one attempt from 0."""

    request_id: str
    attempt: int
    seq: int
    text: str
    num_tokens: int = 1
    replica_id: ReplyReplicaId = ""
    token_hash: int = 0
    """Running hash of every token id this attempt generated up to this chunk
    (`services/worker/generation.py`, `next_token_hash`): a resumed attempt is checked against it before its text is
    spliced onto what the client already holds. 0: not computed (an older worker)."""
    logprobs: list[TokenLogprob] | None = None
    """The chunk's tokens' log probabilities, in order (requests that ask for them)."""
    prompt: PromptEcho | None = None
    """On an attempt's first chunk, for a request with ``params.echo``."""
    prompt_tokens: int = 0
    """On an attempt's first chunk: the prompt's tokens (the final reply counts them too; a
    stream that reports them first, Anthropic's ``message_start``, reads them here)."""


class FinalReply(Struct, tag="final", tag_field="type", omit_defaults=True):
    """Last message of a successful attempt, with exact usage counts."""

    request_id: str
    attempt: int
    seq: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    replica_id: ReplyReplicaId = ""
    cached_tokens: int = 0
    """Prompt tokens whose K/V the replica had (prefix cache, the session), not computed."""
    embedding: bytes | None = None
    """An embedding request's vector: float32, little-endian (`SamplingParams.embed`)."""
    stop_reason: str | None = None
    """The stop string that ended the answer (vLLM's ``stop_reason``); None when it ended
    otherwise (end of sequence, ``max_tokens``)."""


ErrorType = Literal["invalid_request_error", "timeout", "unavailable", "server_error"]
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""The ``code`` of an error for a prompt longer than the model (or the gateway) takes (OpenAI's name)."""
"""OpenAI's ``error.type`` of a worker's error (the gateway maps `status` to its own types)."""


class ErrorReply(Struct, tag="error", tag_field="type", omit_defaults=True):
    """A request that failed in the worker; `status` is the HTTP status the gateway answers."""

    request_id: str
    attempt: int
    status: int
    message: str
    error_type: ErrorType = "server_error"
    code: str | None = None
    replica_id: ReplyReplicaId = ""
    param: str | None = None
    """The request field at fault, when the worker knows it (OpenAI's ``error.param``)."""


class AttemptNotice(Struct, tag="attempt", tag_field="type", omit_defaults=True):
    """Worker -> gateway, outside the chunk sequence: an attempt started on a replica, or was
    handed back to the queue unfinished (a drain, a stop), so the gateway knows which replica
    holds its request now (docs/reliability.md)."""

    request_id: str
    attempt: int
    state: Literal["started", "handed_back"]
    replica_id: ReplyReplicaId = ""
    ack_subject: str = ""
    """The JetStream delivery's ack subject: if the replica dies, the gateway NAKs it, and the
    request is redelivered at once instead of after ``ack_wait``."""
    stream_seq: int = 0
    """The request's sequence number in ``SHOAL_REQUESTS``."""


Reply = TokenChunk | FinalReply | ErrorReply | AttemptNotice


class CancelRequest(Struct, tag="cancel", tag_field="type"):
    request_id: str
    reason: str = "client disconnected"


# --------------------------------------------------------------------------- KV records

Level = Literal["HOT", "WARM", "COLD"]
ReplicaState = Literal["pending", "loading", "ready", "draining", "sleeping", "stopping", "failed", "lost"]
"""``lost``: its node's heartbeats lapsed; its worker may still run, so its memory stays
counted until its node agent confirms the worker is gone (docs/reliability.md)."""
ACTIVE_REPLICA_STATES: tuple[ReplicaState, ...] = ("pending", "loading", "ready", "draining")
"""A replica in one of these serves or is on its way to serving (HOT, or being placed)."""
OccupantState = Literal["reserved", "loading", "serving", "draining", "sleeping"]
LoadPhase = Literal["placing", "starting", "loading_weights", "building_kernels", "warming_up"]
"""How far a replica on its way to serving is: ``placing`` (its record is written, no worker
yet), ``starting`` (the worker process starts: Python, torch), ``loading_weights``,
``building_kernels`` (Shoal's KV kernels: nvcc on a GPU, the C compiler on the CPU, cached
after the first time), ``warming_up`` (the engine: KV pool, a first forward pass)."""


class ModelSpec(ModelSettings, kw_only=True, omit_defaults=True):
    """A served model, as kept in ``shoal_models`` under its model token: the operator's
    `ModelSettings` plus what the cluster learned of it."""

    estimated_bytes: int | None = None
    """From the model's config: parameters x dtype bytes + KV budget + runtime overhead."""
    measured_serving_bytes: int | None = None
    """Measured on a node after load and warm-up; beats everything else."""
    measured_at: float | None = None
    weight_bytes: int | None = None
    """Raw checkpoint size: what a WARM replica holds in CPU RAM (filled in by inspection)."""
    num_parameters: int | None = None
    architecture: str = ""
    """The checkpoint's model class (``LlamaForCausalLM``), as inspection read it."""
    desired_replicas: NumReplicas = 0
    """The replicas the scheduler keeps placed (at least `min_replicas` at registration)."""
    lease_owner: str | None = None
    """The scheduler committing a plan that changes this model's replicas right now."""
    lease_until: float | None = None
    """A lease left by a crashed scheduler lapses at this time."""
    num_failures: int = 0
    """Replicas that failed in a row (reset when one becomes ready)."""
    last_error: str | None = None
    hold_until: float | None = None
    """After repeated failures, no new replica is placed before this time."""
    wake_blocked_until: float | None = None
    """A wake found no eligible victim (`wake_blocked_reason`): requests get 503 until then."""
    wake_blocked_reason: str | None = None
    source: Literal["config", "admin"] = "config"
    """Where it was registered from: shoal.toml or the admin API."""
    registered_at: float = 0.0

    def is_held(self, now: float) -> bool:
        """Whether placement is backing off after failures at `now` (`scheduler/backoff.py`)."""
        return self.hold_until is not None and self.hold_until > now

    @classmethod
    def from_settings(cls, settings: ModelSettings, *, source: Literal["config", "admin"], registered_at: float
                      ) -> ModelSpec:
        """A new registration: `settings` as given, nothing learned yet, `min_replicas` desired."""
        declared = msgspec.structs.asdict(settings)
        return cls(**declared, desired_replicas=settings.min_replicas, source=source, registered_at=registered_at)

    def as_registration(self) -> ModelSpec:
        """This spec as a new registration: its operator settings, the replicas it asks for (as
        a scale command could), source and time only. A register command carries a whole spec;
        what the cluster learns (measured memory, sizes, leases, failure holds) is never taken
        from a message a client could forge."""
        settings = ModelSettings(**{name: getattr(self, name) for name in ModelSettings.__struct_fields__})
        registration = ModelSpec.from_settings(settings, source=self.source, registered_at=self.registered_at)
        return msgspec.structs.replace(registration,
                                       desired_replicas=max(self.desired_replicas, settings.min_replicas))


class Occupant(Struct, omit_defaults=True):
    """One replica's share of one GPU, inside a `GpuRecord`.

    States: ``reserved`` (placed, its worker not started), ``loading``, ``serving``,
    ``draining`` (leaving: it drains and parks or stops, and holds its bytes until its node
    agent confirms it has), ``sleeping`` (parked WARM: holds only `residual_bytes`).
    """

    replica_id: ReplicaId
    model: str
    num_bytes: int
    """GPU bytes it holds on this GPU while not sleeping (its size when it wakes)."""
    state: OccupantState
    since: float
    """When it entered `state` (for ``serving``: when it started serving, the min-runtime clock)."""
    last_accessed: float = 0.0
    residual_bytes: int = 0
    """Sleeping: what its parked worker still holds on this GPU, measured after the park
    (a CUDA context, allocator slack); counted as taken."""
    owner: str | None = None
    """The scheduler that reserved it."""
    expires_at: float | None = None
    """A reservation not yet backed by a replica record lapses after this time."""

    @property
    def held_bytes(self) -> int:
        """GPU bytes it really holds now (a sleeping occupant: only its residue)."""
        return self.residual_bytes if self.state == "sleeping" else self.num_bytes


class PreemptionIntent(Struct, kw_only=True, omit_defaults=True):
    """A waking model's claim-in-waiting on one GPU (seed 001): the memory it needs there.

    Intents are served first come, first served (`shoal.shared.placement.fairness`): until
    its waker claims the memory, other placements see these bytes as taken."""

    model: str
    num_bytes: int
    since: float
    """When the wake wrote it: its fairness wait runs from here."""
    owner: str
    """The scheduler driving the wake; it refreshes `expires_at` while it lives."""
    expires_at: float
    """A crashed owner's intent lapses here."""
    interest_until: float = 0.0
    """Requests still wait for the model until then (any scheduler a gateway asks refreshes
    it); a wake nobody waits for any more is cancelled."""


class WakeLock(Struct, kw_only=True):
    """Held on each GPU a waker claims memory on, for the claim and the wake (seed 001)."""

    holder: str
    """``<scheduler id>/<model>``."""
    acquired_at: float
    expires_at: float
    """A crashed holder's lock lapses here."""


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
        """Bytes taken on this GPU: every occupant's, and sleeping ones' residue."""
        return sum(o.held_bytes for o in self.occupants)

    @property
    def available_bytes(self) -> int:
        return self.total_bytes - self.reserved_bytes

    def find(self, replica_id: str) -> Occupant | None:
        return next((o for o in self.occupants if o.replica_id == replica_id), None)


class ReplicaRecord(Struct, kw_only=True, omit_defaults=True):
    """One replica in ``shoal_replicas`` under ``<model token>.<replica id>``."""

    replica_id: ReplicaId
    model: str
    node_id: str
    gpu_bytes: dict[int, int] = field(default_factory=dict)
    """Bytes reserved per GPU index on `node_id`."""
    gpu_memory_fraction: float | None = None
    """Single-GPU replicas: the fraction of the GPU they may use; None for multi-GPU."""
    level: Level = "HOT"
    state: ReplicaState = "pending"
    leaving_to: Literal["WARM", "COLD"] | None = None
    """While ``draining``: where it goes once drained (parked WARM, or stopped)."""
    cpu_bytes: int = 0
    """Host RAM the replica's weights take when parked WARM."""
    weights_dropped: bool = False
    """Parked (or parking) as a cold sleep: its worker stays, its weights are dropped."""
    created_at: float = 0.0
    updated_at: float = 0.0
    scheduler_id: str = ""
    pid: int | None = None
    error: str | None = None
    measured_bytes: int | None = None
    ready_at: float | None = None
    """When it first served; a replica that fails before that never came up."""
    last_request_at: float = 0.0
    """When a request last started or finished on it (its worker writes it, at most once a second)."""
    num_in_flight: int = 0
    """Requests it was running at `last_request_at` (a stream counts until its last byte)."""
    phase: LoadPhase | None = None
    """While `state` is ``loading``: how far it got (the worker reports it to its node agent)."""
    kv_cache_tokens: int | None = None
    """Tokens the replica's KV pool holds, as its worker reported when ready (paged engine)."""

    @property
    def name(self) -> str:
        return replica_name(self.model, self.replica_id)

    @property
    def serving(self) -> bool:
        return self.level == "HOT" and self.state == "ready"

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_REPLICA_STATES

    @property
    def loading_phase(self) -> LoadPhase | None:
        """How far a replica on its way to serving is (None once it serves, or never will)."""
        if self.state == "pending":
            return "placing"
        return (self.phase or "starting") if self.state == "loading" else None


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
    min_replicas: NumReplicas = 1


class RegisterModel(Struct, tag="register", tag_field="type"):
    spec: ModelSpec


class RemoveModel(Struct, tag="remove", tag_field="type"):
    model: str


class ScaleModel(Struct, tag="scale", tag_field="type"):
    model: str
    num_replicas: NumReplicas
    """The desired replica count."""


class EvictReplicas(Struct, tag="evict", tag_field="type"):
    """Evict one replica (`replica_id`) or every replica of `model`."""

    model: str
    replica_id: ReplicaId | None = None


class ReplicaFailed(Struct, tag="replica_failed", tag_field="type"):
    """Node agent -> scheduler: a replica's worker failed; free it and re-place."""

    model: str
    replica_id: ReplicaId
    error: str


SchedulerCommand = EnsureModel | RegisterModel | RemoveModel | ScaleModel | EvictReplicas | ReplicaFailed
SCHEDULER_COMMANDS: dict[str, type[SchedulerCommand]] = {
    "ensure": EnsureModel,
    "register": RegisterModel,
    "remove": RemoveModel,
    "scale": ScaleModel,
    "evict": EvictReplicas,
    "replica_failed": ReplicaFailed,
}
"""Each scheduler verb (``shoal.scheduler.<verb>``) and the one command type it takes."""

SchedulerStatus = Literal[
    "ok", "placed", "serving", "waking", "cant_accommodate", "no_victim", "contended", "failing",
]
"""``ok``: done; ``placed``: replicas were placed (loading); ``serving``: a replica serves;
``waking``: the model waits for GPU memory (its fairness wait, a preemption, or the claim);
``cant_accommodate``: no room, even with evictions; ``no_victim``: memory is short and no
occupant may be preempted (the message says why); ``contended``: placement kept losing CAS
races; ``failing``: the model's replicas keep failing and placement backs off."""
FAILED_STATUSES: tuple[SchedulerStatus, ...] = ("cant_accommodate", "no_victim", "contended", "failing")


class SchedulerReply(Struct, omit_defaults=True):
    ok: bool
    status: SchedulerStatus
    message: str = ""
    model: ModelSpec | None = None
    replicas: list[ReplicaRecord] = field(default_factory=list)
    retry_after_s: float | None = None


class CreateReplica(Struct, tag="create", tag_field="type"):
    """Scheduler -> node agent: start a worker process for `replica` of `model`."""

    replica: ReplicaRecord
    model: ModelSpec


class StopReplica(Struct, tag="stop", tag_field="type"):
    replica_id: ReplicaId
    reason: str = ""


class CacheReplica(Struct, tag="to_cache", tag_field="type"):
    """Park a replica WARM: drain, weights to CPU RAM, GPU memory given back."""

    replica_id: ReplicaId
    drop_weights: bool = False
    """Cold sleep: the weights are dropped too (no host RAM held for them) and reloaded from the
    model's files on wake; the process stays."""


class RestoreReplica(Struct, tag="from_cache", tag_field="type"):
    """Bring a WARM replica back onto the GPUs of its (new) allocation and serve again."""

    replica: ReplicaRecord


class PingWorker(Struct, tag="ping", tag_field="type"):
    """Is this replica's worker alive and on the bus? Asked by a gateway when the replica's node
    is lost (its agent silent): a worker that answers may still be serving its requests."""

    replica_id: ReplicaId


class InspectModel(Struct, tag="inspect", tag_field="type"):
    """Scheduler -> any node agent (they hold the models): read a model's config and size."""

    path: str
    dtype: str = "auto"
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS


NodeCommand = CreateReplica | StopReplica | CacheReplica | RestoreReplica
"""What a scheduler sends to one node agent (each on its own verb subject)."""


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
    """After a restore: what the replica holds now."""
    residual_bytes: int | None = None
    """After a park: what the worker still holds on its GPUs (0 on virtual GPUs)."""
    weights_dropped: bool | None = None
    """After a park: whether its weights were dropped (a cold sleep that could not drop them
    parks warm, holding them in host RAM)."""


class WorkerEvent(Struct, tag="worker_event", tag_field="type", omit_defaults=True):
    """Worker -> its node agent: lifecycle of one replica."""

    replica_id: ReplicaId
    kind: Literal["loading", "ready", "failed", "cached", "restored", "stopped"]
    message: str = ""
    measured_bytes: Annotated[int, Meta(ge=0)] | None = None
    weight_bytes: Annotated[int, Meta(ge=0)] | None = None
    pid: int | None = None
    phase: LoadPhase | None = None
    """With ``loading``: the phase the worker enters now."""
    token: str = ""
    """The event token its node agent gave the worker at launch (`WorkerLaunch.event_token`):
    the agent ignores events without it, so no other client can report for the replica (and,
    say, lower its model's measured memory)."""
    kv_cache_tokens: int | None = None
    """With ``ready``: tokens its engine's KV pool holds (paged engine)."""


class KvCacheStats(Struct, omit_defaults=True):
    """A paged engine's KV block pool, inside `WorkerStats`."""

    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    """Blocks an allocation may take: free plus cached-free (prefix cache) blocks."""
    block_bytes: int = 0
    num_cache_queries: int = 0
    """Full blocks looked up in the prefix cache, since the worker started."""
    num_cache_hits: int = 0
    """Of those, blocks found (their K/V reused)."""


class SessionStats(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A worker engine's session cache (docs/sessions.md): what `SessionKV.get_stats` returns,
    and what a worker publishes inside `WorkerStats` (counts there are totals since the
    worker started, across the engines a park and restore make)."""

    num_sessions: int = 0
    """Sessions cached between turns."""
    gpu_bytes: int = 0
    """KV pool bytes held by cached sessions."""
    cpu_bytes: int = 0
    """Host pool bytes holding sessions' chunks (copies ahead included)."""
    host_pool_bytes: int = 0
    num_hits: int = 0
    """Turns with a session id that reused cached KV of their session."""
    num_misses: int = 0
    """Turns with a session id that found nothing of it to reuse (unknown, expired, edited)."""
    num_gpu_reused_tokens: int = 0
    """Prompt tokens whose K/V a returning turn found in the KV pool."""
    num_cpu_restored_tokens: int = 0
    """Prompt tokens whose K/V was copied back from the host pool."""
    num_prefix_cached_tokens: int = 0
    """Tokens of copied-out or dropped chunks taken back from the prefix cache instead."""
    num_recomputed_tokens: int = 0
    """History tokens recomputed: dropped chunks (or chunks cheaper to recompute than copy)."""
    num_new_tokens: int = 0
    """Prompt tokens of returning turns past what their session had cached."""
    swap_in_bytes: int = 0
    """Bytes copied CPU -> GPU (restored chunks)."""
    swap_out_bytes: int = 0
    """Bytes copied GPU -> CPU (demotions and copies ahead)."""
    exposed_swap_seconds: float = 0.0
    """Time forward passes waited for copies back to the GPU (not overlapped with compute)."""
    num_demoted_chunks: int = 0
    num_dropped_chunks: int = 0
    num_expired_sessions: int = 0


SESSION_GAUGES = ("num_sessions", "gpu_bytes", "cpu_bytes", "host_pool_bytes")
"""`SessionStats` fields that are current values; every other field is a count."""


class WorkerStats(Struct, kw_only=True, omit_defaults=True):
    """Worker -> gateways, every `interval_s` on ``shoal.stats.<model>.<replica>``: what one
    replica is doing. Counts (``num_*`` not ``_running``/``_waiting``) are totals since the
    worker started; gateways serve them as Prometheus counters."""

    replica_id: ReplicaId
    model: str
    node_id: str
    at: float
    interval_s: float
    """The next stats come this long after these (a replica silent for a few intervals is gone)."""
    engine: str = ""
    """``paged`` or ``hf``."""
    serving: bool = True
    """False while parked WARM or draining before a park (no engine, or no new requests)."""
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    """Taken from the queue, waiting in the engine for room in a batch."""
    num_requests_by_outcome: dict[str, int] = field(default_factory=dict)
    """Finished requests: ok, cancelled, rejected, error, expired."""
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    last_request_at: float | None = None
    """When it last took a request (unix time)."""
    kv_cache: KvCacheStats | None = None
    """None for an engine without a paged pool, or while parked."""
    num_preemptions: int = 0
    num_steps: int = 0
    """Engine steps (forward passes) run."""
    num_step_seqs: int = 0
    """Sequences summed over those steps (mean batch size: num_step_seqs / num_steps)."""
    step_seconds: float = 0.0
    """Time those steps took."""
    sessions: SessionStats | None = None
    """The engine's session cache; None without one (or while parked)."""


class ListSessions(Struct, tag="sessions", tag_field="type"):
    """Gateway -> one replica (``shoal.worker.<replica>.sessions``): the sessions it holds."""


class SessionSummary(Struct, omit_defaults=True):
    """One session a replica holds: cached between turns, or with a turn running now."""

    session_id: str
    active: bool = False
    """A turn of it runs now (its KV belongs to the turn: no figures until it ends)."""
    num_tokens: int = 0
    """Tokens whose KV the session keeps (in whole blocks)."""
    gpu_bytes: int = 0
    cpu_bytes: int = 0
    num_dropped_tokens: int = 0
    """Leading tokens whose KV was dropped (recomputed when the session returns)."""
    idle_s: float = 0.0
    """Since its last turn ended."""


class SessionList(Struct, omit_defaults=True):
    """A replica's sessions, least recently active first, then those with a turn running."""

    replica_id: str
    model: str
    node_id: str = ""
    enabled: bool = False
    """Whether the replica's engine keeps sessions at all (a paged engine with a session cache)."""
    sessions: list[SessionSummary] = field(default_factory=list)
    stats: SessionStats | None = None
    """The session cache's figures (this engine's own counts, since it was built)."""


class Tokenize(Struct, tag="tokenize", tag_field="type", omit_defaults=True):
    """Gateway -> one replica (``shoal.worker.<replica>.tokenize``): the prompt tokens `request`
    would be generated from (its chat template applied, as generation applies it)."""

    request: InferenceRequest
    token_strs: bool = False
    """Each token's text too."""


class TokenizeReply(Struct, omit_defaults=True):
    tokens: list[int]
    max_model_len: int
    token_strs: list[str] | None = None


class Detokenize(Struct, tag="detokenize", tag_field="type"):
    """Gateway -> one replica (``shoal.worker.<replica>.detokenize``): token ids' text."""

    tokens: list[int]


class DetokenizeReply(Struct):
    prompt: str


class DropSession(Struct, tag="drop_session", tag_field="type"):
    """Gateway -> one replica (``shoal.worker.<replica>.drop_session``): forget a session's KV."""

    session_id: str


class DropSessionReply(Struct, omit_defaults=True):
    replica_id: str
    dropped: bool = False
    """Its cached KV was forgotten."""
    active: bool = False
    """A turn of it runs now: that turn's KV is kept when it ends (drop again afterwards)."""


class SessionRoute(Struct, omit_defaults=True):
    """``shoal_sessions`` under ``<model token>.<session id>``: the replica whose KV holds the
    session (the last turn's final reply named it). Written by gateways, read by every gateway;
    the bucket's TTL forgets routes idle for the session idle time."""

    replica_id: str
    updated_at: float = 0.0


EventKind = Literal[
    "model_registered", "model_removed",
    "replica_placed", "replica_evicted", "replica_ready", "replica_cached", "replica_stopped", "replica_failed",
    "replica_preempted", "replica_slept", "preemption_intent", "wake_lock_taken", "wake_lock_released",
    "wake_started", "wake_done", "wake_failed", "wake_cancelled",
]


class Event(Struct, omit_defaults=True):
    """A record in ``SHOAL_EVENTS`` (``shoal.event.<kind>``): placement, eviction, failure..."""

    kind: EventKind
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

scheduler_command_decoders = {verb: msgspec.json.Decoder(kind) for verb, kind in SCHEDULER_COMMANDS.items()}
scheduler_reply_decoder = msgspec.json.Decoder(SchedulerReply)
create_replica_decoder = msgspec.json.Decoder(CreateReplica)
stop_replica_decoder = msgspec.json.Decoder(StopReplica)
cache_replica_decoder = msgspec.json.Decoder(CacheReplica)
restore_replica_decoder = msgspec.json.Decoder(RestoreReplica)
ping_worker_decoder = msgspec.json.Decoder(PingWorker)
node_command_decoders: dict[str, msgspec.json.Decoder[Any]] = {
    "create": create_replica_decoder,
    "stop": stop_replica_decoder,
    "to_cache": cache_replica_decoder,
    "from_cache": restore_replica_decoder,
}
"""Each scheduler-facing node agent verb (``shoal.node.<node>.<verb>``) and the decoder of its type."""
inspect_model_decoder = msgspec.json.Decoder(InspectModel)
worker_event_decoder = msgspec.json.Decoder(WorkerEvent)
node_reply_decoder = msgspec.json.Decoder(NodeReply)
worker_reply_decoder = msgspec.json.Decoder(WorkerReply)
model_facts_decoder = msgspec.json.Decoder(ModelFacts)
worker_stats_decoder = msgspec.json.Decoder(WorkerStats)
list_sessions_decoder = msgspec.json.Decoder(ListSessions)
session_list_decoder = msgspec.json.Decoder(SessionList)
drop_session_decoder = msgspec.json.Decoder(DropSession)
tokenize_decoder = msgspec.json.Decoder(Tokenize)
tokenize_reply_decoder = msgspec.json.Decoder(TokenizeReply)
detokenize_decoder = msgspec.json.Decoder(Detokenize)
detokenize_reply_decoder = msgspec.json.Decoder(DetokenizeReply)
drop_session_reply_decoder = msgspec.json.Decoder(DropSessionReply)
session_route_decoder = msgspec.json.Decoder(SessionRoute)

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
