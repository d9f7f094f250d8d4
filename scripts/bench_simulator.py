#!/usr/bin/env python
"""Simulator speed: 1,000 GPUs, 500 models, 10 million requests (sim/scenarios/scale.toml) on one core.

    python scripts/bench_simulator.py              # the whole day: ~4-6 min on a shared 2-core machine
    python scripts/bench_simulator.py --hours 2    # a slice of the day (first hours of the trace)
    python scripts/bench_simulator.py --pressured-gpus 0   # skip the run short of GPUs

Pins itself to one core (``os.sched_setaffinity``). Measures, in one process, one after another:

* generating the trace (numpy);
* ``dedicated`` on 1,000 GPUs: the event loop with no placement pass after the start (the
  baseline: every request costs its dispatch and its completion only);
* ``shoal`` on 1,000 GPUs: the same requests, plus the policy passes its wakes, idle sleeps
  and refills need;
* ``shoal`` on fewer GPUs (``--pressured-gpus``), where models wait for memory, preempt and
  are blocked: the policy's worst case here.

For each run: wall and CPU seconds, microseconds per request, placement passes, and the time
in them split between building the policy's input (the snapshot: the simulator's part, what
`records.build_snapshot` is in the scheduler) and the placement policy itself (planner built,
decisions, plan). Peak RSS of the process at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import msgspec

from shoal.sim.engine import Simulator
from shoal.sim.metrics import RunResult
from shoal.sim.policies import POLICIES
from shoal.sim.scenario import Scenario, load_scenario
from shoal.sim.traces import Trace, generate_trace

SCENARIO = Path(__file__).resolve().parents[1] / "sim" / "scenarios" / "scale.toml"


def pin_to_one_core() -> str:
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity)"
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return f"pinned to core {core}"


def run(scenario: Scenario, trace: Trace, policy: str, num_gpus: int) -> tuple[RunResult, float]:
    cpu_started = time.process_time()
    result = Simulator(scenario.with_gpus(num_gpus), trace, POLICIES[policy]).run()  # type: ignore[index]
    return result, time.process_time() - cpu_started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default=str(SCENARIO))
    parser.add_argument("--hours", type=float, default=24.0, help="simulate the first HOURS of the day")
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--pressured-gpus", type=int, default=64, help="0: skip")
    args = parser.parse_args()
    pinned = pin_to_one_core()
    scenario = load_scenario(args.scenario)
    scenario = msgspec.structs.replace(
        scenario, trace=msgspec.structs.replace(scenario.trace, duration_s=args.hours * 3600.0))
    print(f"{scenario.name}; {args.hours:g} h; {pinned}; load average {os.getloadavg()[0]:.1f}", flush=True)
    started, cpu_started = time.perf_counter(), time.process_time()
    trace = generate_trace(scenario.trace, scenario.models, scenario.seed)
    print(f"trace: {len(trace):,} requests, {len(trace.model_keys)} models, generated in "
          f"{time.perf_counter() - started:.1f} s wall / {time.process_time() - cpu_started:.1f} s CPU", flush=True)
    plan = [("dedicated", args.gpus), ("shoal", args.gpus)]
    if args.pressured_gpus:
        plan.append(("shoal", args.pressured_gpus))
    rows = []
    for policy, num_gpus in plan:
        result, cpu_s = run(scenario, trace, policy, num_gpus)
        num = result.num_requests
        per_pass_ms = 1000 * (result.snapshot_s + result.policy_s) / max(1, result.num_passes)
        rows.append(f"| {policy} | {num_gpus:,} | {num:,} | {result.wall_s:.1f} | {cpu_s:.1f} | "
                    f"{1e6 * result.wall_s / num:.2f} | {result.num_passes:,} | {result.snapshot_s:.1f} | "
                    f"{result.policy_s:.1f} | {per_pass_ms:.2f} | {100 * result.slo_attainment:.2f}% | "
                    f"{result.counters.get('evicted_preempted', 0):,} |")
        print(rows[-1], flush=True)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print()
    print("| policy | GPUs | requests | wall s | CPU s | µs / request | passes | snapshot s | policy s | "
          "ms / pass | SLO attainment | preemptions |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print(f"\npeak RSS {peak_mib:,.0f} MiB")


if __name__ == "__main__":
    main()
