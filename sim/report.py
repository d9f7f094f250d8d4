"""The comparison as Markdown tables and PNG plots.

    table           per policy: the GPUs it needs to meet the SLO (and how many fewer than one
                    model per GPU), and its figures at that size
    same-size table every policy at the size Shoal needs
    slo_vs_gpus.png requests missing the TTFT, and the tail's attainment, against the number
                    of GPUs: every run of the search
    occupancy.png   per policy at the size it needs: GPU memory held and needed, GPUs holding
                    a replica, and the trace's request rate, over time

Plots need matplotlib (the ``dev`` extra); without it the tables are still written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shoal.sim.metrics import RunResult
from shoal.sim.policies import POLICIES
from shoal.sim.scenario import Scenario
from shoal.sim.search import PolicySearch
from shoal.sim.traces import Trace

COLORS = {"shoal": "#2563eb", "dedicated": "#6b7280", "seed": "#db7706", "lru": "#16a34a"}


def _seconds(value: float) -> str:
    if not math.isfinite(value):
        return "never"
    return f"{value:.2f} s" if value < 100 else f"{value:.0f} s"


def _percent(value: float, digits: int = 1) -> str:
    return f"{100 * value:.{digits}f}%"


def _figures(result: RunResult) -> list[str]:
    return [_percent(result.slo_attainment, 2), _percent(result.tail_attainment, 1),
            _percent(result.worst_model_attainment, 1), str(result.num_unserved_models),
            _seconds(result.ttft_p50_s), _seconds(result.ttft_p99_s),
            f"{result.swaps_per_gpu_hour:.2f}", _seconds(result.longest_wait_s),
            f"{_percent(result.memory_used_fraction)} / {_percent(result.memory_reserved_fraction)}"]


FIGURE_HEADERS = ["SLO attainment", "tail", "worst model", "models left out", "TTFT p50", "TTFT p99",
                  "swaps / GPU-hour", "longest model wait", "GPU memory used / reserved"]


def render_table(searches: Sequence[PolicySearch]) -> str:
    """Per policy: GPUs needed, GPUs saved against one model per GPU, figures at that size."""
    dedicated = next((s.required.num_gpus for s in searches if s.policy == "dedicated" and s.required), None)
    rows = ["| policy | GPUs to meet the SLO | fewer GPUs than one model per GPU | " + " | ".join(FIGURE_HEADERS) + " |",
            "|---|---:|---:|" + "---:|" * len(FIGURE_HEADERS)]
    for search in searches:
        label = POLICIES[search.policy].label
        required = search.required
        if required is None:
            largest = search.sorted_runs()[-1]
            rows.append(f"| {label} | not met at {largest.num_gpus} | - | " + " | ".join(_figures(largest)) + " |")
            continue
        saved = "-"
        if dedicated is not None and search.policy != "dedicated":
            saved = f"{dedicated - required.num_gpus} ({_percent(1 - required.num_gpus / dedicated, 0)})"
        rows.append(f"| {label} | {required.num_gpus} | {saved} | " + " | ".join(_figures(required)) + " |")
    return "\n".join(rows)


def render_same_size_table(searches: Sequence[PolicySearch], num_gpus: int) -> str:
    """Every policy's run at `num_gpus` (those the search made)."""
    rows = ["| policy | GPUs | " + " | ".join(FIGURE_HEADERS) + " |", "|---|---:|" + "---:|" * len(FIGURE_HEADERS)]
    for search in searches:
        result = next((r for r in search.runs.values() if r.num_gpus == num_gpus), None)
        if result is not None:
            rows.append(f"| {POLICIES[search.policy].label} | {num_gpus} | " + " | ".join(_figures(result)) + " |")
    return "\n".join(rows)


def render_report(scenario: Scenario, trace: Trace, searches: Sequence[PolicySearch],
                  plots: Sequence[Path] = ()) -> str:
    gpus_per_node = scenario.cluster.gpus_per_node
    lines = [f"# Simulation: {scenario.name}", ""]
    if scenario.description:
        lines += [scenario.description.strip(), ""]
    lines += [f"{len(trace.model_keys)} models, {len(trace):,} requests over {trace.duration_s / 3600:.1f} h; "
              f"nodes of {gpus_per_node} GPUs x {scenario.cluster.gpu_memory_bytes / (1 << 30):.0f} GiB; "
              f"SLO: TTFT <= {scenario.slo.ttft_s:g} s for {_percent(scenario.slo.attainment, 1)} of the requests"
              + (f" and {_percent(scenario.slo.tail_attainment, 0)} of the tail's (models not marked popular)"
                 if scenario.slo.tail_attainment else "")
              + (", every model served." if scenario.slo.serve_every_model else "."),
              "", render_table(searches), ""]
    shoal = next((s for s in searches if s.policy == "shoal" and s.required), None)
    if shoal is not None and shoal.required is not None:
        lines += [f"Every policy on the GPUs Shoal needs ({shoal.required.num_gpus}):", "",
                  render_same_size_table(searches, shoal.required.num_gpus), ""]
    lines += [f"![{path.stem}]({path.name})" for path in plots]
    return "\n".join(lines) + "\n"


