"""A simulation scenario: the cluster, the model catalog, the timing model, the trace, the target.

A scenario is one TOML file, validated here into frozen msgspec Structs: an unknown key or
a bad value is a `ScenarioError` naming it (``... - at `$.cluster.num_nodes```), as
shoal.toml's loader does. Byte sizes take size strings (``"80GiB"``) through the same
parser (`shared.config.parse_byte_sizes`); a model's fairness and sleep settings are the
very Structs of ``[models.fairness]`` / ``[models.sleep]`` in shoal.toml, and the placement
knobs those of ``[scheduler.placement]``.

    name, description, seed
    [cluster]           nodes x GPUs x GPU memory, CPU RAM per node, [cluster.placement]
    [[models]]          groups of identical models, in popularity order (see traces.py)
    [timing]            wake / sleep / prefill / decode times (defaults: docs/simulation.md)
    [trace]             generated (arrivals, popularity, tokens) or a CSV to replay
    [slo]               the latency target: TTFT <= ttft_s for `attainment` of requests
    [search]            GPU counts tried when looking for the fewest that meet the target
    policies            which of shoal / dedicated / seed / lru to compare
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import msgspec
from msgspec import Struct, field

from shoal.shared.config import FairnessConfig, SleepConfig, parse_byte_sizes
from shoal.shared.errors import ShoalError
from shoal.shared.placement.config import PlacementConfig

GiB = 1 << 30
PolicyName = Literal["shoal", "dedicated", "seed", "lru"]
ALL_POLICIES: tuple[PolicyName, ...] = ("shoal", "dedicated", "seed", "lru")


class ScenarioError(ShoalError, ValueError):
    """A scenario file that cannot be read or does not validate."""


def _check(checks: tuple[tuple[bool, str], ...]) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


class ClusterSpec(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[cluster]``: identical nodes (the last one may hold fewer GPUs)."""

    num_nodes: int = 16
    gpus_per_node: int = 8
    num_gpus: int = 0
    """0: num_nodes x gpus_per_node. Otherwise the cluster has this many GPUs, on
    ceil(num_gpus / gpus_per_node) nodes, the last holding the rest (the GPU-count search
    sets it)."""
    gpu_memory_bytes: int = 80 * GiB
    cpu_ram_bytes: int = 2048 * GiB
    """Host RAM of one node; ``placement.warm_cache_fraction`` of it holds parked (WARM) weights."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """The placement policy's knobs, as ``[scheduler.placement]`` in shoal.toml."""

    def __post_init__(self) -> None:
        _check(((self.num_nodes >= 1, "num_nodes must be >= 1"),
                (self.gpus_per_node >= 1, "gpus_per_node must be >= 1"),
                (self.num_gpus >= 0, "num_gpus must be >= 0"),
                (self.gpu_memory_bytes > 0, "gpu_memory_bytes must be > 0"),
                (self.cpu_ram_bytes >= 0, "cpu_ram_bytes must be >= 0")))

    @property
    def total_gpus(self) -> int:
        return self.num_gpus or self.num_nodes * self.gpus_per_node

    def get_gpus_by_node(self) -> list[int]:
        """GPUs of each node: full nodes, then the rest."""
        full, rest = divmod(self.total_gpus, self.gpus_per_node)
        return [self.gpus_per_node] * full + ([rest] if rest else [])


