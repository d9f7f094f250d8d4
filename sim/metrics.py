"""What one simulated run measures, and its summary (`RunResult`).

Per request: its time to first token (inf when it never got one: refused, timed out, or
still waiting at the end). Per model: how long requests waited with no replica serving it
(a "wait": from the first such request to a replica serving, or to the requests failing).
Over time: GPU memory held (reserved, by the policy's figure) and needed (each holding
replica's measured bytes), as integrals and as a sampled timeline.

Definitions used in the report (docs/simulation.md):

    SLO attainment     share of all requests with TTFT <= slo.ttft_s
    tail attainment    the same over the requests for models not marked popular in the catalog
    worst model        the lowest attainment of one model (among models with >= 10 requests)
    unserved models    models asked for that never gave a first token (left out)
    swaps / GPU-hour   replicas loaded after the start (restored, reloaded or created) / (GPUs x hours)
    longest wait       the longest wait of any model
    memory used        time average of measured bytes held / all GPU memory
    memory reserved    time average of bytes held (the policy's figures) / all GPU memory
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from shoal.sim.scenario import SloSpec

FailReason = str
"""no_victim (503: nothing may be preempted), unplaceable (no GPU for it at all),
timeout (no first token within the request timeout), unserved (still waiting at the end)."""


@dataclass(frozen=True)
class Timeline:
    """Samples at a fixed interval."""

    time_s: tuple[float, ...]
    reserved_fraction: tuple[float, ...]
    used_fraction: tuple[float, ...]
    occupied_gpu_fraction: tuple[float, ...]
    """GPUs holding at least one replica."""
    resident_models: tuple[int, ...]
    """Models with at least one replica holding GPU memory."""


@dataclass(frozen=True)
class RunResult:
    """One policy on one cluster size over one trace."""

    policy: str
    num_gpus: int
    num_requests: int
    slo_attainment: float
    meets_slo: bool
    tail_attainment: float
    worst_model_attainment: float
    num_unserved_models: int
    ttft_p50_s: float
    ttft_p99_s: float
    swaps_per_gpu_hour: float
    longest_wait_s: float
    memory_used_fraction: float
    memory_reserved_fraction: float
    counters: dict[str, int]
    timeline: Timeline
    wall_s: float = 0.0
    snapshot_s: float = 0.0
    """Wall time spent building the policy's input (the simulator's `records.build_snapshot`)."""
    policy_s: float = 0.0
    """Wall time spent in the placement policy: planner built, its operations, its plan."""
    num_passes: int = 0

    def to_dict(self) -> dict[str, object]:
        values = {k: v for k, v in self.__dict__.items() if k != "timeline"}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}


@dataclass
class Metrics:
    """Accumulates one run's measurements; `summarize` turns them into a `RunResult`."""

    num_requests: int
    num_gpus: int
    total_gpu_bytes: int
    duration_s: float
    ttft: array = field(init=False)  # type: ignore[type-arg]
    counters: Counter[str] = field(default_factory=Counter)
    waits_s: list[float] = field(default_factory=list)
    requeued: set[int] = field(default_factory=set)
    """Requests handed back to the queue by a drain that timed out (their TTFT stands)."""
    _last_t: float = 0.0
    _reserved: int = 0
    _used: int = 0
    _reserved_area: float = 0.0
    _used_area: float = 0.0
    num_occupied_gpus: int = 0
    num_resident_models: int = 0
    _samples: list[tuple[float, float, float, float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ttft = array("d", [math.inf]) * self.num_requests

    def fail(self, request: int, reason: FailReason) -> None:
        self.ttft[request] = math.inf
        self.counters[f"failed_{reason}"] += 1

    def change_memory(self, now: float, reserved_delta: int, used_delta: int) -> None:
        """Memory held changes at `now` (integrated over the trace's duration only)."""
        end = min(now, self.duration_s)
        if end > self._last_t:
            span = end - self._last_t
            self._reserved_area += self._reserved * span
            self._used_area += self._used * span
            self._last_t = end
        self._reserved += reserved_delta
        self._used += used_delta

    def sample(self, now: float) -> None:
        total = self.total_gpu_bytes
        self._samples.append((now, self._reserved / total, self._used / total,
                              self.num_occupied_gpus / self.num_gpus, self.num_resident_models))

    def summarize(self, policy: str, models: np.ndarray, tail_models: np.ndarray, slo: SloSpec) -> RunResult:
        """Args:
        models: each request's model index.
        tail_models: per model index, True for the models not marked popular.
        """
        self.change_memory(self.duration_s, 0, 0)
        ttft = np.frombuffer(self.ttft, dtype=np.float64)
        num = len(ttft)
        met = ttft <= slo.ttft_s
        attainment = float(np.count_nonzero(met)) / num if num else 1.0
        is_tail = tail_models[models] if num else np.zeros(0, dtype=bool)
        num_tail = int(np.count_nonzero(is_tail))
        tail_attainment = float(np.count_nonzero(met & is_tail)) / num_tail if num_tail else 1.0
        per_model = np.bincount(models, minlength=len(tail_models))
        met_per_model = np.bincount(models[met], minlength=len(tail_models))
        counted = per_model >= 10
        worst = float((met_per_model[counted] / per_model[counted]).min()) if counted.any() else 1.0
        served_per_model = np.bincount(models[np.isfinite(ttft)], minlength=len(tail_models))
        num_unserved = int(np.count_nonzero((per_model > 0) & (served_per_model == 0)))
        # A sample of the data (no interpolation): inf stays inf, never nan.
        p50, p99 = (float(v) for v in np.percentile(ttft, [50, 99], method="inverted_cdf")) if num else (0.0, 0.0)
        hours = self.duration_s / 3600.0
        loads = sum(self.counters[k] for k in ("loads_from_cpu", "loads_from_disk", "reloads_in_place"))
        area = self.total_gpu_bytes * self.duration_s
        samples = self._samples
        timeline = Timeline(tuple(s[0] for s in samples), tuple(s[1] for s in samples), tuple(s[2] for s in samples),
                            tuple(s[3] for s in samples), tuple(s[4] for s in samples))
        return RunResult(
            policy=policy,
            num_gpus=self.num_gpus,
            num_requests=num,
            slo_attainment=attainment,
            meets_slo=(attainment >= slo.attainment and tail_attainment >= slo.tail_attainment
                       and not (slo.serve_every_model and num_unserved)),
            tail_attainment=tail_attainment,
            worst_model_attainment=worst,
            num_unserved_models=num_unserved,
            ttft_p50_s=p50,
            ttft_p99_s=p99,
            swaps_per_gpu_hour=loads / (self.num_gpus * hours) if hours > 0 else 0.0,
            longest_wait_s=max(self.waits_s, default=0.0),
            memory_used_fraction=self._used_area / area if area else 0.0,
            memory_reserved_fraction=self._reserved_area / area if area else 0.0,
            counters=dict(sorted(self.counters.items())),
            timeline=timeline,
        )
