"""Streams that wait: SSE comment lines while nothing comes, the error that ends one after
the 200, and a request its client abandons while it waits in the queue.

A stand-in answers the scheduler's ``ensure`` on a real nats-server (the test decides how
long placement takes) and no replica serves the model, as during a cold start; the gateway
runs on a real socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from nats.aio.msg import Msg

from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import ModelSpec, cancel_decoder
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.integration.gateway_harness import StandInScheduler, gateway_running, metric_value

MODEL = "org/m"
STREAM: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}


@contextlib.asynccontextmanager
async def stand_in(bus: Bus, *, hold: bool) -> AsyncIterator[StandInScheduler]:
    scheduler = StandInScheduler(bus, hold=hold)
    await scheduler.start()
    try:
        yield scheduler
    finally:
        await scheduler.stop()


async def _register(bus: Bus) -> None:
    await bus.models.put(subjects.model_token(MODEL), ModelSpec(key=MODEL, path="m", registered_at=1.0))


async def _num_queued(bus: Bus) -> int:
    return (await bus.js.stream_info(subjects.REQUESTS_STREAM)).state.messages


async def test_a_stream_waiting_for_placement_gets_comments_then_its_deadline_as_an_error_event(
    bus: Bus, nats_server: EmbeddedNatsServer
) -> None:
    await _register(bus)
    sample = f'shoal_gateway_requests_total{{model="{MODEL}",kind="completion",outcome="504"}}'
    async with (
        stand_in(bus, hold=True),
        gateway_running(nats_server.url, request_timeout_s=1.5, stream_keepalive_s=0.2) as url,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(url + "/v1/completions", json=STREAM) as response:
            assert response.status == 200, "committed by the first comment line"
            assert response.headers["Content-Type"] == "text/event-stream"
            lines = [raw.decode().rstrip("\n") async for raw in response.content if raw.strip()]
        assert await metric_value(url, sample) == 1
    comments = [line for line in lines if line.startswith(":")]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert len(comments) >= 3, lines
    assert all(c.startswith(": waiting ") and f"for {MODEL} (placing)" in c for c in comments), comments
    assert lines.index(comments[-1]) < lines.index("data: " + data[0]), "comments come while it waits"
    error = json.loads(data[0])["error"]
    assert error["type"] == "timeout" and "deadline" in error["message"]
    assert data[-1] == "[DONE]"


async def test_a_stream_that_fails_before_its_first_comment_keeps_its_http_status(
    bus: Bus, nats_server: EmbeddedNatsServer
) -> None:
    await _register(bus)  # no scheduler runs: placement fails at once
    async with (
        gateway_running(nats_server.url, stream_keepalive_s=5.0) as url,
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=STREAM) as response,
    ):
        assert response.status == 503
        assert (await response.json())["error"]["message"] == "no scheduler is running"


async def test_a_request_its_client_abandons_in_the_queue_leaves_the_queue(
    bus: Bus, nats_server: EmbeddedNatsServer
) -> None:
    """Its replica is still loading, so it has not subscribed to cancels yet: the gateway
    deletes the message itself, and nothing runs it once the replica serves."""
    await _register(bus)
    cancels: list[str] = []

    async def on_cancel(msg: Msg) -> None:
        cancels.append(cancel_decoder.decode(msg.data).request_id)

    await bus.nc.subscribe(subjects.cancel_subject(MODEL), cb=on_cancel)
    async with (
        stand_in(bus, hold=False),
        gateway_running(nats_server.url, stream_keepalive_s=0.2) as url,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(url + "/v1/completions", json=STREAM) as response:
            request_id = response.headers["X-Request-Id"]
            async for raw in response.content:
                if raw.startswith(b":") and b"(queued)" in raw:
                    break
            assert await _num_queued(bus) == 1
        # The client left (the connection closed).
        for _ in range(100):
            if not await _num_queued(bus) and request_id in cancels:
                break
            await asyncio.sleep(0.05)
        assert await _num_queued(bus) == 0
        assert cancels == [request_id]

        # Not streamed: the same when the client gives up while the request is queued.
        post = asyncio.create_task(session.post(url + "/v1/completions", json={**STREAM, "stream": False}))
        for _ in range(100):
            if await _num_queued(bus):
                break
            await asyncio.sleep(0.05)
        assert await _num_queued(bus) == 1
        post.cancel()
        await asyncio.gather(post, return_exceptions=True)
        for _ in range(100):
            if not await _num_queued(bus):
                break
            await asyncio.sleep(0.05)
        assert await _num_queued(bus) == 0
        sample = f'shoal_gateway_requests_total{{model="{MODEL}",kind="completion",outcome="cancelled"}}'
        assert await metric_value(url, sample) == 2
