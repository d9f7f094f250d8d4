"""Replicas through `shoal up`: scale out, spread, evict, a worker killed, a model that cannot load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp
import msgspec
import nats.errors
import pytest
from nats.js.api import DeliverPolicy

from shoal.shared import subjects
from shoal.shared.bus import connect
from shoal.shared.messages import Event
from tests.e2e.conftest import ShoalUp, http_json

pytestmark = pytest.mark.e2e

MODEL = "demo/llama-5m"


def _admin(shoal: ShoalUp, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict]:
    return http_json(shoal.base_url, method, path, body)


def _replicas(shoal: ShoalUp, model: str) -> list[dict[str, Any]]:
    _, cluster = _admin(shoal, "GET", "/admin/cluster")
    return [r for r in cluster["replicas"] if r["model"] == model]


def _wait_for(predicate, timeout_s: float = 180.0, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


async def _events(shoal: ShoalUp, kind: str) -> list[Event]:
    """The events of `kind` in SHOAL_EVENTS so far (the node agent records a failed replica there)."""
    bus = await connect(shoal.nats_url, "test-events")
    try:
        subscription = await bus.js.subscribe(subjects.event_subject(kind), ordered_consumer=True,
                                              deliver_policy=DeliverPolicy.ALL)
        found = []
        while True:
            try:
                msg = await subscription.next_msg(timeout=1.0)
            except nats.errors.TimeoutError:
                break  # every stored event delivered
            found.append(msgspec.json.decode(msg.data, type=Event))
        await subscription.unsubscribe()
        return found
    finally:
        await bus.close()


def _serving(shoal: ShoalUp, model: str) -> list[dict[str, Any]]:
    return [r for r in _replicas(shoal, model) if r.get("level", "HOT") == "HOT" and r.get("state") == "ready"]


async def _complete_many(shoal: ShoalUp, count: int) -> list[str]:
    """`count` concurrent completions; returns the replica that answered each."""
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> str:
            body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 8, "ignore_eos": True}
            async with session.post(shoal.v1 + "/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=300)) as response:
                assert response.status == 200, await response.text()
                payload = await response.json()
                assert payload["usage"]["completion_tokens"] == 8
                return response.headers["X-Shoal-Replica"]

        return list(await asyncio.gather(*(one(i) for i in range(count))))


def test_scale_spread_evict_and_replace_a_killed_worker(shoal: ShoalUp) -> None:
    status, reply = _admin(shoal, "POST", f"/admin/models/{MODEL}/scale", {"replicas": 3})
    assert status == 200 and reply["ok"], reply
    replicas = _wait_for(lambda: len(_serving(shoal, MODEL)) == 3 and _serving(shoal, MODEL), what="3 replicas")
    ids = {r["replica_id"] for r in replicas}

    answered = asyncio.run(_complete_many(shoal, 24))
    assert set(answered) == ids, "concurrent requests should spread over every replica"

    # Evict one replica while requests keep coming: none of them fails.
    victim = sorted(ids)[0]
    async def evict_under_load() -> list[str]:
        load = asyncio.create_task(_complete_many(shoal, 12))
        await asyncio.sleep(0.2)
        status, reply = await asyncio.to_thread(_admin, shoal, "POST", f"/admin/models/{MODEL}/evict",
                                                {"replica_id": victim})
        assert status == 200 and reply["ok"], reply
        return await load

    assert len(asyncio.run(evict_under_load())) == 12
    remaining = _wait_for(lambda: len(_serving(shoal, MODEL)) == 2 and _serving(shoal, MODEL), what="2 replicas")
    assert victim not in {r["replica_id"] for r in remaining}
    assert set(asyncio.run(_complete_many(shoal, 8))) <= {r["replica_id"] for r in remaining}

    # Kill a worker: its replica is marked failed, removed, and replaced.
    killed = remaining[0]
    os.kill(killed["pid"], signal.SIGKILL)
    _wait_for(lambda: killed["replica_id"] not in {r["replica_id"] for r in _serving(shoal, MODEL)}
              and len(_serving(shoal, MODEL)) == 2, what="the killed replica to be replaced")
    _, events = _admin(shoal, "GET", "/admin/cluster")
    assert killed["replica_id"] not in {r["replica_id"] for r in events["replicas"] if r["state"] != "sleeping"}
    failed = _wait_for(lambda: [e for e in asyncio.run(_events(shoal, "replica_failed"))
                                if e.replica_id == killed["replica_id"]], what="the replica_failed event")
    assert len(failed) == 1 and failed[0].model == MODEL, failed
    assert "worker killed by SIGKILL" in failed[0].message, failed[0].message
    assert len(asyncio.run(_complete_many(shoal, 6))) == 6


def test_a_model_that_cannot_load_answers_503_with_the_reason(shoal: ShoalUp) -> None:
    status, reply = _admin(shoal, "POST", "/admin/models",
                           {"key": "demo/too-small", "path": MODEL, "memory_override_bytes": "1MiB"})
    assert status == 200, reply
    body = json.dumps({"model": "demo/too-small", "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(shoal.v1 + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as excinfo:
        urllib.request.urlopen(request, timeout=300)
    assert excinfo.value.code == 503
    error = json.loads(excinfo.value.read())["error"]
    assert "do not fit" in error["message"], error
    assert time.monotonic() - started < 120, "a failing model must not hold requests until their deadline"
    assert excinfo.value.headers.get("Retry-After")
