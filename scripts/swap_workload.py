"""The swap benchmark's trace replay, as pure functions (unit-tested in tests/unit/test_bench_swap.py).

The Azure LLM conversation trace (/work/shared/data, see its README) gives arrival times and
token counts; it names no model, so each request is given one of `num_models` models drawn
from a Zipf law: model k (k = 1..n) with probability proportional to 1 / k**s. s = 1.1 puts
~44% of six models' requests on the first and ~6% on the last — the "few models take most
requests" shape multi-model serving papers report (Alibaba's Aegaeon: in its market, 94% of
models get under 2% of the requests; MuxServe and AlpaServe use power laws with exponents
around 1). The model draw is seeded: the same trace, window and seed give the same requests.
"""

from __future__ import annotations

import csv
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

TRACE = Path("/work/shared/data/azure_llm_2023_conv.csv")


@dataclass(frozen=True)
class TraceRequest:
    at_s: float
    """Arrival, seconds after the window's start."""
    model: str
    num_prompt_tokens: int
    num_output_tokens: int


def read_trace(path: Path = TRACE) -> list[tuple[float, int, int]]:
    """(seconds since the first request, context tokens, generated tokens), in trace order."""
    rows = []
    with path.open() as trace:
        for row in csv.DictReader(trace):
            stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
            rows.append((stamp.timestamp(), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    first = rows[0][0]
    return [(at - first, context, generated) for at, context, generated in rows]


def zipf_weights(num_models: int, exponent: float) -> list[float]:
    """Probability of model k (0-based), proportional to 1 / (k + 1) ** exponent."""
    raw = [1.0 / (k + 1) ** exponent for k in range(num_models)]
    total = sum(raw)
    return [w / total for w in raw]


def make_requests(trace: Sequence[tuple[float, int, int]], models: Sequence[str], *, start_s: float,
                  window_s: float, exponent: float, max_prompt_tokens: int, max_output_tokens: int,
                  seed: int) -> list[TraceRequest]:
    """The trace's requests arriving in [start_s, start_s + window_s), each given a model by the
    Zipf law, its token counts capped (the demo models are small and the machine is a CPU)."""
    rng = random.Random(seed)
    weights = zipf_weights(len(models), exponent)
    requests = []
    for at, context, generated in trace:
        if start_s <= at < start_s + window_s:
            requests.append(TraceRequest(
                at_s=at - start_s,
                model=rng.choices(models, weights)[0],
                num_prompt_tokens=max(1, min(context, max_prompt_tokens)),
                num_output_tokens=max(1, min(generated, max_output_tokens)),
            ))
    return requests


def percentile(values: Sequence[float], fraction: float) -> float:
    """The `fraction` quantile (nearest rank); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(fraction * len(ordered) + 0.5)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class ReplaySummary:
    policy: str
    num_requests: int
    num_failed: int
    ttft_p50_s: float
    ttft_p99_s: float
    longest_wait_s: float
    longest_wait_model: str
    num_swaps: int
    swaps_per_minute: float


def summarize(policy: str, ttfts: Sequence[tuple[str, float | None]], num_swaps: int, duration_s: float
              ) -> ReplaySummary:
    """`ttfts`: (model, time to first token or None when the request failed) per request."""
    done = [(model, ttft) for model, ttft in ttfts if ttft is not None]
    values = [ttft for _, ttft in done]
    worst = max(done, key=lambda pair: pair[1], default=("-", 0.0))
    return ReplaySummary(
        policy=policy, num_requests=len(ttfts), num_failed=len(ttfts) - len(done),
        ttft_p50_s=statistics.median(values) if values else 0.0, ttft_p99_s=percentile(values, 0.99),
        longest_wait_s=worst[1], longest_wait_model=worst[0], num_swaps=num_swaps,
        swaps_per_minute=num_swaps / (duration_s / 60.0) if duration_s > 0 else 0.0,
    )


def render_replay_table(rows: Sequence[ReplaySummary]) -> str:
    lines = ["| policy | requests | failed | TTFT p50 | TTFT p99 | longest wait (model) | swaps | swaps/min |",
             "|---|--:|--:|--:|--:|--|--:|--:|"]
    for r in rows:
        lines.append(f"| {r.policy} | {r.num_requests} | {r.num_failed} | {r.ttft_p50_s:.2f} s | "
                     f"{r.ttft_p99_s:.2f} s | {r.longest_wait_s:.2f} s ({r.longest_wait_model}) | {r.num_swaps} | "
                     f"{r.swaps_per_minute:.1f} |")
    return "\n".join(lines)
