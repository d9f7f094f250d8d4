"""Clients that hang up at random points of their requests: queued (the replica busy), right
after sending, mid-stream, streamed or not. Nothing they started may linger: the gateway's
admitted requests and reply inboxes, the worker's running and waiting requests and its KV
blocks, and the model's queue (pending and unacknowledged messages) all return to zero, and
the replica goes on answering."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path

import aiohttp
from nats.aio.msg import Msg

from shoal.shared import subjects
from shoal.shared.config import WorkerConfig
from shoal.shared.messages import WorkerStats, worker_stats_decoder
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.faults.harness import PROMPT, fault_cluster, model
from tests.integration.gateway_harness import metric_value

NUM_CLIENTS = 24
MAX_TOKENS = 1500


async def hang_up_after(url: str, delay_s: float, *, stream: bool) -> None:
    """Send a completion and close the connection `delay_s` later (whatever came back by then)."""
    body = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.7, "ignore_eos": True,
            "stream": stream}
    async with aiohttp.ClientSession() as session:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_s):
                async with session.post(url + "/v1/completions", json=body) as response:
                    async for _ in response.content.iter_any():
                        pass
    # leaving the session closes the socket: the gateway sees the client gone


async def test_clients_hanging_up_anywhere_leave_nothing_behind(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    worker = WorkerConfig(torch_threads=1, stats_interval_s=0.5, max_num_seqs=4)
    async with fault_cluster(nats_server.url, demo_models_root, tmp_path / "logs", [model("m")],
                             worker=worker) as cluster:
        await cluster.wait_serving("m", 1)
        stats: list[tuple[float, WorkerStats]] = []

        async def on_stats(msg: Msg) -> None:
            stats.append((time.monotonic(), worker_stats_decoder.decode(msg.data)))

        subscription = await cluster.bus.nc.subscribe(subjects.STATS_WILDCARD, cb=on_stats)
        rng = random.Random(11)
        # 4 sequences at once and 24 clients: most wait in the queue, some hang up there.
        clients = [hang_up_after(cluster.url, rng.uniform(0.05, 3.0), stream=i % 2 == 0) for i in range(NUM_CLIENTS)]
        await asyncio.gather(*clients)
        hung_up_at = time.monotonic()
        assert any(s.num_requests_running > 0 for _, s in stats), "no request ever ran: nothing was tested"

        async def all_clear() -> bool:
            latest = [s for at, s in stats if at > hung_up_at + 0.6]
            if not latest or latest[-1].num_requests_running or latest[-1].num_requests_waiting:
                return False
            kv = latest[-1].kv_cache
            if kv is not None and kv.num_free_blocks != kv.num_blocks:
                return False
            info = await cluster.bus.js.consumer_info(subjects.REQUESTS_STREAM, subjects.consumer_name("m"))
            if info.num_pending or info.num_ack_pending:
                return False
            in_flight = await metric_value(cluster.url, 'shoal_gateway_requests_in_flight{model="m"}')
            inboxes = await metric_value(cluster.url, "shoal_gateway_reply_inboxes")
            return not in_flight and inboxes == 0

        await cluster.wait_for(all_clear, "engine, queue and gateway counts back to zero", timeout_s=30)
        await subscription.unsubscribe()
        cancelled = max(s.num_requests_by_outcome.get("cancelled", 0) for _, s in stats)
        print(f"\nCLIENT DISCONNECTS: {NUM_CLIENTS} clients hung up; the replica cancelled {cancelled} it was "
              f"running; everything back to zero {time.monotonic() - hung_up_at:.1f} s after the last")
        assert cancelled > 0, "no client hung up while its request ran"
        answer = await cluster.complete("m", max_tokens=16)
        assert answer.status == 200, answer.body
        await cluster.assert_no_orphans()
