"""Gateway overhead: the same short generations through HTTP and straight over NATS, in one run.

Starts `shoal up` (embedded NATS, demo models, virtual GPUs), warms the model,
then alternates the two paths request by request so machine noise hits both
alike:

* direct: publish the InferenceRequest to ``SHOAL_REQUESTS`` and wait for the
  final reply on a private subject (what the gateway does, minus HTTP);
* gateway: ``POST /v1/completions`` through a real socket.

Reports requests/s and p50/p99 latency of each path, sequentially (latency)
and with N concurrent clients (throughput), and the gateway's overhead, with a
picture of its distribution (docs/images/gateway_overhead.png).

In the same run it times the gateway's metrics work per request (the updates every
request makes: two gauge sets, two histogram observations, a counter) and one render
of /metrics, with `prometheus_client` (shared/metrics.py) and with the hand-written
registry it replaced (scripts/metrics_baseline.py), against the overhead measured.

    python scripts/bench_gateway.py [--requests 400] [--concurrency 16] [--model demo/llama-5m]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import aiohttp

from shoal.shared import subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.messages import (
    ErrorReply,
    FinalReply,
    InferenceRequest,
    SamplingParams,
    encode_msgpack,
    reply_decoder,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import metrics_baseline  # scripts/, next to this file
import plots

from shoal.shared.metrics import Registry
from tests.e2e.conftest import start_shoal_up

NUM_MODELS_RENDERED = 100


DIRECT_GATEWAY_ID = "bench"


class DirectClient:
    """Publishes requests like the gateway does and waits for their final replies."""

    def __init__(self, bus: Bus, model: str) -> None:
        self._bus = bus
        self._model = model
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._prefix = subjects.reply_subject(DIRECT_GATEWAY_ID, "")  # workers answer only gateway inboxes

    async def start(self) -> None:
        async def on_reply(msg) -> None:  # type: ignore[no-untyped-def]
            reply = reply_decoder.decode(msg.data)
            if isinstance(reply, FinalReply | ErrorReply):
                future = self._waiting.pop(msg.subject[len(self._prefix) :], None)
                if future is not None and not future.done():
                    future.set_result(None)

        await self._bus.nc.subscribe(self._prefix + ">", cb=on_reply)

    async def complete(self, prompt: str, max_tokens: int) -> float:
        request_id = uuid.uuid4().hex
        request = InferenceRequest(
            request_id=request_id,
            model=self._model,
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            deadline=time.time() + 120,
            reply_to=self._prefix + request_id,
            gateway_id=DIRECT_GATEWAY_ID,
            prompt=prompt,
        )
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        started = time.perf_counter()
        await self._bus.js.publish(subjects.infer_subject(self._model), encode_msgpack(request),
                                   headers={subjects.HDR_REPLY_TO: request.reply_to})
        await future
        return time.perf_counter() - started


async def http_complete(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    async with session.post(url, json=body) as response:
        await response.read()
        assert response.status == 200, await response.text()
    return time.perf_counter() - started


def _per_request_updates(registry) -> Callable[[str], None]:  # type: ignore[no-untyped-def]
    """What the gateway's metrics do for one request (routes_openai, dispatch), on `registry`."""
    requests = registry.counter("shoal_gateway_requests_total", "HTTP inference requests", ["model", "kind", "outcome"])
    latency = registry.histogram("shoal_gateway_request_duration_seconds", "Latency", ["model"])
    ttft = registry.histogram("shoal_gateway_time_to_first_token_seconds", "TTFT", ["model"])
    in_flight = registry.gauge("shoal_gateway_requests_in_flight", "In flight", ["model"])

    def one(model: str) -> None:
        in_flight.set(1, model=model)
        ttft.observe(0.012, model=model)
        in_flight.set(0, model=model)
        requests.inc(model=model, kind="completion", outcome="ok")
        latency.observe(0.015, model=model)

    return one


def bench_metrics(num_requests: int = 50_000, rounds: int = 7) -> dict[str, tuple[float, float]]:
    """Implementation -> (µs of metric updates per request, ms per /metrics render with
    NUM_MODELS_RENDERED models' series); best of `rounds` interleaved rounds."""
    registries = {"prometheus_client": Registry, "hand-written": metrics_baseline.Registry}
    best: dict[str, tuple[float, float]] = {}
    models = [f"org/model-{i}" for i in range(NUM_MODELS_RENDERED)]
    for _ in range(rounds):
        for name, make in registries.items():
            registry = make()
            one = _per_request_updates(registry)
            for model in models:
                one(model)
            started = time.perf_counter()
            for i in range(num_requests):
                one(models[i % 8])
            update_us = 1e6 * (time.perf_counter() - started) / num_requests
            started = time.perf_counter()
            registry.render()
            render_ms = 1e3 * (time.perf_counter() - started)
            previous = best.get(name, (float("inf"), float("inf")))
            best[name] = (min(previous[0], update_us), min(previous[1], render_ms))
    return best


