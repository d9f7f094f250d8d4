"""OpenAI's Files and Batch APIs on the gateway's HTTP edge (services/gateway/routes_batches.py),
on a real socket, the gateway connected as its own locked-down NATS user (what compose ships):
files kept, listed, read and deleted; each bad request a clear error; a batch run through the
gateway's own routes with the gateway's key."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shoal.services.gateway.app import start_gateway
from shoal.services.gateway.batch_store import part_name
from shoal.services.gateway.file_store import open_file_store
from shoal.shared.bus import Bus, connect
from shoal.shared.config import GatewayConfig
from shoal.shared.nats_permissions import render_users
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.e2e.conftest import free_port
from tests.integration.gateway_harness import call
from tests.nats_setups import Users

KEY = "user-key"
MAX_FILE_BYTES = 4096


@pytest.fixture
def locked_server(tmp_path: Path) -> Iterator[tuple[EmbeddedNatsServer, Users]]:
    users = Users()
    server = EmbeddedNatsServer(store_dir=tmp_path / "js", extra_config=render_users(), env=users.server_env)
    server.start()
    try:
        yield server, users
    finally:
        server.stop()


@pytest.fixture
async def gateway(locked_server: tuple[EmbeddedNatsServer, Users]) -> AsyncIterator[str]:
    server, users = locked_server
    admin: Bus = await connect(server.url, "admin", nats_config=users.config(None))  # creates the streams
    config = GatewayConfig(port=free_port(), api_keys=[KEY], request_timeout_s=10.0, max_file_bytes=MAX_FILE_BYTES,
                           batch_save_interval_s=1.0)
    runner = await start_gateway(config, server.url, nats_config=users.config("gateway"))
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        await runner.cleanup()
        await admin.close()
    assert not [line for line in server.error_lines if "Violation" in line], "the gateway's user may do all of it"


async def test_the_gateways_user_may_save_read_and_delete_a_batchs_answers(
        locked_server: tuple[EmbeddedNatsServer, Users]) -> None:
    """What a runner does with a running batch's saved answers (batch_saves.py), as the gateway's user."""
    server, users = locked_server
    admin: Bus = await connect(server.url, "admin", nats_config=users.config(None))
    gateway_bus: Bus = await connect(server.url, "gateway", nats_config=users.config("gateway"), role="gateway")
    try:
        files = await open_file_store(gateway_bus.js, GatewayConfig())
        name = part_name("batch_0193a4c2", "run1", 0)
        await files.put_object(name, b'{"index": 0}\n')
        assert await files.read_object(name) == b'{"index": 0}\n'
        await files.delete_object(name)
        assert await files.read_object(name) is None
    finally:
        await gateway_bus.close()
        await admin.close()
    assert not [line for line in server.error_lines if "Violation" in line]


async def _upload(url: str, data: bytes, purpose: str | None = "batch", filename: str = "in.jsonl",
                  **extra: str) -> tuple[int, Any]:
    form = aiohttp.FormData(default_to_multipart=True)
    if purpose is not None:
        form.add_field("purpose", purpose)
    for name, value in extra.items():
        form.add_field(name, value)
    if filename:
        form.add_field("file", data, filename=filename, content_type="application/jsonl")
    status, body, _ = await call("POST", url + "/v1/files", KEY, data=form)
    return status, body


async def _content(url: str, file_id: str) -> tuple[int, bytes]:
    return await _content_at(url, f"/v1/files/{file_id}/content")


async def _content_at(url: str, path: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.get(url + path,
                                                               headers={"Authorization": f"Bearer {KEY}"}) as resp:
        return resp.status, await resp.read()


def _line(custom_id: str, model: str = "org/none") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}})


async def test_a_file_is_kept_listed_read_and_deleted(gateway: str) -> None:
    data = ("\n".join(_line(f"r{i}") for i in range(3)) + "\n").encode()
    status, kept = await _upload(gateway, data, filename="jobs.jsonl")
    assert status == 200, kept
    assert kept["object"] == "file" and kept["id"].startswith("file-") and kept["bytes"] == len(data)
    assert kept["filename"] == "jobs.jsonl" and kept["purpose"] == "batch" and kept["expires_at"] > kept["created_at"]
    status, listed, _ = await call("GET", gateway + "/v1/files?purpose=batch", KEY)
    assert status == 200 and [f["id"] for f in listed["data"]] == [kept["id"]] and listed["has_more"] is False
    status, other, _ = await call("GET", gateway + "/v1/files?purpose=batch_output", KEY)
    assert status == 200 and other["data"] == []
    assert (await call("GET", f"{gateway}/v1/files/{kept['id']}", KEY))[1] == kept
    assert await _content(gateway, kept["id"]) == (200, data)
    status, deleted, _ = await call("DELETE", f"{gateway}/v1/files/{kept['id']}", KEY)
    assert status == 200 and deleted == {"id": kept["id"], "deleted": True, "object": "file"}
    status, gone, _ = await call("GET", f"{gateway}/v1/files/{kept['id']}", KEY)
    assert status == 404 and "no file" in gone["error"]["message"]
    assert (await _content(gateway, kept["id"]))[0] == 404
    assert (await call("GET", gateway + "/v1/files", None))[0] == 401, "files take the API's keys"


async def test_each_bad_upload_is_a_clear_error(gateway: str) -> None:
    status, body = await _upload(gateway, b"{}", purpose=None)
    assert status == 400 and body["error"]["param"] == "purpose"
    status, body = await _upload(gateway, b"{}", purpose="fine-tune")
    assert status == 400 and body["error"]["param"] == "purpose" and "Batch API" in body["error"]["message"]
    status, body = await _upload(gateway, b"", filename="", note="a field Shoal does not read")
    assert status == 400 and body["error"]["param"] == "file"
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    for name in ("a.jsonl", "b.jsonl"):
        form.add_field("file", b"{}", filename=name)
    status, body, _ = await call("POST", gateway + "/v1/files", KEY, data=form)
    assert status == 400 and body["error"]["param"] == "file" and "twice" in body["error"]["message"]
    status, body = await _upload(gateway, b"x" * (MAX_FILE_BYTES + 1))
    assert status == 413 and body["error"]["param"] == "file" and str(MAX_FILE_BYTES) in body["error"]["message"]
    status, body, _ = await call("POST", gateway + "/v1/files", KEY, json={"purpose": "batch"})
    assert status == 400 and "multipart/form-data" in body["error"]["message"]
    for torn in (b"purpose=batch", b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbat"):
        for content_type in ("multipart/form-data", "multipart/form-data; boundary=b"):
            status, body, _ = await call("POST", gateway + "/v1/files", KEY, data=torn,
                                         headers={"Content-Type": content_type})
            assert status == 400 and "not a multipart form" in body["error"]["message"], (torn, content_type, body)
    for path in ("/v1/files/file-nope", "/v1/files/not-an-id", "/v1/files/file-nope/content"):
        status, body, _ = await call("GET", gateway + path, KEY)
        assert status == 404 and "no file" in body["error"]["message"], path
    status, body, _ = await call("GET", gateway + "/v1/files?limit=0", KEY)
    assert status == 400 and body["error"]["param"] == "limit"
    status, listed, _ = await call("GET", gateway + "/v1/files", KEY)
    assert status == 200 and listed["data"] == [], "nothing was kept by a refused upload"


async def test_each_bad_batch_is_a_clear_error(gateway: str) -> None:
    _, kept = await _upload(gateway, _line("r0").encode())
    create = {"input_file_id": kept["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    cases = [({"endpoint": "/v1/models"}, 400, "endpoint"), ({"completion_window": "1h"}, 400, "completion_window"),
             ({"input_file_id": "file-nope"}, 404, "input_file_id"), ({"metadata": {"k": "v" * 600}}, 400, "metadata")]
    for change, expected, param in cases:
        status, body, _ = await call("POST", gateway + "/v1/batches", KEY, json=create | change)
        assert status == expected, (change, body)
        assert param in (body["error"]["param"] or ""), (change, body)
    status, body, _ = await call("POST", gateway + "/v1/batches", KEY, json={"endpoint": "/v1/chat/completions"})
    assert status == 400 and "input_file_id" in body["error"]["message"]
    for method, path in (("GET", "/v1/batches/batch_nope"), ("POST", "/v1/batches/batch_nope/cancel"),
                         ("GET", "/v1/batches/not-a-batch"), ("GET", "/v1/batches/batch_%C3%A9"),
                         ("POST", "/v1/batches/batch_%C3%A9/cancel")):
        status, body, _ = await call(method, gateway + path, KEY)
        assert status == 404 and "no batch" in body["error"]["message"], path
    status, listed, _ = await call("GET", gateway + "/v1/batches", KEY)
    assert status == 200 and listed["data"] == [], "no refused batch was made"


async def test_a_batch_runs_through_the_gateways_own_routes_with_its_key(gateway: str) -> None:
    """Every line is asked of the gateway itself (here: a model that does not exist, each line
    answered 404, not 401: the runner presents the gateway's key)."""
    _, kept = await _upload(gateway, "\n".join(_line(f"r{i}") for i in range(4)).encode())
    status, made, _ = await call("POST", gateway + "/v1/batches", KEY, json={
        "input_file_id": kept["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h",
        "metadata": {"job": "nightly"}})
    assert status == 200 and made["status"] == "validating" and made["metadata"] == {"job": "nightly"}
    deadline = time.monotonic() + 30
    while (batch := (await call("GET", f"{gateway}/v1/batches/{made['id']}", KEY))[1])["status"] != "completed":
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.1)
    assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 4} and batch["output_file_id"] is None
    status, errors = await _content(gateway, batch["error_file_id"])
    assert status == 200
    records = [json.loads(line) for line in errors.decode().splitlines()]
    assert [r["custom_id"] for r in records] == ["r0", "r1", "r2", "r3"]
    assert {r["response"]["status_code"] for r in records} == {404}
    assert "does not exist" in records[0]["response"]["body"]["error"]["message"]
    status, cancelled, _ = await call("POST", f"{gateway}/v1/batches/{made['id']}/cancel", KEY)
    assert status == 200 and cancelled["status"] == "completed", "an ended batch stays as it ended"


