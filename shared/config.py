"""Shoal's configuration: msgspec Structs loaded from ``shoal.toml`` plus env overrides.

Every setting is declared once, here or in a Struct this module nests (a model's
fields: `shoal.shared.model_settings`; placement: `shoal.shared.placement.config`).

Precedence, lowest first: defaults here < the TOML file < ``SHOAL_<SECTION>_<FIELD>``
environment variables (e.g. ``SHOAL_GATEWAY_PORT=9000``, ``SHOAL_NATS_URL=...``)
< command-line flags (applied by the CLI). Unknown keys and bad values are
errors that name the offending key. Every ``*_bytes`` setting also takes a size
string (``"16GiB"``, ``"512MiB"``).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec
from msgspec import Struct, field

from shoal.kernels.settings import KernelSettings
from shoal.shared.errors import ShoalError
from shoal.shared.kv_cache.session_settings import SessionSettings
from shoal.shared.model_memory import DEFAULT_RUNTIME_OVERHEAD_BYTES
from shoal.shared.model_settings import FairnessSettings, ModelSettings, SleepSettings
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.subjects import validate_node_id

ENV_PREFIX = "SHOAL_"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "B": 1,
    "K": 1000, "KB": 1000, "KI": 1024, "KIB": 1024,
    "M": 1000**2, "MB": 1000**2, "MI": 1024**2, "MIB": 1024**2,
    "G": 1000**3, "GB": 1000**3, "GI": 1024**3, "GIB": 1024**3,
    "T": 1000**4, "TB": 1000**4, "TI": 1024**4, "TIB": 1024**4,
}


class ConfigError(ShoalError, ValueError):
    """The configuration file, an environment override or a flag is invalid."""


def parse_bytes(text: str | int) -> int:
    """``"16GiB"`` -> 17179869184; plain integers are bytes."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"byte size must be >= 0, got {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ConfigError(f"not a byte size: {text!r} (examples: 512MiB, 16GiB, 80GB, 1073741824)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").upper()])


MAX_STREAM_REPLICAS = 5
"""JetStream's own bound on a stream's replicas."""
DEFAULT_MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
"""The embedded server's ``max_payload`` (and compose's): above `GatewayConfig.max_body_bytes`,
so every body the gateway accepts fits in one request message."""


class NatsCredentials(Struct, forbid_unknown_fields=True, kw_only=True):
    """One way to authenticate to NATS (or none): user/password, a token, an NKey seed or a
    ``.creds`` file."""

    user: str = ""
    password: str = ""
    """With ``user``: user/password authentication."""
    token: str = ""
    """Token authentication."""
    nkey_seed_file: str = ""
    """A file holding an NKey user seed (``SU...``): NKey authentication."""
    creds_file: str = ""
    """A ``.creds`` file (a user JWT and its seed, decentralised auth: ``nsc generate creds``)."""

    def __post_init__(self) -> None:
        methods = [name for name, value in (("user/password", self.user), ("token", self.token),
                                            ("nkey_seed_file", self.nkey_seed_file),
                                            ("creds_file", self.creds_file)) if value]
        if len(methods) > 1:
            raise ValueError(f"nats: use one way to authenticate, not {' and '.join(methods)}")
        if self.password and not self.user:
            raise ValueError("nats: a password needs a user")

    @property
    def is_set(self) -> bool:
        return bool(self.user or self.token or self.nkey_seed_file or self.creds_file)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_shown_fields(self)})"


_SECRET_FIELDS = ("password", "token")


def _shown_fields(struct: Struct) -> str:
    """`struct`'s fields for a repr, secrets masked (a config object must never leak one into a log)."""
    return ", ".join(f"{name}={'***' if name in _SECRET_FIELDS and value else repr(value)}"
                     for name, value in msgspec.structs.asdict(struct).items())


