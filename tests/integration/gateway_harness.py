"""Helpers for gateway tests: a gateway on a real socket, HTTP calls, /metrics samples, and a
stand-in for the scheduler's `ensure` endpoint on the real bus (for cold starts on demand)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from multidict import CIMultiDictProxy
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from shoal.services.gateway.app import start_gateway
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.config import GatewayConfig
from shoal.shared.messages import SchedulerReply, encode_json
from tests.e2e.conftest import free_port


@contextlib.asynccontextmanager
async def gateway_running(nats_url: str, **config: Any) -> AsyncIterator[str]:
    """A gateway with `config` (GatewayConfig fields) on a free port; yields its base URL."""
    gateway_config = GatewayConfig(port=free_port(), **config)
    runner = await start_gateway(gateway_config, nats_url)
    try:
        yield f"http://127.0.0.1:{gateway_config.port}"
    finally:
        await runner.cleanup()


async def call(method: str, url: str, key: str | None = None, **kwargs: Any
               ) -> tuple[int, Any, CIMultiDictProxy[str]]:
    """(status, JSON body, headers) of one request."""
    headers = ({"Authorization": f"Bearer {key}"} if key else {}) | kwargs.pop("headers", {})
    async with aiohttp.ClientSession() as session, session.request(method, url, headers=headers, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None), resp.headers


async def metric_value(base_url: str, sample: str) -> float | None:
    """The value of one sample of GET /metrics (e.g. ``shoal_x{model="m",kind="chat"}``, labels
    in any order), None if absent."""
    async with aiohttp.ClientSession() as session, session.get(base_url + "/metrics") as resp:
        text = await resp.text()
    return find_sample(text, sample)


def parse_samples(text: str) -> list[Sample]:
    """Every sample of a text exposition."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def find_sample(text: str, sample: str) -> float | None:
    """The value of `sample` (a sample line without its value) in the exposition `text`."""
    (wanted,) = parse_samples(f"{sample} 0\n")
    for found in parse_samples(text):
        if found.name == wanted.name and found.labels == wanted.labels:
            return found.value
    return None


class StandInScheduler:
    """Answers ``shoal.scheduler.ensure`` like a scheduler whose placement is under way:
    at once, or, while `hold` is set, only on `release()` (a slow cold start)."""

    def __init__(self, bus: Bus, *, hold: bool) -> None:
        self._bus = bus
        self._hold = hold
        self._held: list[Msg] = []
        self.num_asked = 0
        self.asked = asyncio.Event()
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        self._subscription = await self._bus.nc.subscribe(subjects.scheduler_subject("ensure"), cb=self._on_ensure)

    async def stop(self) -> None:
        await self.release()
        if self._subscription is not None:
            await self._subscription.unsubscribe()

    async def release(self) -> None:
        self._hold = False
        held, self._held = self._held, []
        for msg in held:
            await self._answer(msg)

    async def _on_ensure(self, msg: Msg) -> None:
        self.num_asked += 1
        self.asked.set()
        if self._hold:
            self._held.append(msg)
        else:
            await self._answer(msg)

    async def _answer(self, msg: Msg) -> None:
        await msg.respond(encode_json(SchedulerReply(ok=True, status="placed", message="placement under way")))
