#!/usr/bin/env python
"""Placement benchmark: decision speed at 10 / 100 / 1,000 nodes, and packing by memory figure.

    python scripts/bench_placement.py            # full run, medians of 3 runs (about 2 min on 2 cores)
    python scripts/bench_placement.py --runs 1   # one run
    python scripts/bench_placement.py --quick    # 10 and 100 nodes, smaller samples (a few seconds)
    python scripts/bench_placement.py --clock cpu  # process CPU time instead of wall time

Writes docs/images/placement_decisions.png: decision time against cluster size (``--plot-dir``).

Part 1, speed. Nodes of 8 x 80 GiB GPUs, 300 models (six architectures x KV budgets). The
cluster is first filled to about 70 % of its GPU memory by the policy itself; then a fresh
planner on that snapshot places replicas one at a time (each decision includes applying it
and updating the indexes). Reported: building the planner from a snapshot, the mean and
p99 of one decision with room somewhere (the FREE level), and for contrast the naive scan
of every node's decision tree. Then the cluster is filled until nothing fits, and three
kinds of decision that must evict are timed, each on a fresh planner: the first of the
pass (it also builds the eviction indexes it needs) and the next ones (mean, p99):

* one eviction: replicas of the 14B model with 16k-32k KV budgets (31-34 GiB);
* several evictions on one GPU: Qwen2.5-32B (63-64 GiB: most of a GPU, or all of it);
* whole GPUs: Llama-3.1-70B over two GPUs (tensor parallel, 134-135 GiB).

Each figure is the median over ``--runs`` runs on the same clusters (the decisions are the
same in every run: every random choice is seeded). On a machine shared with other work,
``--clock cpu`` (this process's CPU time) measures the work per decision without the
time spent waiting for a core.

Part 2, packing. The same GPUs, the same model mix, placed round robin (no evictions:
every replica popular: never evicted) until no model fits anywhere, once with seed 000's guess (3 x
weight bytes, whole GPU when weights fit but 3x does not) and once with a modelled figure
(weights + KV budget + 1 GiB runtime overhead, computed from public model configs, not
measured on a GPU). See MODEL_MIX for the numbers assumed.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import plots  # scripts/, next to this file

from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.memory_figure import MemoryFigure, get_memory_figure
from shoal.shared.placement.plan import PlacementPlan
from shoal.shared.placement.planner import ClusterPlanner
from shoal.shared.placement.snapshot import (
    CandidateLevel,
    ClusterSnapshot,
    ModelDemand,
    NodeSnapshot,
    ReplicaSnapshot,
)

GiB = 1 << 30
GPU_BYTES = 80 * GiB
GPUS_PER_NODE = 8
CONFIG = PlacementConfig()
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter
"""What the timings read (``--clock``)."""
RUNTIME_OVERHEAD_BYTES = 1 * GiB
"""CUDA context (~0.5 GiB), cuBLAS workspaces and allocator slack, per replica."""


@dataclass(frozen=True)
class Architecture:
    """Public config numbers of one model; KV bytes/token = 2 (K and V) x layers x KV heads
    x head dim x 2 bytes (bf16)."""

    name: str
    num_parameters: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> int:
        return self.num_parameters * 2  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    def modelled_bytes(self, kv_tokens: int) -> int:
        """Weights + KV budget + runtime overhead: computed, not measured."""
        return self.weight_bytes + self.kv_bytes_per_token * kv_tokens + RUNTIME_OVERHEAD_BYTES


MODEL_MIX = (
    Architecture("qwen2.5-0.5b", 494_000_000, 24, 2, 64),
    Architecture("qwen2.5-1.5b", 1_540_000_000, 28, 2, 128),
    Architecture("qwen2.5-3b", 3_090_000_000, 36, 2, 128),
    Architecture("qwen2.5-7b", 7_620_000_000, 28, 4, 128),
    Architecture("llama-3.1-8b", 8_030_000_000, 32, 8, 128),
    Architecture("qwen2.5-14b", 14_700_000_000, 48, 8, 128),
)
KV_TOKEN_BUDGETS = (4_096, 8_192, 16_384, 32_768)
"""KV budget per replica: a few concurrent sequences of 4k-8k context."""
LARGE_MODELS = (
    Architecture("qwen2.5-32b", 32_760_000_000, 64, 8, 128),
    Architecture("llama-3.1-70b", 70_550_000_000, 80, 8, 128),
)
"""Arrivals on a full cluster (not in the fill): one needs most of a GPU, one two GPUs."""


def make_demands(num_models: int, *, guessed: bool) -> list[ModelDemand]:
    """`num_models` models cycling through architectures and KV budgets."""
    demands = []
    for index in range(num_models):
        arch = MODEL_MIX[index % len(MODEL_MIX)]
        kv_tokens = KV_TOKEN_BUDGETS[(index // len(MODEL_MIX)) % len(KV_TOKEN_BUDGETS)]
        if guessed:
            figure = get_memory_figure(weight_bytes=arch.weight_bytes, config=CONFIG)
        else:
            figure = MemoryFigure(arch.modelled_bytes(kv_tokens), arch.weight_bytes, "estimate")
        demands.append(ModelDemand(f"{arch.name}-{index:03d}", figure, desired_replicas=1, popular=guessed))
    return demands


def empty_cluster(num_nodes: int) -> ClusterSnapshot:
    gpus = dict.fromkeys(range(GPUS_PER_NODE), GPU_BYTES)
    return ClusterSnapshot(tuple(NodeSnapshot(f"node{i:04d}", gpus, 512 * GiB) for i in range(num_nodes)))


def apply_plan(cluster: ClusterSnapshot, plan: PlacementPlan) -> ClusterSnapshot:
    """The snapshot after `plan` (placements only: the fill never evicts)."""
    added: dict[str, list[ReplicaSnapshot]] = {}
    for p in plan.placements:
        added.setdefault(p.node_id, []).append(
            ReplicaSnapshot(p.replica_id, p.model, "HOT", dict(p.gpu_bytes), p.cpu_bytes, last_accessed=0.0)
        )
    nodes = tuple(
        NodeSnapshot(
            n.node_id, n.gpu_total_bytes, n.cpu_cache_bytes, n.replicas + tuple(added.get(n.node_id, ()))
        )
        for n in cluster.nodes
    )
    return ClusterSnapshot(nodes)


def fill(
    cluster: ClusterSnapshot, demands: list[ModelDemand], fraction: float, rng: random.Random
) -> ClusterSnapshot:
    """Place random replicas of `demands` without evictions until `fraction` of the GPU
    memory is reserved, or until 100 draws in a row find no room."""
    planner = ClusterPlanner(cluster, config=CONFIG, rng=rng, clock=lambda: 0.0)
    target_bytes = fraction * GPU_BYTES * GPUS_PER_NODE * len(cluster.nodes)
    reserved_bytes = sum(b for n in cluster.nodes for r in n.replicas for b in r.gpu_bytes.values())
    number = num_misses = 0
    while reserved_bytes < target_bytes and num_misses < 100:
        demand = rng.choice(demands)
        replica_id = f"fill-{fraction}-{number}"
        number += 1
        if planner.get_candidate(demand, replica_id).level != CandidateLevel.FREE:
            num_misses += 1
            continue
        num_misses = 0
        reserved_bytes += sum(planner.place_replica(demand, replica_id).gpu_bytes.values())
    return apply_plan(cluster, planner.finish())


def make_large_demands() -> tuple[list[ModelDemand], list[ModelDemand]]:
    """(Qwen2.5-32B with 4k / 8k KV, Llama-3.1-70B with 4k / 8k KV), modelled figures."""
    qwen, llama = (
        [
            ModelDemand(
                f"{arch.name}-{kv // 1024}k",
                MemoryFigure(arch.modelled_bytes(kv), arch.weight_bytes, "estimate"),
                1,
            )
            for kv in KV_TOKEN_BUDGETS[:2]
        ]
        for arch in LARGE_MODELS
    )
    return qwen, llama


def time_decisions(
    cluster: ClusterSnapshot, demands: list[ModelDemand], num_decisions: int
) -> list[tuple[float, CandidateLevel, int]]:
    """(seconds, level, evictions) of each decision (choose + apply) of a fresh planner,
    placing `num_decisions` new replicas of models drawn from `demands`."""
    planner = ClusterPlanner(cluster, config=CONFIG, rng=random.Random(1), clock=lambda: 0.0)
    rng = random.Random(2)
    timings = []
    for number in range(num_decisions):
        demand = rng.choice(demands)
        start = clock()
        offer = planner.place_replica(demand, f"bench-{number}")
        timings.append((clock() - start, offer.level, len(offer.eviction_ids)))
    return timings


def time_naive(
    cluster: ClusterSnapshot, demands: list[ModelDemand], num_decisions: int
) -> list[tuple[float, None]]:
    """Seconds to evaluate every node's decision tree for one replica (no index, warm copies)."""
    planner = ClusterPlanner(cluster, config=CONFIG, rng=random.Random(1), clock=lambda: 0.0)
    planner.get_node_candidates(demands[0], "warm-up")
    rng = random.Random(2)
    timings = []
    for number in range(num_decisions):
        start = clock()
        offers = planner.get_node_candidates(rng.choice(demands), f"naive-{number}")
        min(offers, key=lambda o: o.sort_key)
        timings.append((clock() - start, None))
    return timings


