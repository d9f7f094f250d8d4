"""Shoal's configuration: msgspec Structs loaded from ``shoal.toml`` plus env overrides.

Precedence, lowest first: defaults here < the TOML file < ``SHOAL_<SECTION>_<FIELD>``
environment variables (e.g. ``SHOAL_GATEWAY_PORT=9000``, ``SHOAL_NATS_URL=...``)
< command-line flags (applied by the CLI). Unknown keys and bad values are
errors that name the offending key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct, field

from shoal.shared.messages import FairnessSpec
from shoal.shared.placement.config import PlacementConfig as PolicyPlacementConfig
from shoal.shared.subjects import InvalidModelKey, validate_model_key, validate_node_id

ENV_PREFIX = "SHOAL_"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "B": 1,
    "K": 1000, "KB": 1000, "KI": 1024, "KIB": 1024,
    "M": 1000**2, "MB": 1000**2, "MI": 1024**2, "MIB": 1024**2,
    "G": 1000**3, "GB": 1000**3, "GI": 1024**3, "GIB": 1024**3,
    "T": 1000**4, "TB": 1000**4, "TI": 1024**4, "TIB": 1024**4,
}


class ConfigError(ValueError):
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


class NatsConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    url: str = ""
    """NATS server URL. Empty: `shoal up` starts an embedded nats-server."""
    store_dir: str = ""
    """JetStream store of the embedded server. Empty: <state_dir>/jetstream."""


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
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int = 1_000_000

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"gateway.port must be in 1..65535, got {self.port}")
        if self.request_timeout_s <= 0:
            raise ValueError("gateway.request_timeout_s must be > 0")
        if self.max_queue_per_model < 1:
            raise ValueError("gateway.max_queue_per_model must be >= 1")


class PlacementConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """``[scheduler.placement]``: the placement policy's knobs (see docs/placement.md).

    Every field maps one to one onto ``shoal.shared.placement.config.PlacementConfig``,
    which checks them; an invalid value is an error naming ``scheduler.placement.<field>``.
    """

    gpu_fraction_factor: float = 3.0
    """Seed 000's safety factor, used only for a model nothing is known of."""
    fraction_threshold: float = 0.8
    """A replica needing less than this fraction of a GPU shares it; above, it takes the GPU."""
    min_available_gpu_fraction: float = 0.3
    """A GPU counts as available for new placements while at least this fraction is free."""
    unknown_extra_gpus: int = 1
    """Extra whole GPUs for a multi-GPU model whose figure is the factor guess (seed 000's +1)."""
    min_gpu_memory_fraction: float = 0.01
    """Lower clamp of the memory fraction a single-GPU worker gets."""
    max_gpu_memory_fraction: float = 0.99
    """Upper clamp of the memory fraction a single-GPU worker gets."""
    warm_cache_fraction: float = 0.5
    """Share of a node's CPU RAM that WARM replicas (weights parked in host RAM) may hold."""
    runtime_overhead_bytes: int = 512 * 1024 * 1024
    """CUDA context + allocator slack added to estimates from a model's config."""

    def __post_init__(self) -> None:
        if self.runtime_overhead_bytes < 0:
            raise ValueError("scheduler.placement.runtime_overhead_bytes must be >= 0")
        policy_fields = {f.name for f in dataclasses.fields(PolicyPlacementConfig)}
        try:
            PolicyPlacementConfig(**{name: getattr(self, name) for name in policy_fields})
        except ValueError as exc:
            raise ValueError(f"scheduler.placement.{exc}") from exc


class SchedulerConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    scheduler_id: str = ""
    """Unique per scheduler process. Empty: generated at start."""
    reservation_ttl_s: float = 60.0
    """A GPU reservation not backed by a replica record lapses after this."""
    reconcile_interval_s: float = 5.0
    placement: PlacementConfig = field(default_factory=PlacementConfig)


class NodeConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    node_id: str = ""
    """Unique per node agent. Empty: derived from the host name."""
    gpus: str = "virtual:2x16GiB"
    """``nvml`` (real GPUs), or ``virtual:<count>x<size>`` (e.g. virtual:2x16GiB)."""
    models_root: str = "./models"
    cpu_ram_bytes: str | int = ""
    """Host RAM offered to WARM replicas. Empty: the machine's total RAM."""
    heartbeat_interval_s: float = 3.0
    worker_start_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if self.node_id:
            validate_node_id(self.node_id)
        parse_gpu_spec(self.gpus)


class WorkerConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    engine: str = "paged"
    """``paged`` (Shoal's continuous-batching engine) or ``hf`` (plain transformers generate)."""
    block_size: int = 16
    max_num_seqs: int = 64
    torch_threads: int = 0
    """0: let torch decide."""

    def __post_init__(self) -> None:
        if self.engine not in ("paged", "hf"):
            raise ValueError(f"worker.engine must be 'paged' or 'hf', got {self.engine!r}")
        if self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("worker.block_size and worker.max_num_seqs must be >= 1")


class ModelConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    key: str
    path: str
    dtype: str = "auto"
    max_model_len: int | None = None
    kv_cache_tokens: int = 4096
    memory_override_bytes: str | int | None = None
    num_gpus: int = 1
    dedicated: bool = False
    min_replicas: int = 0
    """Replicas placed at start; 0 places the model on its first request."""
    max_queue: int | None = None
    fairness: FairnessSpec = field(default_factory=FairnessSpec)
    idle_timeout_s: float | None = None

    def __post_init__(self) -> None:
        try:
            validate_model_key(self.key)
        except InvalidModelKey as exc:
            raise ValueError(str(exc)) from exc
        validate_model_path(self.path)
        if self.memory_override_bytes is not None:
            parse_bytes(self.memory_override_bytes)
        if self.kv_cache_tokens < 0 or self.num_gpus < 1 or self.min_replicas < 0:
            raise ValueError(f"model {self.key}: kv_cache_tokens >= 0, num_gpus >= 1, min_replicas >= 0")


class LoggingConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    format: str = "console"
    """``console`` or ``json``."""
    level: str = "info"

    def __post_init__(self) -> None:
        if self.format not in ("console", "json"):
            raise ValueError(f"logging.format must be 'console' or 'json', got {self.format!r}")
        if self.level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"logging.level must be debug/info/warning/error, got {self.level!r}")


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


def validate_model_path(path: str) -> str:
    """A model path is relative to the models root and may not climb out of it."""
    if not path:
        raise ValueError("model path is empty")
    pure = Path(path)
    if pure.is_absolute() or ".." in pure.parts:
        raise ValueError(f"model path {path!r} must be relative to the models root, without '..'")
    return path


def resolve_model_dir(models_root: str | Path, path: str) -> Path:
    """The model's directory, guaranteed to lie under `models_root` (symlinks resolved)."""
    validate_model_path(path)
    root = Path(models_root).resolve()
    resolved = (root / path).resolve()
    if resolved != root and root not in resolved.parents:
        raise ValueError(f"model path {path!r} resolves outside the models root {root}")
    return resolved


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
        if key in ("api_keys", "admin_api_keys"):
            target.setdefault(section, {})[key] = [k for k in value.split(",") if k]
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
    try:
        return msgspec.convert(raw, ShoalConfig, strict=False)
    except msgspec.ValidationError as exc:
        where = f" ({source})" if source else ""
        raise ConfigError(f"invalid configuration{where}: {exc}") from exc