class NatsConfig(NatsCredentials, forbid_unknown_fields=True, kw_only=True):
    """How every Shoal process reaches NATS: servers, credentials, TLS, stream replicas.

    Secrets (``password``, ``token``) come from shoal.toml or the environment
    (``SHOAL_NATS_PASSWORD``), never from a command-line flag; a worker gets them from its
    node agent on stdin. ``repr`` hides them, and so do the logs (`redacted_url`)."""

    url: str = ""
    """NATS server URL, or several comma-separated (a cluster's servers: a client moves to
    another one when its server goes). Empty: `shoal up` starts an embedded nats-server.
    No credentials in it: ``user``/``password`` and the rest."""
    store_dir: str = ""
    """JetStream store of the embedded server. Empty: <state_dir>/jetstream."""
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    """The embedded server's largest message. An external server's is its own
    ``max_payload`` (the gateway reads it from the server: a larger request is a 413)."""
    replicas: int = 1
    """Replicas of each stream and KV bucket Shoal creates: 1 on one server, 3 on a 3-node
    cluster. Applied when a stream is created only: an existing stream keeps what it has (an
    operator changes it with ``nats stream edit``; Shoal never undoes that)."""
    tls_ca_file: str = ""
    """CA bundle to verify the server with (TLS); empty: the system's."""
    tls_cert_file: str = ""
    """Client certificate (mutual TLS), with ``tls_key_file``."""
    tls_key_file: str = ""
    tls: bool = False
    """Use TLS even without any file above (a server with a publicly trusted certificate);
    any ``tls_*`` file turns it on too, as does a ``tls://`` URL."""
    workers: NatsCredentials = field(default_factory=NatsCredentials)
    """``[nats.workers]``: the credentials a node agent hands the workers it starts (a less
    privileged NATS user than its own); none set: its own."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("nats.tls_cert_file and nats.tls_key_file go together (mutual TLS)")
        if not 1 <= self.replicas <= MAX_STREAM_REPLICAS:
            raise ValueError(f"nats.replicas must be in 1..{MAX_STREAM_REPLICAS}, got {self.replicas}")
        if self.max_payload_bytes < 1024:
            raise ValueError("nats.max_payload_bytes must be >= 1024")
        for server in self.servers:
            if "@" in server.partition("://")[2].partition("/")[0]:
                raise ValueError("nats.url must not hold credentials (they would show in logs and `ps`): "
                                 "set nats.user and nats.password (SHOAL_NATS_USER, SHOAL_NATS_PASSWORD) "
                                 "or nats.token instead")

    @property
    def servers(self) -> list[str]:
        """The server URLs of `url` (several for a cluster)."""
        return [s.strip() for s in self.url.split(",") if s.strip()]

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls or self.tls_ca_file or self.tls_cert_file
                    or any(s.startswith("tls://") for s in self.servers))

    def for_workers(self, url: str) -> NatsConfig:
        """What a node agent hands its workers: these settings at `url`, with `workers`'
        credentials instead of its own when any are set."""
        credentials = self.workers if self.workers.is_set else self
        return msgspec.structs.replace(
            self, url=url, user=credentials.user, password=credentials.password, token=credentials.token,
            nkey_seed_file=credentials.nkey_seed_file, creds_file=credentials.creds_file,
            workers=NatsCredentials())


_ORIGIN = re.compile(r"[a-z][a-z0-9+.\-]*://[a-z0-9.\-\[\]:]+(?::\*)?")
"""A web origin (lower case, as browsers send it): scheme (``http``, ``https``, an app's or an
extension's), host, optional port or ``:*`` for any port; no path."""


class GatewayConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8000
    gateway_id: str = ""
    """Unique per gateway process (reply subjects). Empty: generated at start."""
    api_keys: list[str] = field(default_factory=list)
    """Bearer keys for /v1 routes. Empty: no key needed."""
    admin_api_keys: list[str] = field(default_factory=list)
    """Bearer keys for /admin routes. Empty: admin routes are open only when api_keys is empty too."""
    request_timeout_s: float = 300.0
    """Default deadline of a request; must cover a cold start (spawn + import + load)."""
    max_queue_per_model: int = 256
    """Requests per model waiting or running in this gateway before 429."""
    capacity_wait_s: float = 0.0
    """How long a request may wait (within `request_timeout_s`) for a model that cannot be
    woken yet because no occupant of its GPUs may be preempted (all inside their minimum
    runtime) or placements keep colliding, asking the scheduler again after each Retry-After,
    as Ollama queues a request while models swap. 0: answer 503 with Retry-After at once."""
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int = 1_000_000
    stream_keepalive_s: float = 5.0
    """A stream with nothing to send for this long (a cold start, a replica restarting) gets
    an SSE comment line saying what it waits for, and again every this long."""
    responses_ttl_s: float = 86400.0
    """How long a stored Responses API answer is kept (``previous_response_id``, ``GET
    /v1/responses/{id}``); set when the first gateway creates the ``shoal_responses`` bucket."""
    files_ttl_s: float = 30 * 86400.0
    """How long the Batch API's files and batches are kept (``shoal_files``, ``shoal_batches``;
    set when the first gateway creates them)."""
    max_file_bytes: int = 200 * 1024 * 1024
    """The largest file ``POST /v1/files`` takes (OpenAI's limit for a batch file)."""
    files_max_bytes: int = 10 * 1024**3
    """The most the ``shoal_files`` object store holds in all (set when it is created)."""
    batch_concurrency: int = 8
    """Requests of one batch a gateway has in flight at once."""
    max_running_batches: int = 2
    """Batches one gateway runs at once (the others wait, oldest first, for any gateway)."""
    batch_save_interval_s: float = 30.0
    """How often a running batch's new answers are saved (one part in the object store), so
    that a gateway taking it over (this one stopped or died) sends only the rest."""
    insecure_open_admin: bool = False
    """Serve /admin with no key on a non-loopback address (anyone who reaches the gateway may
    register, remove and scale models). Without it such a gateway refuses to start."""
    cors_origins: list[str] = field(default_factory=list)
    """Web pages (``scheme://host[:port]``, or ``*`` for any) whose scripts may call the
    gateway from a browser (CORS; Ollama's ``OLLAMA_ORIGINS``). Empty: none."""

    def __post_init__(self) -> None:
        self.cors_origins = [origin.lower() for origin in self.cors_origins]
        for origin in self.cors_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"gateway.cors_origins: {origin!r} is not an origin (scheme://host[:port], "
                                 f"scheme://host:* or *)")
        if not 0 < self.port < 65536:
            raise ValueError(f"gateway.port must be in 1..65535, got {self.port}")
        if self.request_timeout_s <= 0:
            raise ValueError("gateway.request_timeout_s must be > 0")
        if self.max_queue_per_model < 1:
            raise ValueError("gateway.max_queue_per_model must be >= 1")
        if not 0 <= self.capacity_wait_s < float("inf"):
            raise ValueError("gateway.capacity_wait_s must be a number >= 0 (0: answer 503 at once)")
        if self.stream_keepalive_s <= 0:
            raise ValueError("gateway.stream_keepalive_s must be > 0")
        if self.responses_ttl_s <= 0:
            raise ValueError("gateway.responses_ttl_s must be > 0")
        if self.max_body_bytes < 1024 or self.max_prompt_chars < 1:
            raise ValueError("gateway.max_body_bytes must be >= 1024 and max_prompt_chars >= 1")
        if self.files_ttl_s <= 0 or self.max_file_bytes < 1 or self.files_max_bytes < self.max_file_bytes:
            raise ValueError("gateway.files_ttl_s and max_file_bytes must be > 0, and files_max_bytes at least "
                             "max_file_bytes")
        if self.batch_concurrency < 1 or self.max_running_batches < 1:
            raise ValueError("gateway.batch_concurrency and max_running_batches must be >= 1")
        if not 1 <= self.batch_save_interval_s < float("inf"):
            raise ValueError("gateway.batch_save_interval_s must be a number >= 1 (a taker reads every part)")


class SchedulerConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    scheduler_id: str = ""
    """Unique per scheduler process. Empty: generated at start."""
    reservation_ttl_s: float = 60.0
    """A GPU reservation not backed by a replica record lapses after this."""
    reconcile_interval_s: float = 5.0
    stalled_step_s: float = 60.0
    """A replica record still ``pending`` or ``draining`` this long after its plan, whose
    scheduler is gone (or dropped the step), has its node step sent again by any scheduler."""
    stop_grace_s: float = 30.0
    """On stop (SIGTERM), node steps under way may finish for this long before they are cut
    short (what is cut short is finished by a reconciler: stalled_step_s)."""
    node_lost_after_s: float = 10.0
    """A node whose heartbeat record has been missing this long (while this scheduler stays
    connected: a NATS outage starts the count again) has its replicas marked ``lost``."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """The placement policy's knobs (docs/placement.md)."""

    def __post_init__(self) -> None:
        if min(self.reservation_ttl_s, self.reconcile_interval_s, self.stalled_step_s) <= 0 \
                or min(self.stop_grace_s, self.node_lost_after_s) < 0:
            raise ValueError("scheduler: reservation_ttl_s, reconcile_interval_s and stalled_step_s > 0; "
                             "stop_grace_s and node_lost_after_s >= 0")


class NodeConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    node_id: str = ""
    """Unique per node agent. Empty: derived from the host name (`node_id_or_default`)."""
    gpus: str = "virtual:2x16GiB"
    """``nvml`` (real GPUs), or ``virtual:<count>x<size>`` (e.g. virtual:2x16GiB)."""
    models_root: str = "./models"
    """Model paths are relative to it and may not leave it."""
    cpu_ram_bytes: int = 0
    """Host RAM offered to WARM replicas. 0: the machine's total RAM."""
    heartbeat_interval_s: float = 3.0
    worker_start_timeout_s: float = 180.0
    """A worker not ready by then is stopped and its replica failed."""
    worker_fork_server: bool = True
    """Start workers as forks of a fork server that imported torch, transformers and the engine
    once (services/worker/forkserver.py): each starts loading its model seconds sooner. Off:
    every worker is a new Python process that imports them itself."""
    reconcile_interval_s: float = 5.0
    """How often the agent compares its worker processes with the replica records (and stops
    workers no record accounts for: docs/reliability.md)."""

    def __post_init__(self) -> None:
        if self.node_id:
            validate_node_id(self.node_id)
        parse_gpu_spec(self.gpus)
        if self.cpu_ram_bytes < 0 or self.heartbeat_interval_s <= 0 or self.worker_start_timeout_s <= 0 \
                or self.reconcile_interval_s <= 0:
            raise ValueError("node: cpu_ram_bytes >= 0, heartbeat_interval_s > 0, worker_start_timeout_s > 0, "
                             "reconcile_interval_s > 0")

    def node_id_or_default(self) -> str:
        return self.node_id or default_node_id()


DEFAULT_HOST_POOL_BYTES = 256 * 1024**2


