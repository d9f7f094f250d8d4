"""Gateway overhead: the same short generations through HTTP and straight over NATS, in one run.

Starts `shoal up` (embedded NATS, demo models, virtual GPUs), warms the model,
then alternates the two paths request by request so machine noise hits both
alike:

* direct: publish the InferenceRequest to ``SHOAL_REQUESTS`` and wait for the
  final reply on a private subject (what the gateway does, minus HTTP);
* gateway: ``POST /v1/completions`` through a real socket.

Reports requests/s and p50/p99 latency of each path, sequentially (latency)
and with N concurrent clients (throughput), and the gateway's overhead.

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
from tests.e2e.conftest import start_shoal_up


class DirectClient:
    """Publishes requests like the gateway does and waits for their final replies."""

    def __init__(self, bus: Bus, model: str) -> None:
        self._bus = bus
        self._model = model
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._prefix = "bench.reply."

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
    print(f"\ngateway overhead per request (sequential, paired): p50 {1e3 * statistics.median(overhead):.2f} ms, "
          f"mean {1e3 * statistics.fmean(overhead):.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--model", default="demo/llama-5m")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--models-root", default="./models")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state:
        shoal = start_shoal_up(Path(args.models_root), Path(state), "--log-level", "warning")
        try:
            asyncio.run(run(args, shoal.base_url, shoal.nats_url))
        finally:
            shoal.stop()


if __name__ == "__main__":
    main()
