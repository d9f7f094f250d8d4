"""Sleep and wake: how fast a model wakes, and how fair preemption fares on a real trace.

Part 1 (in process, per demo model): a wake from COLD (the worker process stayed, its weights
were dropped: they are read back from the model's file into place and the engine, kept
across the sleep, resumed), a fresh process's load (weights read from disk, the engine built
and warmed up; a real one also pays the process start and imports) and a wake from WARM
(weights kept in host RAM, the engine resumed) -- each wake also with the engine rebuilt
instead, as a wake onto another allocation does -- against a
plain copy of the same number of bytes (and, stricter, the same copy into memory marked for
huge pages, as a packed load allocates its weights), best of `--repeats`. On a virtual GPU the weights of
a WARM replica already live in host RAM, so its wake moves no weights: what it measures is
the engine's resume (its KV pool back). On CUDA the same code path copies the weights
host -> device (see docs/benchmarks.md). ``--device cuda`` runs part 1 on a GPU: WARM -> HOT
copies the weights from page-locked host memory, COLD -> HOT reads them from the file first,
both against a pinned host -> GPU copy of the same bytes.

Part 2 (end to end, `shoal up`): the Azure conversation trace's requests in a window, spread
over six models of Zipf popularity (scripts/swap_workload.py), on two virtual GPUs with room
for about three of them; the same requests once with Shoal's fairness (the defaults:
min_runtime_s 10, max_wait_s 5) and once with plain LRU swapping (min_runtime_s 0,
max_wait_s 0), one after the other. Reported per policy: time to first token p50/p99 (a
request answered 503 with Retry-After is retried after it, as OpenAI clients do, and its wait
counts), swaps (replicas preempted) per minute, and the longest wait of any request.

    python scripts/bench_swap.py                      # both parts
    python scripts/bench_swap.py --skip-replay        # part 1 only
    python scripts/bench_swap.py --window-s 120 --start-s 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import swap_workload as sw  # noqa: E402
from bench_peers import completion_body, stream_completion  # noqa: E402
from peer_workload import make_prompt_maker  # noqa: E402

from shoal.cli.demo_models import DEMO_MODEL_KEYS, make_demo_models  # noqa: E402
from shoal.services.worker.engine.attention import register_attention  # noqa: E402
from shoal.services.worker.engine.factory import build_paged_engine, get_min_engine_bytes_for  # noqa: E402
from shoal.services.worker.engine.packed_load import allocate_weights  # noqa: E402
from shoal.services.worker.engine.paged_engine import PagedEngine  # noqa: E402
from shoal.services.worker.loader import (  # noqa: E402
    LoadedModel,
    join_restored_weights,
    load_model,
    park_weights,
    restore_weights,
    resume_engine,
)
from shoal.services.worker.page_advice import release_pages  # noqa: E402
from shoal.services.worker.weight_drop import drop_weights, reload_weights  # noqa: E402
from shoal.shared.config import WorkerConfig  # noqa: E402
from shoal.shared.messages import ModelSpec, ReplicaRecord  # noqa: E402

MiB = 1 << 20
SIZES_MIB = (100, 200, 100, 200, 100, 100)
"""The six replay models' memory, by popularity rank: two 200 MiB GPUs hold about three."""


# --------------------------------------------------------------------------- part 1


def _timed_copy(num_bytes: int, copy: Callable[[torch.Tensor], object]) -> float:
    """Seconds `copy` takes on a filled source of `num_bytes` (the source made beforehand)."""
    source = torch.empty(num_bytes, dtype=torch.uint8)
    source.fill_(1)
    started = time.perf_counter()
    result = copy(source)
    elapsed = time.perf_counter() - started
    del result  # freed after the clock stops
    return elapsed


def _copy_seconds(num_bytes: int) -> float:
    return _timed_copy(num_bytes, torch.clone)  # allocation and copy, as a load or a restore does


