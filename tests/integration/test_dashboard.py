"""The dashboard on a large generated cluster (64 GPUs, 100 models) in real KV buckets, served by
a real gateway with API keys: its data API, its event stream, and the page in headless Chromium."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from shoal.services.gateway.app import start_gateway
from shoal.shared.bus import Bus, publish_event
from shoal.shared.config import GatewayConfig
from shoal.shared.messages import Event
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.browser import LAUNCH_ARGS, VIEWPORT, chromium_executable
from tests.e2e.conftest import free_port
from tests.integration import dashboard_data
from tests.integration.gateway_harness import call, gateway_running

USER_KEY = "user-key"
ADMIN_KEY = "admin-key"
KEYS = {"api_keys": [USER_KEY], "admin_api_keys": [ADMIN_KEY]}


async def _wait_for_state(url: str, check, timeout_s: float = 20.0) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.1)):
        status, state, _ = await call("GET", url + "/ui/api/state", USER_KEY)
        assert status == 200, state
        if check(state):
            return state
        await asyncio.sleep(0.1)
    raise AssertionError(f"the dashboard's state never satisfied the check: {state}")


async def test_state_follows_the_key_rules_and_describes_the_whole_cluster(
    bus: Bus, nats_server: EmbeddedNatsServer
) -> None:
    cluster = dashboard_data.generate()
    await dashboard_data.write(bus, cluster)
    async with gateway_running(nats_server.url, **KEYS) as url:
        for path in ("/ui", "/ui/static/app.js", "/ui/static/style.css"):
            async with aiohttp.ClientSession() as session, session.get(url + path) as response:
                assert response.status == 200, path  # the page holds no data: open
                if path == "/ui":
                    assert "script-src 'self'" in response.headers["Content-Security-Policy"]
        for key, status in ((None, 401), ("wrong", 401), (USER_KEY, 200), (ADMIN_KEY, 200)):
            assert (await call("GET", url + "/ui/api/state", key))[0] == status, key
        for sneaky in ("/ui/static/../api/state", "/ui/static/%2e%2e/api/state"):
            assert (await call("GET", url + sneaky))[0] in (401, 403, 404), sneaky
        await dashboard_data.publish_stats(bus, cluster)  # the gateway subscribed after the first ones
        state = await _wait_for_state(url, lambda s: sum(r["kv_usage"] is not None for r in s["replicas"])
                                      == len(cluster.stats) and len(s["models"]) == dashboard_data.NUM_MODELS)
        assert state["admin"] is False
        assert (await call("GET", url + "/ui/api/state", ADMIN_KEY))[1]["admin"] is True
        assert sum(len(n["gpus"]) for n in state["nodes"]) == 64
        assert {r["replica_id"] for r in state["replicas"]} == {r.replica_id for r in cluster.replicas}
        phases = {r["phase"] for r in state["replicas"]}
        assert {"placing", "loading_weights", "warming_up"} <= phases
        held = {g["key"]: sum(o["held_bytes"] for o in g["occupants"]) for n in state["nodes"] for g in n["gpus"]}
        assert held == {f"{g.node_id}.{g.index}": g.reserved_bytes for g in cluster.gpus}
        status, error, _ = await call("GET", url + "/ui/api/state?since=yesterday", USER_KEY)
        assert status == 400 and error["error"]["param"] == "since"


async def _read_events(response: aiohttp.ClientResponse, count: int) -> list[tuple[int, dict[str, Any]]]:
    """The next `count` events of an SSE response, as (id, event)."""
    found: list[tuple[int, dict[str, Any]]] = []
    event_id = None
    while len(found) < count:
        line = (await asyncio.wait_for(response.content.readline(), 10.0)).decode().rstrip("\n")
        if line.startswith("id: "):
            event_id = int(line.removeprefix("id: "))
        elif line.startswith("data: "):
            assert event_id is not None
            found.append((event_id, json.loads(line.removeprefix("data: "))))
    return found


async def test_events_stream_replays_recent_events_then_live_ones_and_resumes(
    bus: Bus, nats_server: EmbeddedNatsServer
) -> None:
    for i in range(3):
        await publish_event(bus.js, Event("model_registered", 1000.0 + i, model=f"org/m{i}"))
    async with gateway_running(nats_server.url, **KEYS) as url, aiohttp.ClientSession() as session:
        async with session.get(url + "/ui/api/events") as response:
            assert response.status == 401
        headers = {"Authorization": f"Bearer {USER_KEY}"}
        async with session.get(url + "/ui/api/events", headers=headers) as response:
            assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
            backlog = await _read_events(response, 3)
            assert [e["model"] for _, e in backlog] == ["org/m0", "org/m1", "org/m2"]
            await publish_event(bus.js, Event("replica_failed", 2000.0, "boom", model="org/m1"))
            ((live_id, live),) = await _read_events(response, 1)
            assert live["kind"] == "replica_failed" and live["message"] == "boom"
            assert live_id > backlog[-1][0]
        await publish_event(bus.js, Event("replica_ready", 3000.0, model="org/m2"))
        resumed = headers | {"Last-Event-ID": str(live_id)}
        async with session.get(url + "/ui/api/events", headers=resumed) as response:
            ((_, event),) = await _read_events(response, 1)
            assert event["kind"] == "replica_ready", "only what came after the id it had"
        async with session.get(url + "/ui/api/events?after=x", headers=headers) as response:
            assert response.status == 400


async def test_page_in_chromium_with_64_gpus_and_100_models(
    bus: Bus, nats_server: EmbeddedNatsServer, tmp_path: Path
) -> None:
    executable = chromium_executable()
    from playwright.async_api import async_playwright

    cluster = dashboard_data.generate()
    await dashboard_data.write(bus, cluster)
    async with gateway_running(nats_server.url, **KEYS) as url, async_playwright() as playwright:
        await dashboard_data.publish_stats(bus, cluster)
        await _wait_for_state(url, lambda s: sum(r["kv_usage"] is not None for r in s["replicas"])
                              == len(cluster.stats))
        browser = await playwright.chromium.launch(executable_path=executable, args=LAUNCH_ARGS)
        try:
            page = await browser.new_page(viewport=VIEWPORT)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(url + "/ui")
            # No key yet: the page says what it needs and shows nothing.
            await page.wait_for_selector("#status[data-state=locked]")
            assert "API key" in await page.locator("#banner").inner_text()
            assert await page.locator(".gpu").count() == 0

            await page.fill("#key", USER_KEY)
            await page.click("#key-form button[type=submit]")
            await page.wait_for_function("() => document.querySelectorAll('.gpu').length === 64")
            await page.wait_for_function(f"() => document.querySelectorAll('#models tbody tr').length === "
                                         f"{dashboard_data.NUM_MODELS}")
            assert await page.locator("#replicas tbody tr").count() == len(cluster.replicas)
            assert not await page.locator("#admin-badge").is_visible(), "a user key sees no admin actions"
            assert not await page.locator("#models tbody tr .actions").first.is_visible()
            assert await page.evaluate("sessionStorage.getItem('shoal.apiKey')") == USER_KEY

            # Usable at this size: nothing wider than the window, every GPU bar drawn to scale.
            assert await page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
            for gpu in cluster.gpus[:16]:
                key = f"{gpu.node_id}.{gpu.index}"
                bar = page.locator(f'#nodes .gpu[data-key="{key}"] .bar')
                bar_width = (await bar.bounding_box() or {"width": 0})["width"]
                segments = await bar.locator(".seg").evaluate_all(
                    "segs => segs.reduce((a, s) => a + s.getBoundingClientRect().width, 0)")
                expected = bar_width * gpu.reserved_bytes / gpu.total_bytes
                assert abs(segments - expected) <= 3 * (await bar.locator(".seg").count()) + 1, key
            await page.screenshot(path=str(tmp_path / "dashboard-64-gpus.png"), full_page=True)

            # Filtering keeps the page usable with many models.
            await page.fill("#model-filter", "org-07/")
            expected_rows = sum(m.key.startswith("org-07/") for m in cluster.models)
            await page.wait_for_function(
                f"() => document.querySelectorAll('#models tbody tr').length === {expected_rows}")

            # An admin key shows the admin actions; one reaches the gateway (no scheduler: its error shows).
            await page.fill("#key", ADMIN_KEY)
            await page.click("#key-form button[type=submit]")
            await page.wait_for_selector("#admin-badge", state="visible")
            row = page.locator("#models tbody tr").first
            await row.locator(".actions input").fill("2")
            await row.locator(".actions button", has_text="Scale").click()
            await page.wait_for_selector("#toast.error")
            assert "no scheduler is running" in await page.locator("#toast").inner_text()
            await page.screenshot(path=str(tmp_path / "dashboard-admin.png"))

            await publish_event(bus.js, Event("replica_failed", 1.0, "CUDA error", model=cluster.models[0].key))
            await page.wait_for_selector('#events li[data-kind="replica_failed"]')
            assert errors == []
        finally:
            await browser.close()


async def test_the_admin_cluster_view_shows_loading_phases_to_admin_keys_only(
    bus: Bus, nats_server: EmbeddedNatsServer
) -> None:
    cluster = dashboard_data.generate()
    await dashboard_data.write(bus, cluster)
    async with gateway_running(nats_server.url, **KEYS) as url:
        assert (await call("GET", url + "/admin/cluster", USER_KEY))[0] == 403
        status, report, _ = await call("GET", url + "/admin/cluster", ADMIN_KEY)
        assert status == 200
        phases = {r["replica_id"]: r.get("phase") for r in report["replicas"]}
        assert phases == {r.replica_id: r.phase for r in cluster.replicas}
        assert {"loading_weights", "warming_up"} <= set(phases.values())


async def test_stopping_the_gateway_ends_its_open_event_streams(nats_server: EmbeddedNatsServer) -> None:
    config = GatewayConfig(port=free_port())
    runner = await start_gateway(config, nats_server.url)
    async with aiohttp.ClientSession() as session:
        response = await session.get(f"http://127.0.0.1:{config.port}/ui/api/events")
        assert (await response.content.readline()).startswith(b": SHOAL_EVENTS")
        # aiohttp waits up to a minute for open handlers at shutdown: the streams must end first.
        await asyncio.wait_for(runner.cleanup(), timeout=20.0)
        rest = await asyncio.wait_for(response.content.read(), timeout=5.0)
        assert b"data:" not in rest
        response.release()