class ModelGroup(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[[models]]``: `count` identical models named ``<name>-000``, ``<name>-001``, ... (or
    just ``<name>`` when count is 1)."""

    name: str
    count: int = 1
    params_b: float
    """Parameters, in billions: prefill and decode times scale with it (`TimingSpec`)."""
    measured_bytes: int
    """GPU memory one replica holds while serving, over all its GPUs: what the node agent
    measures (weights + KV pool + runtime), the figure Shoal packs by."""
    weight_bytes: int = 0
    """Raw weight bytes (what a parked replica holds in CPU RAM, what a wake copies, what the
    seed's 3x guess multiplies); 0: 2 bytes per parameter (bf16)."""
    num_gpus: int = 1
    """GPUs one replica spans at least (tensor parallel)."""
    replicas: int = 1
    """HOT replicas the operator asks for (shoal.toml's ``min_replicas``): placed at the start
    where they fit; 0: the model is placed on its first request (one replica). One model per
    GPU places max(1, replicas) for every model."""
    kv_cache_tokens: int = 32768
    """Tokens of KV cache one replica holds: a request holds prompt + output tokens of it
    while it runs; a replica runs what fits (and at most `timing.max_num_seqs`)."""
    fairness: FairnessConfig = field(default_factory=FairnessConfig)
    sleep: SleepConfig = field(default_factory=SleepConfig)

    def __post_init__(self) -> None:
        _check(((bool(self.name), "name must not be empty"),
                (self.count >= 1, f"{self.name}: count must be >= 1"),
                (self.params_b > 0, f"{self.name}: params_b must be > 0"),
                (self.measured_bytes > 0, f"{self.name}: measured_bytes must be > 0"),
                (self.weight_bytes >= 0, f"{self.name}: weight_bytes must be >= 0"),
                (self.num_gpus >= 1, f"{self.name}: num_gpus must be >= 1"),
                (self.replicas >= 0, f"{self.name}: replicas must be >= 0"),
                (self.kv_cache_tokens >= 1, f"{self.name}: kv_cache_tokens must be >= 1")))

    @property
    def raw_weight_bytes(self) -> int:
        return self.weight_bytes or int(self.params_b * 2e9)

    def model_keys(self) -> list[str]:
        return [self.name] if self.count == 1 else [f"{self.name}-{i:03d}" for i in range(self.count)]


class TimingSpec(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[timing]``: how long things take. Defaults are estimates for an H100 node (derivations
    and how to calibrate them from Shoal's own metrics: docs/simulation.md)."""

    scheduler_latency_s: float = 0.02
    """From a decision to its node step starting (KV writes, NATS round trips)."""
    restore_fixed_s: float = 1.0
    """Waking a parked (WARM) replica: fixed part (engine rebuilt, KV pool, warm-up) ...
    (one parked by a cold sleep first reads its weights from disk: `get_reload_s`)"""
    host_to_device_bytes_per_s: float = 25e9
    """... plus its weights copied CPU -> GPU at this rate per GPU."""
    create_fixed_s: float = 10.0
    """Starting a replica from disk (COLD): fixed part (process, imports, CUDA context, engine) ..."""
    disk_bytes_per_s: float = 2e9
    """... plus its weights read from disk at this rate (per node)."""
    park_fixed_s: float = 0.5
    """Putting a drained replica to sleep WARM: fixed part (all of it for a cold sleep, whose
    weights are dropped, not copied) ..."""
    device_to_host_bytes_per_s: float = 25e9
    """... plus its weights copied GPU -> CPU at this rate per GPU."""
    stop_s: float = 1.0
    """Stopping a drained replica (COLD: its weights are dropped)."""
    prefill_s_per_token_per_b: float = 4e-6
    """Prefill time per prompt token per billion parameters (compute bound)."""
    decode_s_per_token_per_b: float = 1e-3
    """Time per output token of one sequence per billion parameters (a decode step reads every
    weight once whatever the batch: memory bound)."""
    interference: float = 1.0
    """Replicas sharing a GPU take turns on it: a request's times are multiplied by
    1 + interference x (parameters of the other replicas of its GPU running requests when it
    starts) / (its own parameters on that GPU); 0: no slowdown."""
    max_num_seqs: int = 64
    """Most requests one replica runs at once (``[worker] max_num_seqs``)."""
    reconcile_interval_s: float = 5.0
    """The scheduler's reconciler round: idle replicas sleep, short models refill."""
    request_timeout_s: float = 300.0
    """A request still waiting for its first token after this gives up (``[gateway]``)."""
    capacity_wait_s: float = 0.0
    """A request refused because no victim is eligible yet waits and asks again when the
    refusal's Retry-After ends, if that comes within this long of its arrival, instead of
    failing (``gateway.capacity_wait_s``); 0: it fails (a 503) at once."""

    def __post_init__(self) -> None:
        rates = (self.host_to_device_bytes_per_s, self.disk_bytes_per_s, self.device_to_host_bytes_per_s)
        durations = (self.scheduler_latency_s, self.restore_fixed_s, self.create_fixed_s, self.park_fixed_s,
                     self.stop_s, self.prefill_s_per_token_per_b, self.decode_s_per_token_per_b,
                     self.interference)
        _check(((all(r > 0 for r in rates), "the *_bytes_per_s rates must be > 0"),
                (all(d >= 0 for d in durations), "times and interference must be >= 0"),
                (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
                (self.reconcile_interval_s > 0, "reconcile_interval_s must be > 0"),
                (self.request_timeout_s > 0, "request_timeout_s must be > 0"),
                (0 <= self.capacity_wait_s < math.inf, "capacity_wait_s must be a number >= 0")))

    def get_restore_s(self, weight_bytes: int, num_gpus: int) -> float:
        """WARM -> serving: the fixed part plus the weights over each GPU's own link."""
        return self.restore_fixed_s + weight_bytes / (self.host_to_device_bytes_per_s * num_gpus)

    def get_create_s(self, weight_bytes: int) -> float:
        """COLD -> serving: the fixed part plus the weights from the node's disk."""
        return self.create_fixed_s + weight_bytes / self.disk_bytes_per_s

    def get_reload_s(self, weight_bytes: int, num_gpus: int) -> float:
        """WARM with its weights dropped (a cold sleep) -> serving: its process stays, so no
        ``create_fixed_s``; the wake reads the weights from the node's disk into host memory
        (``services/worker/weight_drop.py``), then restores as a parked replica does: the fixed
        part plus the copy to each GPU. ``restore_fixed_s + weights / disk_bytes_per_s +
        weights / (host_to_device_bytes_per_s x GPUs)``."""
        return weight_bytes / self.disk_bytes_per_s + self.get_restore_s(weight_bytes, num_gpus)

    def get_sleep_s(self, weight_bytes: int, num_gpus: int, *, park: bool, drop_weights: bool = False) -> float:
        """Drained -> memory released: parked (weights copied out; with `drop_weights`, a cold
        sleep, only the fixed part: nothing is copied) or stopped."""
        if park:
            if drop_weights:
                return self.park_fixed_s
            return self.park_fixed_s + weight_bytes / (self.device_to_host_bytes_per_s * num_gpus)
        return self.stop_s


class ArrivalSpec(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trace.arrivals]``: each model's requests are a renewal process, merged."""

    kind: Literal["poisson", "gamma"] = "poisson"
    rate_per_s: float = 10.0
    """Mean requests per second over all models (averaged over the diurnal cycle)."""
    cv: float = 1.0
    """Gamma: coefficient of variation of a model's inter-arrival times (1: Poisson; > 1 bursty)."""
    diurnal_amplitude: float = 0.0
    """Rate x (1 + amplitude x cos(2 pi (t - peak_s) / period_s)); 0: flat; < 1."""
    diurnal_period_s: float = 86400.0
    diurnal_peak_s: float = 14 * 3600.0

    def __post_init__(self) -> None:
        _check(((self.rate_per_s > 0, "rate_per_s must be > 0"),
                (self.cv > 0, "cv must be > 0"),
                (self.kind == "gamma" or self.cv == 1.0, "cv is for kind = \"gamma\" (poisson has cv 1)"),
                (0 <= self.diurnal_amplitude < 1, "diurnal_amplitude must be in [0, 1)"),
                (self.diurnal_period_s > 0, "diurnal_period_s must be > 0")))


class PopularitySpec(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trace.popularity]``: model k (1-based rank) gets a share proportional to k^-exponent."""

    exponent: float | None = None
    """Zipf exponent; None: fitted so that the least popular `1 - head_fraction` of the
    models receive `1 - head_share` of the requests."""
    head_fraction: float = 0.059
    head_share: float = 0.9865
    """Defaults: Aegaeon (SOSP '25), Alibaba Cloud Model Studio: 94.1% of the models
    received 1.35% of the requests."""
    interleave: bool = True
    """Rank models round robin across `[[models]]` groups (group 1's first, group 2's first,
    ...); False: in file order."""

    def __post_init__(self) -> None:
        _check(((self.exponent is None or self.exponent >= 0, "exponent must be >= 0"),
                (0 < self.head_fraction < 1, "head_fraction must be in (0, 1)"),
                (0 < self.head_share < 1, "head_share must be in (0, 1)")))


class TokenSpec(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trace.tokens]``: prompt and output lengths, drawn independently per request."""

    kind: Literal["lognormal", "fixed"] = "lognormal"
    prompt_tokens: int = 1020
    """fixed: every prompt; lognormal: the median (exp(mu))."""
    output_tokens: int = 129
    prompt_sigma: float = 0.99
    output_sigma: float = 0.86
    """Defaults: the Azure LLM conversation trace (2023), fitted (docs/simulation.md)."""
    max_prompt_tokens: int = 14050
    max_output_tokens: int = 1000

    def __post_init__(self) -> None:
        _check(((self.prompt_tokens >= 1 and self.output_tokens >= 1, "token counts must be >= 1"),
                (self.prompt_sigma >= 0 and self.output_sigma >= 0, "sigmas must be >= 0"),
                (self.max_prompt_tokens >= self.prompt_tokens, "max_prompt_tokens must be >= prompt_tokens"),
                (self.max_output_tokens >= self.output_tokens, "max_output_tokens must be >= output_tokens")))


class TraceSpec(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trace]``: generated, or replayed from a CSV of (time_s, model, prompt_tokens, output_tokens)."""

    kind: Literal["generated", "csv"] = "generated"
    duration_s: float = 3600.0
    """generated: the trace's length; csv: requests after this are left out."""
    path: str = ""
    """csv: the file, relative to the scenario file (see `shoal simulate --azure` to make one)."""
    arrivals: ArrivalSpec = field(default_factory=ArrivalSpec)
    popularity: PopularitySpec = field(default_factory=PopularitySpec)
    tokens: TokenSpec = field(default_factory=TokenSpec)

    def __post_init__(self) -> None:
        _check(((self.duration_s > 0, "duration_s must be > 0"),
                (self.kind != "csv" or bool(self.path), "kind = \"csv\" needs a path")))


class SloSpec(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[slo]``: met when at least `attainment` of all requests get a first token within
    `ttft_s`, at least `tail_attainment` of the requests for models not marked popular do,
    and (`serve_every_model`) every model asked for answers at least one request."""

    ttft_s: float = 2.0
    attainment: float = 0.99
    tail_attainment: float = 0.0
    """0: no condition on the tail (its requests may be the 1% that miss)."""
    serve_every_model: bool = True
    """A cluster that leaves a model out entirely (no GPU for it, ever) does not meet the SLO,
    however few requests that model gets."""

    def __post_init__(self) -> None:
        _check(((self.ttft_s > 0, "ttft_s must be > 0"), (0 < self.attainment <= 1, "attainment must be in (0, 1]"),
                (0 <= self.tail_attainment <= 1, "tail_attainment must be in [0, 1]")))


class SearchSpec(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[search]``: GPU counts tried per policy. A grid from `min_gpus` to `max_gpus`
    (plotted), then bisection, to the GPU, between the grid's last miss and first hit."""

    min_gpus: int = 1
    max_gpus: int = 0
    """0: one GPU per replica of every model (what one model per GPU needs)."""
    num_grid_points: int = 8

    def __post_init__(self) -> None:
        _check(((self.min_gpus >= 1, "min_gpus must be >= 1"),
                (self.max_gpus == 0 or self.max_gpus >= self.min_gpus, "max_gpus must be 0 or >= min_gpus"),
                (self.num_grid_points >= 2, "num_grid_points must be >= 2")))


class Scenario(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A whole scenario file."""

    name: str = "scenario"
    description: str = ""
    seed: int = 0
    """Seeds the trace and the policies' random choices: same scenario, same seed, same results."""
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    models: list[ModelGroup] = field(default_factory=list)
    timing: TimingSpec = field(default_factory=TimingSpec)
    trace: TraceSpec = field(default_factory=TraceSpec)
    slo: SloSpec = field(default_factory=SloSpec)
    search: SearchSpec = field(default_factory=SearchSpec)
    policies: list[PolicyName] = field(default_factory=lambda: list(ALL_POLICIES))

    def __post_init__(self) -> None:
        keys = [key for group in self.models for key in group.model_keys()]
        duplicates = sorted({k for k in keys if keys.count(k) > 1}) if len(keys) != len(set(keys)) else []
        _check(((bool(self.models), "models: at least one [[models]] entry is needed"),
                (not duplicates, f"models: duplicate model names {duplicates[:5]}"),
                (bool(self.policies), "policies must not be empty"),
                (len(set(self.policies)) == len(self.policies), "policies: each at most once")))

    def get_max_gpus(self) -> int:
        """The search's upper bound: `search.max_gpus`, else one GPU (or more, for a model
        larger than one) per replica of every model."""
        if self.search.max_gpus:
            return self.search.max_gpus
        gpu_bytes = self.cluster.gpu_memory_bytes
        num_gpus = sum(g.count * max(1, g.replicas) * max(g.num_gpus, math.ceil(g.measured_bytes / gpu_bytes))
                       for g in self.models)
        return max(self.search.min_gpus, num_gpus)

    def with_gpus(self, num_gpus: int) -> Scenario:
        """The same scenario on a cluster of `num_gpus` GPUs."""
        cluster = self.cluster
        num_nodes = math.ceil(num_gpus / cluster.gpus_per_node)
        return msgspec.structs.replace(self, cluster=msgspec.structs.replace(cluster, num_nodes=num_nodes,
                                                                             num_gpus=num_gpus))


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; `ScenarioError` names what is wrong and where."""
    source = Path(path)
    try:
        raw = msgspec.toml.decode(source.read_bytes())
    except FileNotFoundError as exc:
        raise ScenarioError(f"scenario file not found: {source}") from exc
    except msgspec.DecodeError as exc:
        raise ScenarioError(f"{source}: not valid TOML: {exc}") from exc
    return parse_scenario(raw, source=str(source))


def parse_scenario(raw: object, *, source: str = "scenario") -> Scenario:
    """Validate a decoded scenario tree (size strings allowed for every ``*_bytes`` key)."""
    try:
        return msgspec.convert(parse_byte_sizes(raw), Scenario, strict=False)
    except (msgspec.ValidationError, ShoalError, ValueError) as exc:
        raise ScenarioError(f"invalid scenario ({source}): {exc}") from exc
