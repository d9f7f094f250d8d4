#!/usr/bin/env python
"""Seniority among blocked wakers: the simulator with and without `keep_place`, on the soak
that found a model passed over for two minutes.

    python scripts/bench_seniority.py                 # seeds 1 2 3, the Azure trace's hour
    python scripts/bench_seniority.py --seeds 1 --minutes 30
    python scripts/bench_seniority.py --capacity-wait-s 0   # clients that take a 503 at once

Far more demand than memory: 20 equal models (25 GiB measured each, a third of an 80 GiB
GPU) on 4 GPUs that hold 12 of them, every model asked all the time (uniform popularity),
seed 001's fairness (min_runtime_s 10, max_wait_s 5), no idle sleep, and clients that wait up
to 120 s for capacity (`timing.capacity_wait_s`). Arrivals and lengths are the real Azure LLM
conversation trace (/work/shared/data, 19,366 requests in an hour: 5.4 per second), each
request's model drawn uniformly with the seed; without that file, Poisson arrivals at the same
rate and the simulator's default lengths (fitted to the same trace).

Each seed's trace runs twice in this process, `keep_place=True` (a blocked waker keeps its
place in line: what the scheduler does) and False (its wake ends, the next request starts a
younger one), and prints: requests answered, failed by reason, TTFT p50 / p99 (of all
requests; a failure counts as infinite), the p99 and the longest of the models' waits (a
wait: from a model's first waiting request to a replica serving it, or its requests
failing), the wakes started, and the ratio of the two runs' longest waits (without / with).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from shoal.sim.engine import Simulator
from shoal.sim.metrics import RunResult
from shoal.sim.policies import POLICIES
from shoal.sim.scenario import Scenario, parse_scenario
from shoal.sim.traces import Trace, convert_azure, generate_trace

AZURE_TRACE = Path("/work/shared/data/azure_llm_2023_conv.csv")
NUM_MODELS = 20
RATE_PER_S = 5.4
"""The Azure trace's mean rate, for generated arrivals."""


def build_scenario(seed: int, duration_s: float, capacity_wait_s: float = 120.0) -> Scenario:
    return parse_scenario({
        "name": "seniority", "seed": seed,
        "cluster": {"num_nodes": 1, "gpus_per_node": 4, "gpu_memory_bytes": "80GiB"},
        "models": [{"name": "m", "count": NUM_MODELS, "params_b": 7.0, "measured_bytes": "25GiB", "replicas": 0,
                    "fairness": {"min_runtime_s": 10.0, "max_wait_s": 5.0}}],
        "timing": {"capacity_wait_s": capacity_wait_s},
        "trace": {"duration_s": duration_s, "arrivals": {"rate_per_s": RATE_PER_S},
                  "popularity": {"exponent": 0.0}},
        "policies": ["shoal"],
    })


def build_trace(scenario: Scenario, duration_s: float) -> tuple[Trace, str]:
    keys = scenario.models[0].model_keys()
    if AZURE_TRACE.exists():
        trace = convert_azure(AZURE_TRACE, keys, exponent=0.0, seed=scenario.seed).truncated(duration_s)
        return trace, "Azure LLM conversation trace 2023"
    return generate_trace(scenario.trace, scenario.models, scenario.seed), "generated (Poisson)"


def describe_failures(result: RunResult) -> str:
    failed = {k.removeprefix("failed_"): v for k, v in result.counters.items() if k.startswith("failed_")}
    return ", ".join(f"{reason} {count:,}" for reason, count in sorted(failed.items())) or "none"


def format_s(seconds: float) -> str:
    return f"{seconds:.1f}" if math.isfinite(seconds) else "inf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--capacity-wait-s", type=float, default=120.0, help="0: refused requests fail at once")
    args = parser.parse_args()
    duration_s = args.minutes * 60.0
    print("| seed | keep_place | answered | failed (by reason) | TTFT p50 s | TTFT p99 s | wait p99 s "
          "| longest wait s | wakes | places kept / lapsed | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios = []
    source = ""
    for seed in args.seeds:
        scenario = build_scenario(seed, duration_s, args.capacity_wait_s)
        trace, source = build_trace(scenario, duration_s)
        longest: dict[bool, float] = {}
        for keep_place in (True, False):
            started = time.perf_counter()
            sim = Simulator(scenario, trace, POLICIES["shoal"], keep_place=keep_place)
            result = sim.run()
            wall_s = time.perf_counter() - started
            wait_p99_s = float(np.percentile(sim.metrics.waits_s, 99)) if sim.metrics.waits_s else 0.0
            failed = sum(v for k, v in result.counters.items() if k.startswith("failed_"))
            longest[keep_place] = result.longest_wait_s
            print(f"| {seed} | {keep_place} | {result.num_requests - failed:,} / {result.num_requests:,} "
                  f"| {describe_failures(result)} | {format_s(result.ttft_p50_s)} | {format_s(result.ttft_p99_s)} "
                  f"| {wait_p99_s:.1f} | {result.longest_wait_s:.1f} | {result.counters.get('wakes', 0):,} "
                  f"| {result.counters.get('places_kept', 0):,} / "
                  f"{result.counters.get('places_lapsed', 0):,} | {wall_s:.1f} |", flush=True)
        ratios.append(longest[False] / longest[True])
    print(f"\nlongest wait without / with keep_place: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(seeds {', '.join(map(str, args.seeds))}); trace: {source}, {args.minutes:g} min; "
          f"capacity_wait_s {args.capacity_wait_s:g}")


if __name__ == "__main__":
    main()