def plot_overhead(overhead: list[float], sequential: dict[str, list[float]], plot_dir: str, caption: str) -> None:
    figure, (left, right) = plots.new_figure(8.0, 3.4, columns=2)
    values_ms = [1e3 * v for v in overhead]
    low, high = _pct(values_ms, 0.01), _pct(values_ms, 0.99)
    left.hist([v for v in values_ms if low <= v <= high], bins=40, color="#2563eb", alpha=0.8)
    p50 = statistics.median(values_ms)
    left.axvline(p50, color="#111827", linestyle="--", linewidth=1)
    left.text(p50, left.get_ylim()[1] * 0.92, f" p50 {p50:.2f} ms", fontsize=8)
    left.set_xlabel("gateway - direct, paired requests (ms; 1st-99th percentile)")
    left.set_ylabel("requests")
    left.set_title("Gateway overhead per request", fontsize=10)
    for name, color in (("direct", "#9ca3af"), ("gateway", "#2563eb")):
        ordered = sorted(1e3 * v for v in sequential[name])
        right.plot(ordered, [i / len(ordered) for i in range(len(ordered))], label=name, color=color)
    right.set_xlabel("latency (ms), sequential, 1 token")
    right.set_ylabel("fraction of requests")
    right.set_xlim(0, _pct([1e3 * v for v in sequential["gateway"]], 0.99) * 1.1)
    right.legend(fontsize=8)
    right.set_title("Latency: through the gateway vs straight to NATS", fontsize=10)
    plots.save(figure, plot_dir, "gateway_overhead", caption)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args: argparse.Namespace, base_url: str, nats_url: str) -> None:
    bus = await connect(nats_url, "bench-gateway")
    direct = DirectClient(bus, args.model)
    await direct.start()
    url = base_url + "/v1/completions"
    prompt = "The quick brown fox"
    async with aiohttp.ClientSession() as session:
        for _ in range(20):  # cold start and warm-up of both paths
            await http_complete(session, url, args.model, prompt, args.max_tokens)
            await direct.complete(prompt, args.max_tokens)

        sequential: dict[str, list[float]] = {"direct": [], "gateway": []}
        for _ in range(args.requests):
            sequential["gateway"].append(await http_complete(session, url, args.model, prompt, args.max_tokens))
            sequential["direct"].append(await direct.complete(prompt, args.max_tokens))

        concurrent: dict[str, tuple[float, list[float]]] = {}
        for name in ("direct", "gateway", "direct", "gateway"):
            async def one(name: str = name) -> float:
                if name == "direct":
                    return await direct.complete(prompt, args.max_tokens)
                return await http_complete(session, url, args.model, prompt, args.max_tokens)

            started = time.perf_counter()
            latencies: list[float] = []
            for _ in range(max(1, args.requests // args.concurrency)):
                latencies += await asyncio.gather(*(one() for _ in range(args.concurrency)))
            elapsed = time.perf_counter() - started
            previous = concurrent.get(name)
            if previous is None or len(latencies) / elapsed > previous[0]:
                concurrent[name] = (len(latencies) / elapsed, latencies)
    await bus.close()

    print(f"\nmodel {args.model}, max_tokens {args.max_tokens}, {args.requests} requests per path\n")
    print("| path | mode | requests/s | p50 ms | p99 ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in ("direct", "gateway"):
        values = sequential[name]
        print(f"| {name} | sequential | {len(values) / sum(values):.1f} | {1e3 * statistics.median(values):.2f} | "
              f"{1e3 * _pct(values, 0.99):.2f} |")
    for name in ("direct", "gateway"):
        rate, values = concurrent[name]
        print(f"| {name} | {args.concurrency} concurrent | {rate:.1f} | {1e3 * statistics.median(values):.2f} | "
              f"{1e3 * _pct(values, 0.99):.2f} |")
    overhead = [g - d for g, d in zip(sequential["gateway"], sequential["direct"], strict=True)]
    overhead_p50_ms = 1e3 * statistics.median(overhead)
    print(f"\ngateway overhead per request (sequential, paired): p50 {overhead_p50_ms:.2f} ms, "
          f"mean {1e3 * statistics.fmean(overhead):.2f} ms")
    metrics = bench_metrics()
    print(f"\nmetrics work of the gateway (best of 7 rounds; render: {NUM_MODELS_RENDERED} models' series)\n")
    print("| registry | updates per request µs | share of the p50 overhead | one /metrics render ms |")
    print("| --- | ---: | ---: | ---: |")
    for name, (update_us, render_ms) in metrics.items():
        print(f"| {name} | {update_us:.2f} | {update_us / 1e3 / overhead_p50_ms:.2%} | {render_ms:.2f} |")
    difference_us = metrics["prometheus_client"][0] - metrics["hand-written"][0]
    print(f"\nprometheus_client - hand-written: {difference_us:+.2f} µs per request "
          f"({difference_us / 1e3 / overhead_p50_ms:+.2%} of the p50 overhead)")
    plot_overhead(overhead, sequential, args.plot_dir,
                  f"scripts/bench_gateway.py --requests {args.requests}, model {args.model}, "
                  f"{time.strftime('%Y-%m-%d')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--model", default="demo/llama-5m")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--models-root", default="./models")
    plots.add_plot_argument(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state:
        shoal = start_shoal_up(Path(args.models_root), Path(state), "--log-level", "warning")
        try:
            asyncio.run(run(args, shoal.base_url, shoal.nats_url))
        finally:
            shoal.stop()


if __name__ == "__main__":
    main()
