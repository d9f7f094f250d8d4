"""Request traces: generated (Poisson or bursty arrivals, Zipf popularity, diurnal rate) or
replayed from a CSV, held as numpy arrays sorted by time.

    Trace
      time_s          float64   arrival, seconds from the start, non-decreasing
      model           int32     index into model_keys
      prompt_tokens   int32
      output_tokens   int32

Generation, per model m (popularity rank k_m, 1-based):

    share_m   = k_m^-s / sum_j j^-s                          Zipf; s fitted to a published skew
    arrivals  = renewal process of rate rate x share_m        Poisson, or Gamma with a given CV
                in "operational time" u, mapped to real time
                by t = G^-1(u), G(t) = integral of
                1 + A cos(2 pi (t - peak) / period)            diurnal: the same mean rate
    tokens    = lognormal(median, sigma), clipped             fitted to the Azure LLM trace

A CSV trace has the header ``time_s,model,prompt_tokens,output_tokens``; `convert_azure`
makes one from the Azure LLM inference trace (which names no model) by drawing each
request's model from the same Zipf popularity.
"""

from __future__ import annotations

import csv
import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shoal.sim.scenario import ArrivalSpec, ModelGroup, PopularitySpec, ScenarioError, TokenSpec, TraceSpec

CSV_HEADER = ("time_s", "model", "prompt_tokens", "output_tokens")
_DIURNAL_GRID_S = 10.0
"""Resolution of the table that inverts the diurnal cumulative rate."""


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival; a request is its position in these arrays."""

    model_keys: tuple[str, ...]
    time_s: np.ndarray
    model: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    duration_s: float

    def __post_init__(self) -> None:
        num = len(self.time_s)
        assert len(self.model) == len(self.prompt_tokens) == len(self.output_tokens) == num, "one row per request"
        assert num == 0 or bool(np.all(np.diff(self.time_s) >= 0)), "a trace is sorted by time"

    def __len__(self) -> int:
        return len(self.time_s)

    def truncated(self, end_s: float) -> Trace:
        """The requests that arrive before `end_s`."""
        stop = int(np.searchsorted(self.time_s, end_s, side="left"))
        return Trace(self.model_keys, self.time_s[:stop], self.model[:stop], self.prompt_tokens[:stop],
                     self.output_tokens[:stop], min(self.duration_s, end_s))


# --------------------------------------------------------------------------- popularity


def get_zipf_shares(num_models: int, exponent: float) -> np.ndarray:
    """Share of the requests of each rank 1..num_models: k^-exponent, normalised."""
    weights = np.arange(1, num_models + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


def get_head_share(num_models: int, exponent: float, head_fraction: float) -> float:
    """Share of the requests the most popular `head_fraction` of the models receive."""
    num_head = max(1, round(head_fraction * num_models))
    return float(get_zipf_shares(num_models, exponent)[:num_head].sum())


def fit_zipf_exponent(num_models: int, head_fraction: float, head_share: float) -> float:
    """The Zipf exponent at which the top `head_fraction` of `num_models` models receive
    `head_share` of the requests (bisection: the share grows with the exponent)."""
    low, high = 0.0, 32.0
    if get_head_share(num_models, low, head_fraction) >= head_share:
        return 0.0
    for _ in range(100):
        middle = (low + high) / 2
        if get_head_share(num_models, middle, head_fraction) < head_share:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def get_exponent(spec: PopularitySpec, num_models: int) -> float:
    if spec.exponent is not None:
        return spec.exponent
    return fit_zipf_exponent(num_models, spec.head_fraction, spec.head_share)


def rank_models(groups: Sequence[ModelGroup], *, interleave: bool) -> list[str]:
    """Model keys, most popular first: file order, or round robin across the groups."""
    key_lists = [group.model_keys() for group in groups]
    if not interleave:
        return [key for keys in key_lists for key in keys]
    ranked: list[str] = []
    for position in range(max(len(keys) for keys in key_lists)):
        ranked.extend(keys[position] for keys in key_lists if position < len(keys))
    return ranked


# --------------------------------------------------------------------------- arrivals


def get_diurnal_cumulative(t: np.ndarray, spec: ArrivalSpec) -> np.ndarray:
    """G(t): the integral from 0 to t of 1 + A cos(2 pi (s - peak) / period) ds."""
    omega = 2 * math.pi / spec.diurnal_period_s
    amplitude = spec.diurnal_amplitude
    return t + amplitude / omega * (np.sin(omega * (t - spec.diurnal_peak_s)) + math.sin(omega * spec.diurnal_peak_s))


def draw_renewal(rng: np.random.Generator, rate_per_s: float, horizon: float, spec: ArrivalSpec) -> np.ndarray:
    """Arrival times in [0, horizon) of a renewal process of mean rate `rate_per_s`:
    exponential gaps (poisson) or Gamma gaps with shape 1/cv^2 (gamma)."""
    if rate_per_s <= 0 or horizon <= 0:
        return np.empty(0)
    mean_gap = 1.0 / rate_per_s
    chunks: list[np.ndarray] = []
    start = 0.0
    while True:
        num = int(rate_per_s * (horizon - start) * 1.05) + 16
        if spec.kind == "poisson":
            gaps = rng.exponential(mean_gap, num)
        else:
            shape = 1.0 / spec.cv**2
            gaps = rng.gamma(shape, mean_gap / shape, num)
        times = start + np.cumsum(gaps)
        chunks.append(times)
        start = float(times[-1])
        if start >= horizon:
            break
    times = np.concatenate(chunks)
    return times[: int(np.searchsorted(times, horizon, side="left"))]


def generate_arrivals(
    rng: np.random.Generator, shares: np.ndarray, duration_s: float, spec: ArrivalSpec
) -> tuple[np.ndarray, np.ndarray]:
    """(times, model index) of every model's process, merged and sorted by time."""
    diurnal = spec.diurnal_amplitude > 0
    horizon = float(get_diurnal_cumulative(np.array([duration_s]), spec)[0]) if diurnal else duration_s
    times_by_model = [draw_renewal(rng, spec.rate_per_s * float(share), horizon, spec) for share in shares]
    times = np.concatenate(times_by_model) if times_by_model else np.empty(0)
    models = np.concatenate([np.full(len(t), m, dtype=np.int32) for m, t in enumerate(times_by_model)])
    order = np.argsort(times, kind="stable")
    times, models = times[order], models[order]
    if diurnal:
        grid = np.linspace(0.0, duration_s, max(2, int(duration_s / _DIURNAL_GRID_S) + 1))
        times = np.interp(times, get_diurnal_cumulative(grid, spec), grid)
    return times, models


