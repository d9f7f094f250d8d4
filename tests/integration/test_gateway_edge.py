"""The gateway's HTTP edge on a real socket and a real nats-server: keys, errors, health."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from shoal.services.gateway.app import start_gateway
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.config import GatewayConfig
from shoal.shared.messages import ModelSpec
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.e2e.conftest import free_port

CHAT = {"model": "org/m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
async def gateway(bus: Bus, nats_server: EmbeddedNatsServer) -> AsyncIterator[str]:
    await bus.models.put(subjects.model_token("org/m"), ModelSpec(key="org/m", path="m", registered_at=1.0))
    config = GatewayConfig(port=free_port(), api_keys=["user-key"], admin_api_keys=["admin-key"],
                           request_timeout_s=5.0)
    runner = await start_gateway(config, nats_server.url)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        await runner.cleanup()


async def _call(method: str, url: str, key: str | None = None, **kwargs) -> tuple[int, dict]:  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session, session.request(method, url, headers=headers, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_api_keys_guard_v1_and_admin_keys_guard_admin(gateway: str) -> None:
    status, body = await _call("GET", gateway + "/v1/models")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert (await _call("GET", gateway + "/v1/models", "wrong"))[0] == 401
    status, body = await _call("GET", gateway + "/v1/models", "user-key")
    assert status == 200 and [m["id"] for m in body["data"]] == ["org/m"]
    assert (await _call("GET", gateway + "/v1/models", "admin-key"))[0] == 200
    assert (await _call("GET", gateway + "/admin/cluster"))[0] == 401
    assert (await _call("GET", gateway + "/admin/cluster", "user-key"))[0] == 403
    status, body = await _call("GET", gateway + "/admin/cluster", "admin-key")
    assert status == 200 and body["models"][0]["key"] == "org/m"
    # Health and metrics stay open for probes and scrapers.
    assert (await _call("GET", gateway + "/healthz"))[0] == 200


async def test_ollamas_api_takes_the_same_keys_and_unloading_is_an_admin_action(gateway: str) -> None:
    """``/api`` is guarded as /v1 is (Ollama's errors: ``{"error": "..."}``); its probes are open;
    ``keep_alive: 0`` puts a model to sleep for everyone, so only an admin key may send it."""
    status, body = await _call("GET", gateway + "/api/tags")
    assert status == 401 and "API key" in body["error"]
    status, body = await _call("GET", gateway + "/api/tags", "user-key")
    assert status == 200 and [m["name"] for m in body["models"]] == ["org/m"]
    assert (await _call("GET", gateway + "/api/version"))[0] == 200
    async with aiohttp.ClientSession() as session, session.get(gateway + "/") as resp:
        assert resp.status == 200
    unload = {"model": "org/m", "keep_alive": 0}
    status, body = await _call("POST", gateway + "/api/generate", "user-key", json=unload)
    assert status == 403 and "admin key" in body["error"]
    status, body = await _call("POST", gateway + "/api/generate", "admin-key", json=unload)
    assert status == 503 and "scheduler" in body["error"]  # allowed: only the scheduler is missing here


async def test_anthropics_api_takes_keys_as_x_api_key_and_answers_anthropics_errors(gateway: str) -> None:
    """Anthropic's clients send ``x-api-key``; errors under ``/v1/messages`` are Anthropic's
    ``{"type": "error", "error": {"type", "message"}}``, whatever their cause."""
    message = {"model": "org/m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    status, body = await _call("POST", gateway + "/v1/messages", json=message)
    assert status == 401 and body.pop("request_id") and body == {"type": "error", "error": {
        "type": "authentication_error",
        "message": "missing or invalid API key: send Authorization: Bearer <key> (or x-api-key: <key>)"}}
    async with aiohttp.ClientSession() as session:
        async with session.get(gateway + "/v1/models", headers={"x-api-key": "user-key"}) as resp:
            assert resp.status == 200
        async with session.get(gateway + "/v1/models", headers={"x-api-key": "wrong"}) as resp:
            assert resp.status == 401
        both = {"x-api-key": "user-key", "Authorization": "Bearer a-proxy-token"}  # either may hold the key
        async with session.get(gateway + "/v1/models", headers=both) as resp:
            assert resp.status == 200
        async with session.post(gateway + "/v1/messages", headers={"x-api-key": "user-key"}, json=message) as resp:
            body = await resp.json()  # allowed: only the scheduler is missing here
            assert resp.status == 503 and body["type"] == "error" and body["error"]["type"] == "overloaded_error"
            assert body["request_id"] == resp.headers["request-id"] == resp.headers["X-Request-Id"]
    status, body = await _call("POST", gateway + "/v1/messages", "user-key", json={**message, "max_tokens": 0})
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]
    status, body = await _call("POST", gateway + "/v1/messages/count_tokens", "user-key", json={
        "model": "org/nope", "messages": message["messages"]})
    assert status == 404 and body["error"]["type"] == "not_found_error"


async def test_browsers_of_listed_origins_may_call_the_gateway(bus: Bus, nats_server: EmbeddedNatsServer) -> None:
    """CORS: a listed origin's preflight is answered without a key (browsers send none), its
    requests' answers name it, errors and key checks included; another origin gets nothing."""
    await bus.models.put(subjects.model_token("org/m"), ModelSpec(key="org/m", path="m", registered_at=1.0))
    config = GatewayConfig(port=free_port(), api_keys=["user-key"], cors_origins=["http://localhost:3000"])
    runner = await start_gateway(config, nats_server.url)
    url = f"http://127.0.0.1:{config.port}"
    page, stranger = {"Origin": "http://localhost:3000"}, {"Origin": "http://evil.example"}
    asks = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.options(url + "/v1/chat/completions", headers=page | asks) as resp:
                assert resp.status == 204
                assert resp.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
                assert "POST" in resp.headers["Access-Control-Allow-Methods"]
                assert resp.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            async with session.options(url + "/v1/chat/completions", headers=stranger | asks) as resp:
                assert resp.status == 401 and "Access-Control-Allow-Origin" not in resp.headers  # not answered as one
            auth = {"Authorization": "Bearer user-key"}
            async with session.get(url + "/api/tags", headers=page | auth) as resp:
                assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
                assert "X-Request-Id" in resp.headers["Access-Control-Expose-Headers"]
            async with session.get(url + "/v1/models", headers=page) as resp:  # no key: the 401 is readable
                assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
            async with session.get(url + "/v1/models", headers=stranger | auth) as resp:
                assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
    finally:
        await runner.cleanup()


async def test_no_scheduler_means_503_with_retry_after(gateway: str) -> None:
    async with aiohttp.ClientSession() as session, session.post(
        gateway + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer user-key"}
    ) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"]
        body = await resp.json()
    assert "scheduler" in body["error"]["message"]


async def test_unknown_route_and_method_are_openai_errors(gateway: str) -> None:
    status, body = await _call("GET", gateway + "/v1/nothing", "user-key")
    assert status == 404 and "no route" in body["error"]["message"]
    status, body = await _call("GET", gateway + "/v1/chat/completions", "user-key")
    assert status == 405 and body["error"]["message"]


async def test_oversized_body_is_413(gateway: str) -> None:
    huge = {"model": "org/m", "prompt": "x" * (5 * 1024 * 1024)}
    status, body = await _call("POST", gateway + "/v1/completions", "user-key", json=huge)
    assert status == 413 and body["error"]["message"]


async def test_admin_rejects_bad_bodies(gateway: str) -> None:
    status, body = await _call("POST", gateway + "/admin/models", "admin-key", json={"key": "x", "path": "../up"})
    assert status == 400 and "models root" in body["error"]["message"]
    status, body = await _call("POST", gateway + "/admin/models/org/m/scale", "admin-key", json={"replicas": -1})
    assert status == 400 and body["error"]["param"] == "replicas"