class SessionConfig(SessionSettings, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[worker.sessions]``: the session cache of every worker's engine (docs/sessions.md).
    The engine's `SessionSettings` with unknown keys refused, plus whether it is on."""

    enabled: bool = True
    """Keep chat sessions' KV between turns (requests with a session id). Off: a session id
    changes nothing."""
    host_pool_bytes: int = DEFAULT_HOST_POOL_BYTES
    """The CPU tier of each replica: host RAM (pinned on CUDA) beside its GPU allocation;
    0: GPU tier only. A bare engine's default is 0; a worker's is 256 MiB (size it to the
    sessions you expect: a few GiB per GPU for 7B models, docs/sessions.md)."""


class WorkerConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """How every worker process runs (the node agent hands it to the workers it starts)."""

    engine: Literal["paged", "hf"] = "paged"
    """``paged`` (Shoal's continuous-batching engine) or ``hf`` (plain transformers generate)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_num_seqs: int = 64
    """Most requests one replica's engine holds (running and waiting)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one forward pass (longer prompts are prefilled in chunks)."""
    prefix_caching: bool = True
    """Reuse the KV of prompt prefixes other requests computed (block hashes, LRU of freed
    blocks). Off only to measure what it saves (scripts/bench_sessions_live.py)."""
    torch_threads: int = 0
    """Intra-op threads of each worker's torch ops. 0: torch's default (the cores)."""
    cpu_threads: int | Literal["auto"] = "auto"
    """Threads of the CPU engine's native forward pass (docs/engine.md, "Threads"): a number
    for every pass, or ``auto``: each pass takes one thread, or as many as the worker may use
    (the cores of its CPU affinity, at most ``torch_threads`` when set) when its products are
    large enough to share, so small models never wait on a second thread that the event loop,
    NATS or the gateway holds."""
    runtime_overhead_bytes: int = DEFAULT_RUNTIME_OVERHEAD_BYTES
    """CUDA context and allocator slack a replica holds besides weights, activations and KV
    (real GPUs only); part of the memory estimate made from a model's config."""
    kernels: KernelSettings = field(default_factory=KernelSettings)
    """Which KV-cache kernel implementations the worker runs (``[worker.kernels]``, docs/kernels.md)."""
    stats_interval_s: float = 5.0
    """How often each worker publishes its stats (``shoal.stats.>``: /metrics, the dashboard)."""
    sessions: SessionConfig = field(default_factory=SessionConfig)
    """The session cache (``[worker.sessions]``, docs/sessions.md). Its `cost_profile_path`
    may hold ``{model}``, replaced by the model's subject token: one saved profile per model."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("worker.block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.torch_threads < 0 or self.runtime_overhead_bytes < 0:
            raise ValueError("worker.torch_threads and runtime_overhead_bytes must be >= 0")
        if self.cpu_threads != "auto" and self.cpu_threads < 1:
            raise ValueError('worker.cpu_threads must be "auto" or >= 1')
        if self.stats_interval_s <= 0:
            raise ValueError("worker.stats_interval_s must be > 0")


class FairnessConfig(FairnessSettings, forbid_unknown_fields=True, kw_only=True):
    """`FairnessSettings` with unknown keys refused (a typo in shoal.toml is an error)."""


class SleepConfig(SleepSettings, forbid_unknown_fields=True, kw_only=True):
    """`SleepSettings` with unknown keys refused."""


class ModelConfig(ModelSettings, forbid_unknown_fields=True, kw_only=True):
    """A ``[[models]]`` entry of shoal.toml, or the body of POST /admin/models: the fields of
    `ModelSettings`, with unknown keys refused."""

    fairness: FairnessConfig = field(default_factory=FairnessConfig)
    sleep: SleepConfig = field(default_factory=SleepConfig)


class LoggingConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    format: Literal["console", "json"] = "console"
    level: Literal["debug", "info", "warning", "error"] = "info"


class ShoalConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    state_dir: str = "./.shoal"
    """Where `shoal up` keeps the embedded NATS store and worker logs."""
    nats: NatsConfig = field(default_factory=NatsConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    models: list[ModelConfig] = field(default_factory=list)
    demo_models: bool = True
    """Serve the demo models (made under models_root if missing) besides `models`."""

    def __post_init__(self) -> None:
        keys = [m.key for m in self.models]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ValueError(f"models: duplicate keys {duplicates}")


# --------------------------------------------------------------------------- helpers


def parse_gpu_spec(spec: str) -> tuple[str, int, int]:
    """``nvml`` -> ("nvml", 0, 0); ``virtual:2x16GiB`` -> ("virtual", 2, 17179869184)."""
    if spec == "nvml":
        return ("nvml", 0, 0)
    if spec.startswith("virtual:"):
        body = spec.removeprefix("virtual:")
        count_text, sep, size_text = body.partition("x")
        if sep and count_text.isdigit() and int(count_text) >= 1:
            size = parse_bytes(size_text)
            if size > 0:
                return ("virtual", int(count_text), size)
    raise ConfigError(f"gpus must be 'nvml' or 'virtual:<count>x<size>' (e.g. virtual:2x16GiB), got {spec!r}")


def default_node_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64]
    return host or "node"


_TOP_LEVEL_SCALARS = {"state_dir", "demo_models"}
RETIRED_ENV_VARS = {
    "SHOAL_KERNELS": "SHOAL_WORKER_KERNELS_CUDA (kernels | reference)",
    "SHOAL_CPU_KERNELS": "SHOAL_WORKER_KERNELS_CPU (native | torch)",
    "SHOAL_CPU_ATTENTION": "SHOAL_WORKER_KERNELS_CPU_ATTENTION (native | torch)",
}
"""Environment variables older versions read directly; now settings like every other."""


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``SHOAL_GATEWAY_PORT=9000`` -> {"gateway": {"port": "9000"}} (types converted later).

    Nested sections nest the same way: ``SHOAL_SCHEDULER_PLACEMENT_FRACTION_THRESHOLD=0.7``
    -> {"scheduler": {"placement": {"fraction_threshold": "0.7"}}}. A name that matches
    no field is passed on as one, so it fails validation naming the unknown key.
    """
    overrides: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in ("SHOAL_CONFIG",):
            continue
        if name in RETIRED_ENV_VARS:
            raise ConfigError(f"{name} is no longer read: set {RETIRED_ENV_VARS[name]} instead")
        rest = name.removeprefix(ENV_PREFIX).lower()
        if rest in _TOP_LEVEL_SCALARS:
            overrides[rest] = value
            continue
        path = _env_path(ShoalConfig, rest)
        if path is None or path[0] == "models":
            continue
        target = overrides
        for section in path[:-2]:
            target = target.setdefault(section, {})
        section, key = path[-2], path[-1]
        if key in ("api_keys", "admin_api_keys", "cors_origins"):
            target.setdefault(section, {})[key] = [k.strip() for k in value.split(",") if k.strip()]
        else:
            target.setdefault(section, {})[key] = value
    return overrides


def _env_path(struct: type[Struct], name: str) -> list[str] | None:
    """Split ``scheduler_placement_fraction_threshold`` along `struct`'s nested sections:
    ["scheduler", "placement", "fraction_threshold"]; None if it names no section."""
    for section in msgspec.structs.fields(struct):
        prefix = section.name + "_"
        if not name.startswith(prefix) or section.name in _TOP_LEVEL_SCALARS:
            continue
        key = name.removeprefix(prefix)
        if not key:
            return None
        section_type = section.type
        if isinstance(section_type, type) and issubclass(section_type, Struct):
            nested = _env_path(section_type, key)
            return [section.name, *nested] if nested else [section.name, key]
    return None


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ShoalConfig:
    """Load `path` (TOML; None: ``$SHOAL_CONFIG`` or ``./shoal.toml`` if present), apply env and
    explicit overrides, validate. Raises ConfigError naming the bad key."""
    env = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    source = str(path) if path else env.get("SHOAL_CONFIG") or ("shoal.toml" if Path("shoal.toml").is_file() else "")
    if source:
        try:
            raw = msgspec.toml.decode(Path(source).read_bytes())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {source}") from exc
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    raw = _merge(raw, _env_overrides(env))
    if overrides:
        raw = _merge(raw, overrides)
    where = f" ({source})" if source else ""
    try:
        return msgspec.convert(parse_byte_sizes(raw), ShoalConfig, strict=False)
    except (msgspec.ValidationError, ConfigError) as exc:
        raise ConfigError(f"invalid configuration{where}: {_name_model(str(exc), raw)}") from exc


def _name_model(message: str, raw: Mapping[str, Any]) -> str:
    """`message` with the key of the model its ``$.models[N]`` path points at: an operator
    knows a model by its key, not by its place among twenty ``[[models]]`` tables."""
    match = re.search(r"\$\.models\[(\d+)\]", message)
    models = raw.get("models")
    if match is None or not isinstance(models, list) or int(match.group(1)) >= len(models):
        return message
    model = models[int(match.group(1))]
    key = model.get("key") if isinstance(model, Mapping) else None
    return f"{message} (model {key!r})" if isinstance(key, str) else message


def parse_byte_sizes(raw: Any, path: str = "$") -> Any:
    """A copy of a raw config tree whose ``*_bytes`` values given as size strings (``"24GiB"``)
    are byte counts; raises ConfigError naming the key of a string that is not a size."""
    if isinstance(raw, Mapping):
        parsed = {}
        for key, value in raw.items():
            where = f"{path}.{key}"
            if str(key).endswith("_bytes") and isinstance(value, str):
                try:
                    value = parse_bytes(value)
                except ConfigError as exc:
                    raise ConfigError(f"{exc} - at `{where}`") from exc
            parsed[key] = parse_byte_sizes(value, where)
        return parsed
    if isinstance(raw, list):
        return [parse_byte_sizes(item, f"{path}[{i}]") for i, item in enumerate(raw)]
    return raw