def draw_tokens(rng: np.random.Generator, num: int, spec: TokenSpec) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, output) token counts of `num` requests."""
    if spec.kind == "fixed":
        return (np.full(num, spec.prompt_tokens, dtype=np.int32), np.full(num, spec.output_tokens, dtype=np.int32))

    def lognormal(median: int, sigma: float, top: int) -> np.ndarray:
        drawn = np.rint(median * np.exp(sigma * rng.standard_normal(num)))
        return np.clip(drawn, 1, top).astype(np.int32)

    return (lognormal(spec.prompt_tokens, spec.prompt_sigma, spec.max_prompt_tokens),
            lognormal(spec.output_tokens, spec.output_sigma, spec.max_output_tokens))


def generate_trace(spec: TraceSpec, groups: Sequence[ModelGroup], seed: int) -> Trace:
    """A generated trace over the catalog's models, in popularity order (`rank_models`)."""
    keys = rank_models(groups, interleave=spec.popularity.interleave)
    rng = np.random.default_rng(seed)
    shares = get_zipf_shares(len(keys), get_exponent(spec.popularity, len(keys)))
    times, ranks = generate_arrivals(rng, shares, spec.duration_s, spec.arrivals)
    prompt, output = draw_tokens(rng, len(times), spec.tokens)
    return Trace(tuple(keys), times, ranks, prompt, output, spec.duration_s)


# --------------------------------------------------------------------------- CSV