def p99(values: list[float]) -> float:
    return sorted(values)[max(0, math.ceil(0.99 * len(values)) - 1)]


def median_of(runs: list[dict[str, float]], name: str) -> float:
    return statistics.median(run[name] for run in runs)


def speed_run(
    cluster: ClusterSnapshot,
    full_cluster: ClusterSnapshot,
    demands: list[ModelDemand],
    evicting: dict[str, list[ModelDemand]],
    num_free: int,
    num_evicting: int,
) -> tuple[dict[str, float], dict[str, str]]:
    """One run of every timing on the given clusters: (seconds by name, victims by kind)."""
    figures: dict[str, float] = {}
    start = clock()
    ClusterPlanner(cluster, config=CONFIG, rng=random.Random(0), clock=lambda: 0.0)
    figures["build"] = clock() - start
    # 2 x N decisions, N at most an eighth of the GPUs: all of them find room. The first N
    # also build the working copies of the nodes they touch; the next N mostly do not.
    timings = time_decisions(cluster, demands, 2 * num_free)
    first_s = [t for t, level, _ in timings[:num_free] if level <= CandidateLevel.FREE]
    next_s = [t for t, level, _ in timings[num_free:] if level <= CandidateLevel.FREE]
    figures |= {"first": statistics.mean(first_s), "first99": p99(first_s)}
    figures |= {"next": statistics.mean(next_s), "next99": p99(next_s)}
    figures["per_s"] = 1 / statistics.mean(first_s + next_s)
    victims: dict[str, str] = {}
    for kind, kind_demands in evicting.items():
        timings = time_decisions(full_cluster, kind_demands, 1 + num_evicting)
        assert all(level >= CandidateLevel.CACHED_AND_FULL for _, level, _ in timings), f"{kind}: room left"
        rest_s = [t for t, _, _ in timings[1:]]
        figures |= {f"{kind}_first": timings[0][0], f"{kind}_mean": statistics.mean(rest_s)}
        figures[f"{kind}_p99"] = p99(rest_s)
        counts = sorted(n for _, level, n in timings if level != CandidateLevel.CANT_ACCOMMODATE)
        victims[kind] = f"{counts[0]}-{counts[-1]}" if counts and counts[0] != counts[-1] else str(counts[0])
    figures["naive"] = statistics.mean(
        t for t, _ in time_naive(cluster, demands, 5 if num_free < 1000 else 20)
    )
    return figures, victims