def _huge_page_copy_seconds(num_bytes: int) -> float:
    """The same copy into memory marked for transparent huge pages, as a packed load allocates
    its weights (`packed_load.allocate_weights`): a stricter reference than `_copy_seconds`."""
    return _timed_copy(num_bytes, lambda source: allocate_weights(-(-num_bytes // 4))
                       .view(torch.uint8)[:num_bytes].copy_(source))


def _fresh_page_copy_seconds(num_bytes: int) -> float:
    """The same copy into pages the kernel must hand over first (given back with
    ``MADV_DONTNEED``, as a cold sleep gives its weights' pages back): what a cold wake's
    memory costs before anything is read. `_copy_seconds` of a buffer under glibc's mmap
    threshold (32 MiB at most) reuses pages a previous copy faulted in, and pays no fault."""
    target = torch.empty(num_bytes, dtype=torch.uint8)
    target.fill_(0)
    release_pages(target)
    return _timed_copy(num_bytes, target.copy_)


def _host_to_device_seconds(num_bytes: int) -> float:
    """CUDA: a copy of the same bytes from page-locked host memory onto the GPU (what a WARM
    wake moves), into a fresh device allocation, as a restore does."""
    source = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    source.fill_(1)
    torch.cuda.synchronize()
    started = time.perf_counter()
    copy = source.to("cuda")
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    del copy, source
    torch.cuda.empty_cache()
    return elapsed


async def _wake_seconds(models_root: Path, key: str, repeats: int, device: torch.device) -> dict[str, float]:
    """Best of `repeats` of each wake, each one as a worker runs it: the engine suspended at
    the park and resumed at the wake (`ReplicaRuntime`); "..._rebuilt": the same wake building
    a new engine instead (what a wake onto another allocation does)."""
    worker = WorkerConfig(torch_threads=1)
    spec = ModelSpec(key=key, path=key)
    replica = ReplicaRecord(replica_id="bench", model=key, node_id="n", gpu_bytes={0: 2 << 30})
    cuda = device.type == "cuda"
    minimum = get_min_engine_bytes_for(device, worker)
    register_attention()
    best = {name: float("inf") for name in ("fresh", "cold", "cold_rebuilt", "warm", "warm_rebuilt", "warm_restore",
                                                 "copy", "huge_copy", "fresh_page_copy")}
    weight_bytes = 0

    def synchronized() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    async def time_wake(name: str, loaded: LoadedModel, engine: PagedEngine, *, cold: bool, rebuild: bool
                        ) -> PagedEngine:
        """Parks (the engine suspended, or closed to be rebuilt) and times the wake."""
        if rebuild:
            await engine.close()
        else:
            await engine.suspend()
        dropped = drop_weights(loaded) if cold else None  # cold sleep: the process stays, its weights go
        park_weights(loaded, replica)
        started = synchronized()
        if dropped is not None:
            reload_weights(loaded, dropped)
        restore_weights(loaded, replica, min_kv_reserve_bytes=minimum)
        if rebuild:
            engine = build_paged_engine(loaded, worker, kv_cache_tokens=spec.kv_cache_tokens, warm_up=False)
        else:
            resume_engine(engine, loaded)
        best[name] = min(best[name], synchronized() - started)
        return engine

    for _ in range(repeats):
        started = synchronized()
        loaded = load_model(models_root, spec, replica, device=device, attn_implementation="shoal_paged",
                            min_kv_reserve_bytes=minimum, native_pack=not cuda)
        engine = build_paged_engine(loaded, worker, kv_cache_tokens=spec.kv_cache_tokens)
        best["fresh"] = min(best["fresh"], synchronized() - started)
        weight_bytes = loaded.weight_bytes
        for name, cold in (("cold", True), ("warm", False)):
            engine = await time_wake(name, loaded, engine, cold=cold, rebuild=False)
            engine = await time_wake(name + "_rebuilt", loaded, engine, cold=cold, rebuild=True)
        await engine.close()
        # The weights' part alone, in a wake of its own: waiting for it inside the wakes above
        # would keep the engine's allocations from overlapping the copy, as a worker's wake does.
        park_weights(loaded, replica)
        started = synchronized()
        restore_weights(loaded, replica, min_kv_reserve_bytes=minimum)
        join_restored_weights(loaded)
        best["warm_restore"] = min(best["warm_restore"], synchronized() - started)
        del engine, loaded
        if cuda:
            best["copy"] = min(best["copy"], _host_to_device_seconds(weight_bytes))
            continue
        best["copy"] = min(best["copy"], _copy_seconds(weight_bytes))
        best["huge_copy"] = min(best["huge_copy"], _huge_page_copy_seconds(weight_bytes))
        best["fresh_page_copy"] = min(best["fresh_page_copy"], _fresh_page_copy_seconds(weight_bytes))
    return {**best, "weight_bytes": float(weight_bytes)}


def render_cuda_wake_table(rows: dict[str, dict[str, float]]) -> str:
    lines = ["| model | weights | pinned host -> GPU copy of the same bytes | WARM -> HOT | ratio | "
             "WARM -> HOT, engine rebuilt | ratio | "
             "the weights' restore alone (a wake of its own) | ratio | COLD -> HOT (reload in place) | ratio | "
             "fresh load | ratio |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for key, r in rows.items():
        copy = r["copy"]
        lines.append(f"| {key} | {r['weight_bytes'] / MiB:.0f} MiB | {copy * 1e3:.2f} ms | {r['warm'] * 1e3:.1f} ms | "
                     f"{r['warm'] / copy:.2f}x | {r['warm_rebuilt'] * 1e3:.1f} ms | {r['warm_rebuilt'] / copy:.2f}x | "
                     f"{r['warm_restore'] * 1e3:.1f} ms | {r['warm_restore'] / copy:.2f}x | "
                     f"{r['cold'] * 1e3:.1f} ms | {r['cold'] / copy:.2f}x | "
                     f"{r['fresh'] * 1e3:.0f} ms | {r['fresh'] / copy:.1f}x |")
    return "\n".join(lines)


def render_wake_table(rows: dict[str, dict[str, float]]) -> str:
    lines = ["| model | weights | copy of the same bytes | COLD -> HOT (reload in place) | ratio | "
             "COLD -> HOT, engine rebuilt | ratio | "
             "copy into huge pages | ratio | copy into fresh pages | ratio | fresh process load | ratio | "
             "WARM -> HOT (virtual GPU) | ratio |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for key, r in rows.items():
        copy, huge, fresh_pages = r["copy"], r["huge_copy"], r["fresh_page_copy"]
        lines.append(f"| {key} | {r['weight_bytes'] / MiB:.0f} MiB | {copy * 1e3:.1f} ms | {r['cold'] * 1e3:.1f} ms | "
                     f"{r['cold'] / copy:.2f}x | {r['cold_rebuilt'] * 1e3:.1f} ms | {r['cold_rebuilt'] / copy:.2f}x | "
                     f"{huge * 1e3:.1f} ms | {r['cold'] / huge:.2f}x | "
                     f"{fresh_pages * 1e3:.1f} ms | {r['cold'] / fresh_pages:.2f}x | "
                     f"{r['fresh'] * 1e3:.0f} ms | {r['fresh'] / copy:.1f}x | "
                     f"{r['warm'] * 1e3:.1f} ms | {r['warm'] / copy:.1f}x |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- part 2


def write_config(path: Path, policy: str) -> None:
    fairness = "min_runtime_s = 0\nmax_wait_s = 0\n" if policy == "lru" else ""
    parts = ['demo_models = false\n[node]\ngpus = "virtual:2x200MiB"\n[worker]\ntorch_threads = 1\n']
    for rank, size in enumerate(SIZES_MIB):
        parts.append(f'[[models]]\nkey = "m{rank}"\npath = "demo/llama-5m"\nmemory_override_bytes = "{size}MiB"\n'
                     f'kv_cache_tokens = 1000000\n')
        if fairness:
            parts.append(f"[models.fairness]\n{fairness}")
    path.write_text("".join(parts))


async def _request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], t0: float
                   ) -> float | None:
    """Time to first token from `t0`, retrying after 503s as clients do; None if it failed."""
    for _ in range(200):
        answer = await stream_completion(session, url, body, t0)
        if answer.status == 200 and not answer.error:
            return answer.ttft_s
        # A 503 before the stream began, or after its keep-alive comments (an error event): retry.
        retryable = answer.status == 503 or '"service_unavailable"' in answer.error
        if not retryable:
            print(f"  request failed: {answer.status} {answer.error[:200]}", file=sys.stderr)
            return None
        await asyncio.sleep(1.0)
    return None


async def _replay(base_url: str, requests: list[sw.TraceRequest], prompts: list[str]) -> list[tuple[str, float | None]]:
    url = base_url + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()

        async def one(request: sw.TraceRequest, prompt: str) -> tuple[str, float | None]:
            await asyncio.sleep(max(0.0, start + request.at_s - time.perf_counter()))
            t0 = time.perf_counter()
            body = completion_body(request.model, prompt, request.num_output_tokens)
            return request.model, await _request(session, url, body, t0)

        return list(await asyncio.gather(*(one(r, p) for r, p in zip(requests, prompts, strict=True))))


async def _preemptions(base_url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(base_url + "/metrics") as response:
        text = await response.text()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("shoal_scheduler_preemptions_total{")))


def run_replay(models_root: Path, policy: str, requests: list[sw.TraceRequest], prompts: list[str],
               window_s: float) -> sw.ReplaySummary:
    from tests.e2e.conftest import start_shoal_up

    with tempfile.TemporaryDirectory() as state:
        config = Path(state) / "shoal.toml"
        write_config(config, policy)
        shoal = start_shoal_up(models_root, Path(state) / "shoal", "--config", str(config), "--no-demo-models",
                               "--gpus", "virtual:2x200MiB", "--log-level", "warning")
        try:
            ttfts = asyncio.run(_replay(shoal.base_url, requests, prompts))
            swaps = asyncio.run(_preemptions(shoal.base_url))
        finally:
            shoal.stop()
    return sw.summarize(policy, ttfts, swaps, window_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-root", type=Path, default=REPO / "models")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-wake", action="store_true")
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--start-s", type=float, default=600.0, help="where the window starts in the trace")
    parser.add_argument("--window-s", type=float, default=120.0)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-output-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="part 1 on this device (cuda: WARM and COLD wakes against a pinned host -> GPU copy)")
    args = parser.parse_args(argv)
    make_demo_models(args.models_root)
    results: dict[str, Any] = {}
    if not args.skip_wake:
        device = torch.device(args.device)
        rows = {key: asyncio.run(_wake_seconds(args.models_root, key, args.repeats, device)) for key in DEMO_MODEL_KEYS}
        results["wake"] = rows
        print(render_cuda_wake_table(rows) if device.type == "cuda" else render_wake_table(rows))
    if not args.skip_replay:
        from transformers import AutoTokenizer

        models = [f"m{rank}" for rank in range(len(SIZES_MIB))]
        requests = sw.make_requests(sw.read_trace(), models, start_s=args.start_s, window_s=args.window_s,
                                    exponent=args.zipf, max_prompt_tokens=args.max_prompt_tokens,
                                    max_output_tokens=args.max_output_tokens, seed=args.seed)
        tokenizer = AutoTokenizer.from_pretrained(args.models_root / "demo/llama-5m")
        maker = make_prompt_maker(tokenizer, (REPO / "cli" / "demo_corpus.txt").read_text())
        prompts = [maker.make(r.num_prompt_tokens, i) for i, r in enumerate(requests)]
        print(f"replaying {len(requests)} requests over {args.window_s:.0f} s "
              f"(trace from {args.start_s:.0f} s, Zipf {args.zipf})", flush=True)
        summaries = [run_replay(args.models_root, policy, requests, prompts, args.window_s)
                     for policy in ("shoal", "lru")]
        results["replay"] = [s.__dict__ for s in summaries]
        print(sw.render_replay_table(summaries))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
