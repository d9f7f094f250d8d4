"""Admission and deadlines during a cold start, on a real socket and a real nats-server.

A stand-in answers the scheduler's ``ensure`` endpoint on the bus, so the test decides
how long placement takes; nothing serves the model, as before its first replica is up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import ModelSpec
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.integration.gateway_harness import StandInScheduler, call, gateway_running, metric_value

MODEL = "org/m"
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
IN_FLIGHT = f'shoal_gateway_requests_in_flight{{model="{MODEL}"}}'


@contextlib.asynccontextmanager
async def stand_in(bus: Bus, *, hold: bool) -> AsyncIterator[StandInScheduler]:
    scheduler = StandInScheduler(bus, hold=hold)
    await scheduler.start()
    try:
        yield scheduler
    finally:
        await scheduler.stop()


async def _register(bus: Bus, max_queue: int | None = None) -> None:
    spec = ModelSpec(key=MODEL, path="m", registered_at=1.0, max_queue=max_queue)
    await bus.models.put(subjects.model_token(MODEL), spec)


async def _wait_for_metric(base_url: str, sample: str, value: float) -> None:
    for _ in range(200):
        if await metric_value(base_url, sample) == value:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{sample} never reached {value} (now {await metric_value(base_url, sample)})")


async def test_requests_waiting_for_placement_count_against_the_queue_bound(
    bus: Bus, nats_server: EmbeddedNatsServer
) -> None:
    await _register(bus, max_queue=2)
    async with (
        stand_in(bus, hold=True) as scheduler,
        gateway_running(nats_server.url, request_timeout_s=120.0) as url,
        aiohttp.ClientSession() as session,
    ):
        async def post() -> int:
            async with session.post(url + "/v1/chat/completions", json=CHAT) as resp:
                return resp.status

        waiting = [asyncio.create_task(post()) for _ in range(2)]
        await asyncio.wait_for(scheduler.asked.wait(), 30)  # the cold start is under way
        await _wait_for_metric(url, IN_FLIGHT, 2)  # both wait for placement, both count
        status, body, headers = await call("POST", url + "/v1/chat/completions", json=CHAT)
        assert status == 429, body
        assert (body["error"]["type"], body["error"]["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert int(headers["Retry-After"]) >= 1 and headers["X-Request-Id"]
        assert scheduler.num_asked == 1, "one placement request per model at a time"
        assert not any(task.done() for task in waiting)
        counted = f'shoal_gateway_requests_total{{model="{MODEL}",kind="chat",outcome="429"}}'
        assert await metric_value(url, counted) == 1
        for task in waiting:  # the clients give up: their requests leave the queue
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await _wait_for_metric(url, IN_FLIGHT, 0)
        await scheduler.release()


@pytest.mark.parametrize("placement", ["slower than the deadline", "placed, replica not up in time"])
async def test_the_deadline_passing_during_a_cold_start_is_504(
    bus: Bus, nats_server: EmbeddedNatsServer, placement: str
) -> None:
    await _register(bus)
    async with (
        stand_in(bus, hold=placement == "slower than the deadline") as scheduler,
        gateway_running(nats_server.url, request_timeout_s=0.5) as url,
    ):
        for path, body in (("/v1/chat/completions", CHAT),
                           ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True})):
            status, payload, headers = await call("POST", url + path, json=body)
            assert status == 504, payload
            assert payload["error"]["type"] == "timeout" and "deadline" in payload["error"]["message"]
            assert headers["X-Request-Id"] and headers["x-should-retry"] == "false"  # clients' retries would pile up
        assert scheduler.num_asked >= 1
        sample = f'shoal_gateway_requests_total{{model="{MODEL}",kind="chat",outcome="504"}}'
        assert await metric_value(url, sample) == 1