def plot_speed(rows: list[tuple[int, ClusterSnapshot, list[dict[str, float]], dict[str, str]]], plot_dir: str,
               caption: str) -> None:
    """Per-decision times (left) and the once-per-pass costs (right) against the number of nodes."""
    figure, (left, right) = plots.new_figure(8.0, 4.6, columns=2)
    nodes = [num_nodes for num_nodes, _, _, _ in rows]
    series = [
        ("room somewhere: mean", "next", "#2563eb", "-"),
        ("room somewhere: p99", "next99", "#2563eb", ":"),
        ("one eviction: mean", "one_mean", "#db7706", "-"),
        ("several evictions (32B): mean", "several_mean", "#b45309", "-"),
        ("whole GPUs (70B on 2): mean", "whole_mean", "#7c3aed", "-"),
        ("naive scan of every node", "naive", "#9ca3af", "--"),
    ]
    for label, name, color, style in series:
        left.plot(nodes, [1e3 * median_of(runs, name) for _, _, runs, _ in rows], style, color=color, marker="o",
                  markersize=3, label=label)
    left.axhline(1.0, color="#d64545", linewidth=0.8)
    left.text(nodes[0], 1.1, "1 ms target", fontsize=7, color="#d64545")
    for label, name, color in (("build the planner", "build", "#111827"),
                               ("first evicting decision (one)", "one_first", "#db7706"),
                               ("first evicting decision (70B)", "whole_first", "#7c3aed")):
        right.plot(nodes, [1e3 * median_of(runs, name) for _, _, runs, _ in rows], color=color, marker="o",
                   markersize=3, label=label)
    for axis, title in ((left, "One decision"), (right, "Once per scheduling pass")):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("nodes (8 GPUs each)")
        axis.set_ylabel("ms")
        axis.set_title(title, fontsize=10)
        axis.set_xticks(nodes)
        for ticks in (axis.xaxis, axis.yaxis):
            ticks.set_major_formatter(plots.plain_numbers())
            ticks.set_minor_formatter(plots.NullFormatter())
    left.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(0.0, -0.2), ncol=2, frameon=False)
    right.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(0.0, -0.2), ncol=1, frameon=False)
    plots.save(figure, plot_dir, "placement_decisions", caption)


