"""Worker start: how long a scale-up waits for its replicas to serve, with workers forked by the
node agent's fork server against workers spawned as new Python processes, in one run.

Two clusters run side by side, each an embedded nats-server, a scheduler and a node agent on
one virtual GPU, the same but for ``node.worker_fork_server``. Each trial registers a new model
(so no replica is restored from the WARM cache: every start is a cold one) at the demo model's
path, scales it to `--replicas` and times until that many serve, then removes it. Trials
alternate between the two clusters; the first trial of each is a warm-up (the fork server's
own imports, the page cache) and is not counted.

    python scripts/bench_worker_start.py [--model demo/llama-5m] [--replicas 1 4] [--trials 5]
        [--models-root ./models] [--out results.json]

Reports, per mode and replica count: the median and the range of the seconds from the scale
command to every replica serving, and the median's ratio spawned / forked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shoal.services.node_agent.agent import NodeAgent  # noqa: E402
from shoal.services.node_agent.gpus import discover_gpus  # noqa: E402
from shoal.services.scheduler.service import SchedulerService  # noqa: E402
from shoal.shared.bus import Bus, connect  # noqa: E402
from shoal.shared.config import LoggingConfig, NodeConfig, SchedulerConfig, WorkerConfig  # noqa: E402
from shoal.shared.logs import configure_logging  # noqa: E402
from shoal.shared.messages import ModelSpec  # noqa: E402
from shoal.shared.nats_server import EmbeddedNatsServer  # noqa: E402

MODES = ("forked", "spawned")


@asynccontextmanager
async def cluster(mode: str, models_root: Path, state: Path) -> AsyncIterator[tuple[Bus, SchedulerService]]:
    server = EmbeddedNatsServer(store_dir=state / "nats")
    server.start()
    buses = [await connect(server.url, name) for name in ("scheduler", "node", "bench")]
    agent = NodeAgent(buses[1], discover_gpus("virtual:1x16GiB"),
                      NodeConfig(node_id=f"node-{mode}", models_root=str(models_root),
                                 worker_fork_server=mode == "forked"),
                      WorkerConfig(torch_threads=1), LoggingConfig(level="warning"), nats_url=server.url,
                      log_dir=state / "logs")
    await agent.start()
    scheduler = SchedulerService(buses[0], SchedulerConfig(reconcile_interval_s=3600))
    await scheduler.start()
    try:
        yield buses[2], scheduler
    finally:
        await scheduler.stop()
        await agent.stop()
        for bus in buses:
            await bus.close()
        server.stop()


async def time_start(bus: Bus, scheduler: SchedulerService, key: str, path: str, replicas: int) -> float:
    """Seconds from scaling a newly registered model to `replicas` until that many serve."""
    await scheduler.register(ModelSpec(key=key, path=path))
    started = time.perf_counter()
    reply = await scheduler.scale(key, replicas)
    assert reply.ok, reply
    while True:
        records = [entry.value for entry in (await bus.replicas.get_all()).values() if entry.value.model == key]
        failed = [r.error for r in records if r.state == "failed"]
        assert not failed, failed
        if sum(r.serving for r in records) >= replicas:
            elapsed = time.perf_counter() - started
            break
        await asyncio.sleep(0.05)
    assert (await scheduler.remove(key)).ok
    return elapsed


async def run(args: argparse.Namespace) -> dict[str, object]:
    results: dict[str, object] = {"model": args.model, "trials": args.trials, "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench-worker-start-") as tmp:
        async with cluster("forked", args.models_root, Path(tmp) / "forked") as forked, \
                cluster("spawned", args.models_root, Path(tmp) / "spawned") as spawned:
            clusters = {"forked": forked, "spawned": spawned}
            for replicas in args.replicas:
                seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
                for trial in range(args.trials + 1):
                    for mode in MODES if trial % 2 == 0 else reversed(MODES):
                        bus, scheduler = clusters[mode]
                        took = await time_start(bus, scheduler, f"start-{replicas}-{trial}", args.model, replicas)
                        if trial > 0:
                            seconds[mode].append(took)
                        print(f"replicas={replicas} trial={trial} {mode}: {took:.2f}s", flush=True)
                run_result: dict[str, object] = {"replicas": replicas}
                for mode in MODES:
                    run_result[mode] = {"median_s": statistics.median(seconds[mode]),
                                        "min_s": min(seconds[mode]), "max_s": max(seconds[mode])}
                run_result["spawned_over_forked"] = (statistics.median(seconds["spawned"])
                                                     / statistics.median(seconds["forked"]))
                results["runs"].append(run_result)  # type: ignore[attr-defined]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo/llama-5m", help="path under the models root")
    parser.add_argument("--models-root", type=Path, default=REPO / "models")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.models_root = args.models_root.resolve()
    configure_logging("console", "warning", service="bench")
    results = asyncio.run(run(args))
    print(f"\n{'replicas':>8} {'forked median (range)':>24} {'spawned median (range)':>24} {'spawned/forked':>15}")
    for run_result in results["runs"]:  # type: ignore[attr-defined]
        cells = [f"{run_result[m]['median_s']:.2f}s ({run_result[m]['min_s']:.2f}-{run_result[m]['max_s']:.2f})"
                 for m in MODES]
        print(f"{run_result['replicas']:>8} {cells[0]:>24} {cells[1]:>24} {run_result['spawned_over_forked']:>14.2f}x")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
