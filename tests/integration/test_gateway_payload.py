"""A prompt larger than the NATS server's max_payload is a 413, not a 503 clients retry for ever."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from shoal.shared import subjects
from shoal.shared.bus import connect
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.integration.gateway_harness import call, gateway_running

ONE_MIB = 1 << 20


@pytest.fixture
def small_payload_server(tmp_path: Path) -> Iterator[EmbeddedNatsServer]:
    """nats-server's default max_payload (1 MiB): smaller than the gateway's body limit."""
    server = EmbeddedNatsServer(store_dir=tmp_path / "js", max_payload_bytes=ONE_MIB)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_request_over_max_payload_is_a_413_naming_the_limit(small_payload_server: EmbeddedNatsServer,
                                                                   path: str) -> None:
    text = "x" * (3 * ONE_MIB // 2)
    body = ({"model": "any", "prompt": text} if path == "/v1/completions"
            else {"model": "any", "messages": [{"role": "user", "content": text}]})
    with capture_logs() as logs:
        async with gateway_running(small_payload_server.url, max_prompt_chars=4 * ONE_MIB) as url:
            status, payload, headers = await call("POST", url + path, json=body)
            small_status, _, _ = await call("POST", url + path, json={**body, **(
                {"prompt": "hi"} if "prompt" in body else {"messages": [{"role": "user", "content": "hi"}]})})
    assert status == 413, payload
    assert "max_payload" in payload["error"]["message"] and str(ONE_MIB) in payload["error"]["message"]
    assert payload["error"]["param"] == ("prompt" if "prompt" in body else "messages")
    assert "Retry-After" not in headers, "nothing to retry: the request is too large as it is"
    assert small_status == 404, "a small request goes on (to the unknown-model check)"
    warnings = [e for e in logs if e["event"] == "body_limit_above_nats_payload"]
    assert warnings and warnings[0]["max_payload_bytes"] == ONE_MIB, "the gateway says its limits disagree"
    bus = await connect(small_payload_server.url, "test")
    try:
        state = (await bus.js.stream_info(subjects.REQUESTS_STREAM)).state
        assert state.messages == 0, "nothing was queued"
    finally:
        await bus.close()


async def test_the_default_limits_agree(nats_server: EmbeddedNatsServer) -> None:
    """The embedded server (shoal up) takes every body the gateway accepts: no warning."""
    with capture_logs() as logs:
        async with gateway_running(nats_server.url):
            pass
    started = next(e for e in logs if e["event"] == "gateway_started")
    assert started["max_payload_bytes"] == 8 * ONE_MIB
    assert not [e for e in logs if e["event"] == "body_limit_above_nats_payload"]
