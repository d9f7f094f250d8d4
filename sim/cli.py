"""`shoal simulate`: compare the policies on a scenario, or write its trace.

    shoal simulate SCENARIO                       search the GPUs each policy needs; report
    shoal simulate default                        a shipped scenario, by name (sim/scenarios/)
    shoal simulate SCENARIO --gpus 32             one run per policy on 32 GPUs
    shoal simulate SCENARIO --write-trace t.csv   the scenario's trace as CSV, nothing run
    shoal simulate SCENARIO --azure AZ.csv --write-trace t.csv
                                                  the Azure LLM trace spread over the catalog

This module imports only argparse at load time (`shoal --help` stays fast); numpy and the
simulator come with `run_simulate`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from shoal.sim.scenario import PolicyName, Scenario
    from shoal.sim.traces import Trace


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario file (TOML; see docs/simulation.md), or the name of a shipped "
                                         "one: default, scale")
    parser.add_argument("--out", help="directory for report.md, results.json and the plots "
                                      "(default: ./simulation-<scenario file name>)")
    parser.add_argument("--policies", help="comma-separated subset of shoal,dedicated,seed,lru "
                                           "(default: the scenario's)")
    parser.add_argument("--gpus", type=int, help="run each policy once on this many GPUs instead of searching")
    parser.add_argument("--tail-attainment", type=float,
                        help="also require this share of the requests for models not marked popular to meet "
                             "the TTFT (overrides [slo] tail_attainment)")
    parser.add_argument("--out-name", help="name of this comparison in the report (default: the scenario's)")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--write-trace", metavar="CSV", help="write the scenario's trace as CSV and stop")
    parser.add_argument("--azure", metavar="CSV", help="with --write-trace: spread this Azure LLM inference trace "
                                                       "over the scenario's models (its popularity)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="with --azure: divide its arrival times by this (2: twice the rate)")


SHIPPED = Path(__file__).resolve().parent / "scenarios"


def find_scenario(name: str) -> Path:
    """`name` as a path, or the shipped scenario of that name when no such file exists."""
    path = Path(name)
    shipped = SHIPPED / f"{name}.toml"
    return shipped if not path.exists() and shipped.is_file() else path


def run_simulate(args: argparse.Namespace) -> int:
    """The subcommand; 2 for a bad scenario or argument, 0 otherwise."""
    import msgspec

    from shoal.sim.scenario import ALL_POLICIES, ScenarioError, load_scenario
    from shoal.sim.traces import convert_azure, get_exponent, load_trace, rank_models, write_trace_csv

    path = find_scenario(args.scenario)
    try:
        scenario = load_scenario(path)
        policies: list[PolicyName] = list(scenario.policies)
        if args.policies:
            names = [p.strip() for p in args.policies.split(",") if p.strip()]
            unknown = sorted(set(names) - set(ALL_POLICIES))
            if unknown or not names:
                raise ScenarioError(f"--policies: unknown {unknown}; choose from {', '.join(ALL_POLICIES)}")
            policies = [cast("PolicyName", name) for name in names]
        if args.gpus is not None and args.gpus < 1:
            raise ScenarioError("--gpus must be >= 1")
        if args.tail_attainment is not None:
            if not 0 <= args.tail_attainment <= 1:
                raise ScenarioError("--tail-attainment must be in [0, 1]")
            scenario = msgspec.structs.replace(
                scenario, slo=msgspec.structs.replace(scenario.slo, tail_attainment=args.tail_attainment))
        if args.out_name:
            scenario = msgspec.structs.replace(scenario, name=args.out_name)
        if args.azure and not args.write_trace:
            raise ScenarioError("--azure converts a trace: give --write-trace too")
        if args.azure:
            spec = scenario.trace.popularity
            keys = rank_models(scenario.models, interleave=spec.interleave)
            trace = convert_azure(args.azure, keys, exponent=get_exponent(spec, len(keys)), seed=scenario.seed,
                                  time_scale=args.time_scale)
        else:
            trace = load_trace(scenario.trace, scenario.models, scenario.seed, path.parent)
    except (ScenarioError, OSError) as exc:
        print(f"shoal simulate: {exc}", file=sys.stderr)
        return 2
    if args.write_trace:
        write_trace_csv(trace, args.write_trace)
        print(f"{len(trace):,} requests over {trace.duration_s:.0f} s -> {args.write_trace}")
        return 0
    return _compare(scenario, trace, policies, args, path)


def _compare(scenario: Scenario, trace: Trace, policies: list[PolicyName], args: argparse.Namespace,
             path: Path) -> int:
    from shoal.sim.metrics import RunResult
    from shoal.sim.report import plot_all, render_report, write_results
    from shoal.sim.search import compare

    out_dir = Path(args.out or f"simulation-{path.stem}")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{scenario.name}: {len(trace.model_keys)} models, {len(trace):,} requests over "
          f"{trace.duration_s / 3600:.1f} h", file=sys.stderr)

    def progress(result: RunResult) -> None:
        print(f"  {result.policy:<9} {result.num_gpus:>5} GPUs  SLO {100 * result.slo_attainment:6.2f}%  "
              f"p99 {result.ttft_p99_s:8.2f} s  ({result.wall_s:.1f} s)", file=sys.stderr, flush=True)

    searches = compare(scenario, trace, policies, num_gpus=args.gpus, progress=progress)
    plots = [] if args.no_plots else plot_all(searches, trace, scenario, out_dir)
    report = render_report(scenario, trace, searches, plots)
    (out_dir / "report.md").write_text(report)
    write_results(out_dir / "results.json", searches)
    print(report)
    print(f"written: {out_dir / 'report.md'}, {out_dir / 'results.json'}"
          + "".join(f", {p}" for p in plots), file=sys.stderr)
    return 0