async def test_batches_are_listed_newest_first_a_page_at_a_time(gateway: str) -> None:
    _, kept = await _upload(gateway, _line("r0").encode())
    made = []
    for _ in range(3):
        status, batch, _ = await call("POST", gateway + "/v1/batches", KEY, json={
            "input_file_id": kept["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        assert status == 200
        made.append(batch["id"])
        await asyncio.sleep(0.01)  # ids are ordered by the millisecond
    status, first, _ = await call("GET", gateway + "/v1/batches?limit=2", KEY)
    assert status == 200 and [b["id"] for b in first["data"]] == made[::-1][:2] and first["has_more"] is True
    status, rest, _ = await call("GET", f"{gateway}/v1/batches?limit=2&after={first['last_id']}", KEY)
    assert [b["id"] for b in rest["data"]] == [made[0]] and rest["has_more"] is False
    status, body, _ = await call("GET", gateway + "/v1/batches?after=batch_0", KEY)
    assert status == 200 and body["data"] == [] and body["has_more"] is False, "older than them all: nothing after"


async def test_message_batches_refuse_bad_requests_in_anthropics_form_and_end_with_results(gateway: str) -> None:
    params = {"model": "org/none", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for body, needle in (({"requests": []}, "requests"), ({"requests": [{"custom_id": "a b", "params": params}]},
                                                          "custom_id"),
                         ({"requests": [{"custom_id": "a", "params": {**params, "stream": True}}]}, "requests[0]")):
        status, error, _ = await call("POST", gateway + "/v1/messages/batches", KEY, json=body)
        assert status == 400 and error["type"] == "error" and needle in error["error"]["message"], (body, error)
    status, made, _ = await call("POST", gateway + "/v1/messages/batches", KEY, json={
        "requests": [{"custom_id": "a", "params": params}, {"custom_id": "b", "params": params}]})
    assert status == 200 and made["type"] == "message_batch" and made["request_counts"]["processing"] == 2
    deadline = time.monotonic() + 30
    while (batch := (await call("GET", f"{gateway}/v1/messages/batches/{made['id']}", KEY))[1]).get(
            "processing_status") != "ended":
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.1)
    assert batch["request_counts"] == {"processing": 0, "succeeded": 0, "errored": 2, "canceled": 0, "expired": 0}
    status, results = await _content_at(gateway, f"/v1/messages/batches/{made['id']}/results")
    lines = [json.loads(line) for line in results.decode().splitlines()]
    assert status == 200 and [(r["custom_id"], r["result"]["type"]) for r in lines] == [("a", "errored"),
                                                                                      ("b", "errored")]
    assert lines[0]["result"]["error"]["error"]["type"] == "not_found_error"
    assert batch["results_url"] == f"/v1/messages/batches/{made['id']}/results", "relative: joined to the base URL"
    _, as_openai, _ = await call("GET", f"{gateway}/v1/batches/{made['id']}", KEY)
    files = {as_openai["input_file_id"], as_openai["error_file_id"]}
    status, deleted, _ = await call("DELETE", f"{gateway}/v1/messages/batches/{made['id']}", KEY)
    assert status == 200 and deleted == {"id": made["id"], "type": "message_batch_deleted"}
    assert (await _content_at(gateway, f"/v1/messages/batches/{made['id']}/results"))[0] == 404
    status, listed, _ = await call("GET", gateway + "/v1/files", KEY)
    assert status == 200 and not files & {f["id"] for f in listed["data"]}, "its files went with it"
    status, error, _ = await call("GET", gateway + "/v1/messages/batches?after_id=batch_1&before_id=batch_2", KEY)
    assert status == 400 and error["type"] == "error"
    _, kept = await _upload(gateway, _line("r0").encode())
    _, openai_batch, _ = await call("POST", gateway + "/v1/batches", KEY, json={
        "input_file_id": kept["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    status, error, _ = await call("GET", f"{gateway}/v1/messages/batches/{openai_batch['id']}", KEY)
    assert status == 404 and error["type"] == "error", "an OpenAI batch of another route is no message batch"


async def test_message_batches_page_both_ways_and_openai_batches_are_not_among_them(gateway: str) -> None:
    params = {"model": "org/none", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    made = []
    for n in range(3):
        status, batch, _ = await call("POST", gateway + "/v1/messages/batches", KEY,
                                      json={"requests": [{"custom_id": f"r{n}", "params": params}]})
        assert status == 200
        made.append(batch["id"])
        await asyncio.sleep(0.01)  # ids are ordered by the millisecond
    _, kept = await _upload(gateway, _line("r0").encode())
    await call("POST", gateway + "/v1/batches", KEY, json={"input_file_id": kept["id"],
                                                           "endpoint": "/v1/messages", "completion_window": "24h"})
    newest = made[::-1]
    status, first, _ = await call("GET", gateway + "/v1/messages/batches?limit=2", KEY)
    assert status == 200 and [b["id"] for b in first["data"]] == newest[:2] and first["has_more"] is True
    assert (first["first_id"], first["last_id"]) == (newest[0], newest[1])
    _, older, _ = await call("GET", f"{gateway}/v1/messages/batches?limit=2&after_id={first['last_id']}", KEY)
    assert [b["id"] for b in older["data"]] == newest[2:] and older["has_more"] is False
    _, newer, _ = await call("GET", f"{gateway}/v1/messages/batches?limit=1&before_id={newest[2]}", KEY)
    assert [b["id"] for b in newer["data"]] == [newest[1]] and newer["has_more"] is True
