"""Where a WARM wake's time goes on a CUDA GPU: the weights' restore, the engine's resume (or
build), and whether it runs while the weights are copied.

For each model: a fresh load and engine (with its warm-up), then `--repeats` wakes of each
mode (park, `restore_weights`, then the engine), each timed on the host at every piece's
return and once more after synchronizing:

* ``resumed, side stream``: as a worker wakes onto the allocation it parked from: the engine
  suspended at the park, resumed at the wake (`PagedEngine.resume`, then the copy joined);
* ``built, side stream``: a new engine built instead (`build_paged_engine` without warm-up,
  which joins the copy), as a wake onto another allocation does;
* ``built, one stream``: the same with the copy on the device's own stream (the side stream
  replaced by it), as before the side stream: a synchronizing call in the build then waits
  for the copy.

Then one resumed wake under the torch profiler (the CUDA runtime calls with their host time: a
call that blocks shows here) and one engine build under cProfile. The reference is the
copy of the same bytes from pinned host memory into a fresh device allocation
(`bench_swap._host_to_device_seconds`).

    python scripts/profile_wake.py --models demo/llama-5m,demo/llama-100m --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_swap import _host_to_device_seconds

from shoal.cli.demo_models import DEMO_MODEL_KEYS
from shoal.services.worker import pinned_park
from shoal.services.worker.engine.attention import register_attention
from shoal.services.worker.engine.factory import build_paged_engine, get_min_engine_bytes_for
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.loader import (
    LoadedModel,
    load_model,
    park_weights,
    restore_weights,
    resume_engine,
)
from shoal.shared.config import WorkerConfig
from shoal.shared.messages import ModelSpec, ReplicaRecord
from shoal.shared.model_settings import DEFAULT_KV_CACHE_TOKENS

WORKER = WorkerConfig(torch_threads=1)
KV_CACHE_TOKENS = DEFAULT_KV_CACHE_TOKENS
"""The pool a worker builds for a model with no `kv_cache_tokens` of its own."""


@contextmanager
def copy_on_the_device_stream() -> Iterator[None]:
    """The restore's copy on the device's current stream instead of its side stream."""
    side_stream = pinned_park._side_stream
    pinned_park._side_stream = torch.cuda.current_stream  # type: ignore[assignment]
    try:
        yield
    finally:
        pinned_park._side_stream = side_stream  # type: ignore[assignment]


async def _wake(loaded: LoadedModel, replica: ReplicaRecord, minimum: object, kept: PagedEngine | None
                ) -> tuple[dict[str, float], PagedEngine]:
    """One park and wake; host seconds at each piece's return. With `kept`, the worker's
    path: the engine suspended at the park and resumed at the wake; without, a new one
    built (what a wake onto another allocation does)."""
    if kept is not None:
        await kept.suspend()
    park_weights(loaded, replica)
    torch.cuda.synchronize()
    started = time.perf_counter()
    restore_weights(loaded, replica, min_kv_reserve_bytes=minimum)  # type: ignore[arg-type]
    restored = time.perf_counter()
    if kept is not None:
        resume_engine(kept, loaded)
        engine = kept
    else:
        engine = build_paged_engine(loaded, WORKER, kv_cache_tokens=KV_CACHE_TOKENS, warm_up=False)
    built = time.perf_counter()
    torch.cuda.synchronize()
    ended = time.perf_counter()
    return {"restore": restored - started, "engine": built - restored, "wait": ended - built,
            "total": ended - started}, engine


async def profile(models_root: Path, key: str, repeats: int, out: Path | None) -> None:
    replica = ReplicaRecord(replica_id="profile", model=key, node_id="n", gpu_bytes={0: 2 << 30})
    minimum = get_min_engine_bytes_for(torch.device("cuda"), WORKER)
    register_attention()
    loaded = load_model(models_root, ModelSpec(key=key, path=key), replica, device=torch.device("cuda"),
                        attn_implementation="shoal_paged", min_kv_reserve_bytes=minimum)
    engine = build_paged_engine(loaded, WORKER, kv_cache_tokens=KV_CACHE_TOKENS)
    copy = min(_host_to_device_seconds(loaded.weight_bytes) for _ in range(repeats))
    print(f"\n## {key}: {loaded.weight_bytes / 2**20:.0f} MiB of weights; pinned -> GPU copy {copy * 1e3:.2f} ms")
    print("| mode | restore (host) | engine resumed or built (host) | then waiting | wake | wake / copy |")
    print("|---|--:|--:|--:|--:|--:|")
    for mode in ("resumed, side stream", "built, side stream", "built, one stream"):
        rows = []
        for _ in range(repeats):
            kept = engine if mode.startswith("resumed") else None
            if kept is None:
                await engine.close()
            if mode.endswith("one stream"):
                with copy_on_the_device_stream():
                    row, engine = await _wake(loaded, replica, minimum, kept)
            else:
                row, engine = await _wake(loaded, replica, minimum, kept)
            rows.append(row)
        best = min(rows, key=lambda row: row["total"])
        print(f"| {mode} | {best['restore'] * 1e3:.2f} ms | {best['engine'] * 1e3:.2f} ms | "
              f"{best['wait'] * 1e3:.2f} ms | {best['total'] * 1e3:.2f} ms | {best['total'] / copy:.2f}x |")
    await engine.close()

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = build_paged_engine(loaded, WORKER, kv_cache_tokens=KV_CACHE_TOKENS, warm_up=False)
    await engine.suspend()
    park_weights(loaded, replica)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        restore_weights(loaded, replica, min_kv_reserve_bytes=minimum)
        resume_engine(engine, loaded)
        torch.cuda.synchronize()
    await engine.close()
    print(f"\n{key}: one wake (engine resumed) under the torch profiler, by host time (self)")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=48))
    if out is not None:
        profiler.export_chrome_trace(str(out / f"wake-{key.replace('/', '_')}.json"))

    park_weights(loaded, replica)
    restore_weights(loaded, replica, min_kv_reserve_bytes=minimum)
    profiler_py = cProfile.Profile()
    profiler_py.enable()
    engine = build_paged_engine(loaded, WORKER, kv_cache_tokens=KV_CACHE_TOKENS, warm_up=False)
    profiler_py.disable()
    torch.cuda.synchronize()
    await engine.close()
    text = io.StringIO()
    pstats.Stats(profiler_py, stream=text).sort_stats("tottime").print_stats(18)
    print(f"\n{key}: one engine build under cProfile, by own time")
    print(text.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEMO_MODEL_KEYS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models-root", type=Path,
                        default=Path(os.environ.get("SHOAL_TEST_MODELS_ROOT", "models")))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(2, "profile_wake.py needs a CUDA GPU\n")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    for key in args.models.split(","):
        asyncio.run(profile(args.models_root, key, args.repeats, out))


if __name__ == "__main__":
    main()