def read_trace_csv(path: str | Path, model_keys: Sequence[str], *, duration_s: float | None = None) -> Trace:
    """A trace from a CSV with `CSV_HEADER`; rows need not be sorted. Errors name the row.

    Args:
        model_keys: the catalog's models; a row naming another model is an error.
        duration_s: leave out requests at or after this (None: keep all).
    """
    index = {key: i for i, key in enumerate(model_keys)}
    times: list[float] = []
    models: list[int] = []
    prompts: list[int] = []
    outputs: list[int] = []
    with open(path, newline="") as source:
        reader = csv.reader(source)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != CSV_HEADER:
            raise ScenarioError(f"{path}: the first line must be {','.join(CSV_HEADER)}, got {header}")
        for line, row in enumerate(reader, start=2):
            try:
                time_s, model, prompt, output = float(row[0]), row[1], int(row[2]), int(row[3])
            except (ValueError, IndexError) as exc:
                raise ScenarioError(f"{path}:{line}: expected time_s,model,prompt_tokens,output_tokens: {row}") from exc
            if model not in index:
                raise ScenarioError(f"{path}:{line}: model {model!r} is not in the scenario's catalog")
            if time_s < 0 or prompt < 1 or output < 1:
                raise ScenarioError(f"{path}:{line}: time_s must be >= 0 and token counts >= 1: {row}")
            if duration_s is not None and time_s >= duration_s:
                continue
            times.append(time_s)
            models.append(index[model])
            prompts.append(prompt)
            outputs.append(output)
    time_array = np.array(times, dtype=np.float64)
    order = np.argsort(time_array, kind="stable")
    end = duration_s if duration_s is not None else (float(time_array.max()) if len(times) else 0.0)
    return Trace(tuple(model_keys), time_array[order], np.array(models, dtype=np.int32)[order],
                 np.array(prompts, dtype=np.int32)[order], np.array(outputs, dtype=np.int32)[order], end)


def write_trace_csv(trace: Trace, path: str | Path) -> None:
    with open(path, "w", newline="") as target:
        writer = csv.writer(target)
        writer.writerow(CSV_HEADER)
        keys = trace.model_keys
        for time_s, model, prompt, output in zip(trace.time_s.tolist(), trace.model.tolist(),
                                                 trace.prompt_tokens.tolist(), trace.output_tokens.tolist(),
                                                 strict=True):
            writer.writerow((f"{time_s:.6f}", keys[model], prompt, output))


def read_azure(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds from the first request, context tokens, generated tokens) of an Azure LLM
    inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``)."""
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    with open(path, newline="") as source:
        reader = csv.reader(source)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:3]] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise ScenarioError(f"{path}: not an Azure LLM trace (header TIMESTAMP,ContextTokens,GeneratedTokens)")
        for line, row in enumerate(reader, start=2):
            try:
                stamp = datetime.datetime.fromisoformat(row[0].strip()[:26])
                times.append(stamp.replace(tzinfo=datetime.UTC).timestamp())
                prompts.append(max(1, int(row[1])))
                outputs.append(max(1, int(row[2])))
            except (ValueError, IndexError) as exc:
                raise ScenarioError(f"{path}:{line}: cannot read {row}") from exc
    time_array = np.array(times)
    order = np.argsort(time_array, kind="stable")
    time_array = time_array[order] - (time_array.min() if len(times) else 0.0)
    return time_array, np.array(prompts, dtype=np.int32)[order], np.array(outputs, dtype=np.int32)[order]


def convert_azure(
    source: str | Path, model_keys: Sequence[str], *, exponent: float, seed: int, time_scale: float = 1.0
) -> Trace:
    """The Azure trace's requests (times, lengths) spread over `model_keys` (most popular
    first) with Zipf popularity `exponent`: each request's model drawn independently.

    Args:
        time_scale: arrival times are divided by it (2: the same requests in half the time).
    """
    if time_scale <= 0:
        raise ScenarioError("time_scale must be > 0")
    times, prompts, outputs = read_azure(source)
    rng = np.random.default_rng(seed)
    shares = get_zipf_shares(len(model_keys), exponent)
    models = rng.choice(len(model_keys), size=len(times), p=shares).astype(np.int32)
    times = times / time_scale
    duration_s = float(times[-1]) + 1e-6 if len(times) else 0.0
    return Trace(tuple(model_keys), times, models, prompts, outputs, duration_s)


def load_trace(spec: TraceSpec, groups: Sequence[ModelGroup], seed: int, base_dir: Path) -> Trace:
    """The scenario's trace: generated, or read from its CSV (relative to `base_dir`)."""
    if spec.kind == "generated":
        return generate_trace(spec, groups, seed)
    keys = rank_models(groups, interleave=spec.popularity.interleave)
    path = Path(spec.path)
    return read_trace_csv(path if path.is_absolute() else base_dir / path, keys, duration_s=spec.duration_s)