def write_results(path: Path, searches: Sequence[PolicySearch]) -> None:
    data = {s.policy: {"required_gpus": s.required.num_gpus if s.required else None,
                       "runs": [r.to_dict() for r in s.sorted_runs()]} for s in searches}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- plots


def plot_all(searches: Sequence[PolicySearch], trace: Trace, scenario: Scenario, out_dir: Path) -> list[Path]:
    """Both plots into `out_dir`; [] when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return []
    return [plot_attainment(searches, scenario, out_dir / "slo_vs_gpus.png"),
            plot_occupancy(searches, trace, out_dir / "occupancy.png")]


def plot_attainment(searches: Sequence[PolicySearch], scenario: Scenario, path: Path) -> Path:
    """Left: requests missing the TTFT target (log scale, lower is better); right: the tail's
    requests meeting it. Every run of the search; dotted: the size each policy needs."""
    import matplotlib.pyplot as plt

    figure, (misses, tail) = plt.subplots(1, 2, figsize=(10, 4.2))
    floor = 0.001  # 0.001%: a run that missed nothing is drawn on the bottom edge
    for search in searches:
        runs = search.sorted_runs()
        gpus = [r.num_gpus for r in runs]
        style = {"color": COLORS[search.policy], "marker": "o", "markersize": 3, "label": POLICIES[search.policy].label}
        misses.plot(gpus, [max(floor, 100 * (1 - r.slo_attainment)) for r in runs], **style)
        tail.plot(gpus, [100 * r.tail_attainment for r in runs], **style)
        if search.required is not None:
            for axis in (misses, tail):
                axis.axvline(search.required.num_gpus, color=COLORS[search.policy], linewidth=0.8, linestyle=":")
    misses.axhline(100 * (1 - scenario.slo.attainment), color="#111827", linewidth=0.8, linestyle="--",
                   label=f"target: {_percent(1 - scenario.slo.attainment)} miss")
    misses.set_yscale("log")
    misses.set_ylabel(f"requests with TTFT > {scenario.slo.ttft_s:g} s (%)")
    if scenario.slo.tail_attainment:
        tail.axhline(100 * scenario.slo.tail_attainment, color="#111827", linewidth=0.8, linestyle="--",
                     label=f"target {_percent(scenario.slo.tail_attainment, 0)}")
    tail.set_ylim(0, 100)
    tail.set_ylabel(f"tail requests with TTFT <= {scenario.slo.ttft_s:g} s (%)")
    for axis in (misses, tail):
        axis.set_xlabel("GPUs")
        axis.grid(alpha=0.3)
    misses.legend(fontsize=7, loc="upper right")
    tail.legend(fontsize=7, loc="lower right")
    figure.suptitle(f"{scenario.name}: SLO against cluster size (dotted: the size each policy needs)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_occupancy(searches: Sequence[PolicySearch], trace: Trace, path: Path) -> Path:
    import matplotlib.pyplot as plt

    shown = [(s, s.required or s.sorted_runs()[-1]) for s in searches if s.runs]
    figure, axes = plt.subplots(len(shown), 1, figsize=(7.5, 1.9 * len(shown) + 0.6), sharex=True, squeeze=False)
    bins = np.arange(0.0, trace.duration_s + 600.0, 600.0)
    counts, _ = np.histogram(trace.time_s, bins)
    for (search, result), axis in zip(shown, axes[:, 0], strict=True):
        timeline = result.timeline
        hours = np.array(timeline.time_s) / 3600
        axis.plot(hours, 100 * np.array(timeline.reserved_fraction), color="#111827", linewidth=1,
                  label="memory reserved")
        axis.plot(hours, 100 * np.array(timeline.used_fraction), color=COLORS[search.policy], linewidth=1,
                  label="memory needed (measured)")
        axis.plot(hours, 100 * np.array(timeline.occupied_gpu_fraction), color="#9ca3af", linewidth=1,
                  linestyle="--", label="GPUs holding a replica")
        axis.set_ylim(0, 105)
        axis.set_ylabel("% of cluster", fontsize=8)
        axis.set_title(f"{POLICIES[search.policy].label}, {result.num_gpus} GPUs", fontsize=9)
        rate = axis.twinx()
        rate.fill_between(bins[:-1] / 3600, counts / 600.0, step="post", color="#93c5fd", alpha=0.25, linewidth=0)
        rate.set_ylabel("requests/s", fontsize=8)
        axis.set_zorder(rate.get_zorder() + 1)
        axis.patch.set_visible(False)
        axis.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=7, loc="upper center", ncol=3)
    axes[-1, 0].set_xlabel("hours (shaded: requests/s of the trace)")
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