def bench_speed(quick: bool, num_runs: int, plot_dir: str = "") -> None:
    demands = make_demands(300, guessed=False)
    qwen, llama = make_large_demands()
    evicting = {
        "one": [d for d in demands if d.figure.required_bytes > 30 * GiB],
        "several": qwen,
        "whole": llama,
    }
    clock_name = "CPU time" if clock is time.process_time else "wall time"
    runs_text = "one run" if num_runs == 1 else f"medians of {num_runs} runs"
    print(f"## Placement decisions (8 x 80 GiB GPUs per node, 300 models; {clock_name}, {runs_text})\n")
    print("Room somewhere (cluster ~70 % full): FREE decisions\n")
    print(
        "| nodes | GPUs | replicas | build planner | first N of a pass: mean | p99 "
        "| next N: mean | p99 | decisions/s | naive scan of every node |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for num_nodes in (10, 100) if quick else (10, 100, 1000):
        rng = random.Random(num_nodes)
        cluster = fill(empty_cluster(num_nodes), demands, 0.7, rng)
        full_cluster = fill(cluster, demands, 1.0, rng)
        num_replicas = sum(len(n.replicas) for n in cluster.nodes)
        num_free = min(300 if quick else 1000, num_nodes * GPUS_PER_NODE // 8)
        num_evicting = 5 if quick else 20
        results = [
            speed_run(cluster, full_cluster, demands, evicting, num_free, num_evicting)
            for _ in range(num_runs)
        ]
        runs = [figures for figures, _ in results]
        rows.append((num_nodes, full_cluster, runs, results[0][1]))
        print(
            f"| {num_nodes:,} | {num_nodes * GPUS_PER_NODE:,} | {num_replicas:,} "
            f"| {median_of(runs, 'build') * 1e3:.1f} ms "
            f"| {median_of(runs, 'first') * 1e6:.0f} µs | {median_of(runs, 'first99') * 1e6:.0f} µs "
            f"| {median_of(runs, 'next') * 1e6:.0f} µs | {median_of(runs, 'next99') * 1e6:.0f} µs "
            f"| {median_of(runs, 'per_s'):,.0f} | {median_of(runs, 'naive') * 1e3:.1f} ms |"
        )
    print("\nNothing fits anywhere (cluster full): decisions that evict, on a fresh planner\n")
    print(
        "| nodes | replicas | one eviction: first of a pass | next: mean | p99 "
        "| several evictions (32B): first | next: mean | p99 "
        "| whole GPUs (70B, 2 GPUs): first | next: mean | p99 | victims per decision (1 / 32B / 70B) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for num_nodes, full_cluster, runs, victims in rows:
        cells = [
            f"{median_of(runs, f'{kind}_first') * 1e3:.1f} ms | {median_of(runs, f'{kind}_mean') * 1e3:.2f} ms "
            f"| {median_of(runs, f'{kind}_p99') * 1e3:.2f} ms"
            for kind in evicting
        ]
        num_replicas = sum(len(n.replicas) for n in full_cluster.nodes)
        print(
            f"| {num_nodes:,} | {num_replicas:,} | {' | '.join(cells)} "
            f"| {victims['one']} / {victims['several']} / {victims['whole']} |"
        )
    clock_text = "CPU time" if clock is time.process_time else "wall time"
    plot_speed(rows, plot_dir, f"scripts/bench_placement.py, {clock_text}, {runs_text}, {time.strftime('%Y-%m-%d')}")


def pack(num_nodes: int, demands: list[ModelDemand]) -> tuple[Counter[str], int]:
    """Round robin over `demands`, one replica each per round, until none fits without
    evictions. Returns replicas per architecture and GPU bytes reserved."""
    planner = ClusterPlanner(empty_cluster(num_nodes), config=CONFIG, rng=random.Random(0), clock=lambda: 0.0)
    placed: Counter[str] = Counter()
    reserved_bytes = 0
    open_demands = list(demands)
    number = 0
    while open_demands:
        still_open = []
        for demand in open_demands:
            replica_id = f"pack-{number}"
            number += 1
            if planner.get_candidate(demand, replica_id).level != CandidateLevel.FREE:
                continue
            offer = planner.place_replica(demand, replica_id)
            placed[demand.model.rsplit("-", 1)[0]] += 1
            reserved_bytes += sum(offer.gpu_bytes.values())
            still_open.append(demand)
        open_demands = still_open
    return placed, reserved_bytes


def bench_packing(quick: bool) -> None:
    num_nodes = 2 if quick else 8
    num_gpus = num_nodes * GPUS_PER_NODE
    num_models = 12 if quick else 48
    print(
        f"\n## Packing: {num_nodes} nodes x 8 x 80 GiB = {num_gpus} GPUs, {num_models} models, round robin\n"
    )
    print("Per replica, GiB (KV budget cycles over 4k / 8k / 16k / 32k tokens; the table shows 16k):\n")
    print("| model | weights (bf16) | KV bytes/token | guess (3x) | guess reserves | modelled (16k KV) |")
    print("|---|---:|---:|---:|---:|---:|")
    for arch in MODEL_MIX:
        guess = get_memory_figure(weight_bytes=arch.weight_bytes, config=CONFIG).required_bytes
        fractional = guess < CONFIG.fraction_threshold * GPU_BYTES
        reserves = f"{guess / GiB:.1f}" if fractional else f"{GPU_BYTES / GiB:.1f} (whole GPU)"
        print(
            f"| {arch.name} | {arch.weight_bytes / GiB:.1f} | {arch.kv_bytes_per_token:,} "
            f"| {guess / GiB:.1f} | {reserves} | {arch.modelled_bytes(16_384) / GiB:.1f} |"
        )
    results = {}
    for label, guessed in (
        ("seed 000 guess (3x weights)", True),
        ("modelled (weights + KV + overhead)", False),
    ):
        demands = make_demands(num_models, guessed=guessed)
        demands = [ModelDemand(d.model, d.figure, 1, popular=True) for d in demands]
        results[label] = pack(num_nodes, demands)
    print()
    header = " | ".join(a.name for a in MODEL_MIX)
    print(f"| memory figure | {header} | replicas | GPU memory reserved |")
    print("|---|" + "---:|" * (len(MODEL_MIX) + 2))
    for label, (placed, reserved_bytes) in results.items():
        counts = " | ".join(str(placed[a.name]) for a in MODEL_MIX)
        share = reserved_bytes / (num_gpus * GPU_BYTES)
        print(f"| {label} | {counts} | {sum(placed.values())} | {share:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="10 and 100 nodes, smaller samples: a few seconds"
    )
    parser.add_argument("--runs", type=int, default=3, help="timing runs per cluster size (medians)")
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall", help="wall time or process CPU time"
    )
    plots.add_plot_argument(parser)
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    bench_speed(args.quick, 1 if args.quick else max(1, args.runs), args.plot_dir)
    bench_packing(args.quick)


if __name__ == "__main__":
    main()
