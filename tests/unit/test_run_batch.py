"""``shoal run-batch`` (cli/run_batch.py): the batch file's checks, the output's order and
resumption, and the retries, against a real HTTP server on a socket."""

from __future__ import annotations

import asyncio
import io
import json
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from shoal.cli.run_batch import OrderedWriter, Summary, finished_ids, run
from shoal.shared.openai_batch import (
    MIN_RETRY_DELAY_S,
    BadBatch,
    BatchLine,
    Outcome,
    Sender,
    read_batch,
    retry_delay_s,
)
from tests.local_http import serving


def _line(custom_id: str, url: str = "/v1/chat/completions", **body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}})


def test_a_batch_is_read_in_order_blank_lines_skipped() -> None:
    batch = read_batch([_line("a"), "\n", _line("b", "/v1/embeddings", input="x"), _line("c", "/v1/messages")])
    assert [(line.custom_id, line.url) for line in batch] == [
        ("a", "/v1/chat/completions"), ("b", "/v1/embeddings"), ("c", "/v1/messages")]
    assert batch[1].body == {"model": "m", "input": "x"}


def test_every_bad_line_is_named_and_nothing_is_read() -> None:
    lines = [_line("a"), "not json", _line("a"), _line("b", "/v1/models"), _line("c", stream=True),
             json.dumps({"custom_id": "d", "method": "GET", "url": "/v1/completions", "body": {}}),
             json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/completions"}),
             _line("")]
    with pytest.raises(BadBatch) as caught:
        read_batch(lines)
    assert [number for number, _ in caught.value.problems] == list(range(2, 9))
    problems = [problem for _, problem in caught.value.problems]
    assert "line 2: " in str(caught.value) and "7 bad line(s)" in str(caught.value)
    assert "is line 1's too" in problems[1]
    assert "'/v1/models' is not a batch route" in problems[2]
    assert "stream is not supported" in problems[3]
    assert "`$.method`" in problems[4] and "body" in problems[5] and "custom_id is empty" in problems[6]
    assert str(caught.value).startswith("7 bad line(s), nothing sent")
    with pytest.raises(BadBatch) as caught:  # the Batch API's batches name one endpoint
        read_batch([_line("a"), _line("b", "/v1/embeddings")], endpoint="/v1/chat/completions")
    assert caught.value.problems == [(2, "url '/v1/embeddings' is not the batch's endpoint '/v1/chat/completions'")]


async def test_lines_are_written_once_every_line_before_them_is() -> None:
    out = io.StringIO()
    writer = OrderedWriter(out, window=4)
    await writer.put(2, Outcome("c", 200, "r3", {}))
    await writer.put(1, Outcome("b", 200, "r2", {}))
    assert out.getvalue() == ""
    await writer.put(0, Outcome("a", 404, "r1", {"error": {"message": "no"}}))
    records = [json.loads(text) for text in out.getvalue().splitlines()]
    assert [record["custom_id"] for record in records] == ["a", "b", "c"]
    assert records[0]["response"] == {"status_code": 404, "request_id": "r1", "body": {"error": {"message": "no"}}}
    assert records[0]["error"] is None and records[0]["id"].startswith("batch_req_")


async def test_no_line_is_sent_further_than_the_window_past_the_first_unwritten() -> None:
    writer = OrderedWriter(io.StringIO(), window=2)
    await writer.wait_for_room(1)  # lines 0 and 1 may go
    blocked = asyncio.ensure_future(writer.wait_for_room(2))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    await writer.put(1, Outcome("b", 200, None, {}))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # line 0 still holds the window
    await writer.put(0, Outcome("a", 200, None, {}))
    await asyncio.wait_for(blocked, timeout=5)


def test_a_resumed_run_keeps_only_answered_lines() -> None:
    answered = json.dumps(Outcome("a", 200, "r", {}).record())
    refused = json.dumps(Outcome("r", 400, "r", {}).record())
    unanswered = json.dumps(Outcome("b", None, None, None, error={"code": "unreachable", "message": "x"}).record())
    still_busy = json.dumps(Outcome("s", 503, "r", {"error": {}}).record())
    torn = json.dumps(Outcome("c", 200, "r", {}).record())[:40]
    assert finished_ids([answered + "\n", refused + "\n", unanswered + "\n", still_busy + "\n", torn, "[]\n",
                         "{}\n"]) == {"a", "r"}


def test_usage_is_counted_in_openais_and_anthropics_form() -> None:
    assert Outcome("a", 200, None, {"usage": {"prompt_tokens": 3, "total_tokens": 7}}).total_tokens() == 7
    assert Outcome("a", 200, None, {"usage": {"input_tokens": 3, "output_tokens": 4}}).total_tokens() == 7
    assert Outcome("a", 404, None, {"error": {}}).total_tokens() == 0


def test_retry_after_is_the_gateways_when_it_sends_one() -> None:
    assert retry_delay_s("3", 1.0) == 3.0
    assert retry_delay_s("0", 1.0) == MIN_RETRY_DELAY_S  # a retry always spends some of the budget
    assert retry_delay_s(None, 2.0) == 2.0
    assert retry_delay_s("Wed, 21 Oct 2026 07:28:00 GMT", 4.0) == 4.0  # a date: the backoff


class _Gateway:
    """A real HTTP server that answers 503 (Retry-After: 0) to each request's first tries."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.seen: dict[str, int] = {}

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        tries = self.seen[body["input"]] = self.seen.get(body["input"], 0) + 1
        if tries <= self.refusals:
            return web.json_response({"error": {"message": "placing"}}, status=503, headers={"Retry-After": "0"})
        return web.json_response({"echo": body["input"], "usage": {"total_tokens": 2}},
                                 headers={"X-Request-Id": f"req-{body['input']}"})


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[_Gateway, str]]:
    handler = _Gateway(refusals=2)
    async with serving({"/v1/embeddings": handler.handle}) as url:
        yield handler, url


async def test_refused_requests_are_asked_again_and_written_in_order(gateway: tuple[_Gateway, str]) -> None:
    handler, url = gateway
    batch = [BatchLine(f"id-{n}", "POST", "/v1/embeddings", {"model": "m", "input": str(n)}) for n in range(5)]
    out, progress = io.StringIO(), io.StringIO()
    summary = await run(batch, out, base_url=url, api_key="", concurrency=2, max_retry_wait_s=10.0, timeout_s=10.0,
                        progress=progress)
    records = [json.loads(text) for text in out.getvalue().splitlines()]
    assert [record["custom_id"] for record in records] == [f"id-{n}" for n in range(5)]
    assert [record["response"]["body"]["echo"] for record in records] == [str(n) for n in range(5)]
    assert records[3]["response"]["request_id"] == "req-3"
    assert handler.seen == {str(n): 3 for n in range(5)}  # two 503s, then the answer
    assert summary.statuses == {"200": 5} and summary.total_tokens == 10
    assert "5 done (5 × 200), 10 tokens" in progress.getvalue() and "10 retries" in progress.getvalue()


async def test_a_refusal_past_the_retry_budget_is_written_as_it_came(gateway: tuple[_Gateway, str]) -> None:
    handler, url = gateway
    handler.refusals = 100
    async with aiohttp.ClientSession() as session:
        sender = Sender(session, url, {}, max_retry_wait_s=0.0, timeout_s=10.0)
        outcome = await sender.send(BatchLine("x", "POST", "/v1/embeddings", {"input": "x"}))
    assert (outcome.status_code, outcome.body) == (503, {"error": {"message": "placing"}})
    assert not outcome.answered  # it counts as unanswered: the exit status says so, --resume sends it again


def _closed_port() -> int:
    """A port nothing listens on (connections are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_an_unreachable_gateway_is_an_error_line_after_the_budget() -> None:
    async with aiohttp.ClientSession() as session:
        sender = Sender(session, f"http://127.0.0.1:{_closed_port()}", {}, max_retry_wait_s=1.5, timeout_s=5.0)
        outcome = await sender.send(BatchLine("x", "POST", "/v1/embeddings", {"input": "x"}))
    assert outcome.status_code is None and outcome.error is not None
    assert outcome.error["code"] == "unreachable" and "ClientConnectorError" in outcome.error["message"]
    assert sender.retries == 1  # waited 1 s, then the next wait (2 s) would pass the budget
    summary = Summary()
    summary.count(outcome)
    assert summary.unanswered == 1 and summary.statuses == {"unreachable": 1}
    assert json.loads(json.dumps(outcome.record()))["response"] is None


async def test_an_attempt_that_runs_out_its_time_is_not_repeated() -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)
        return web.json_response({})

    async with serving({"/v1/embeddings": slow}) as url, aiohttp.ClientSession() as session:
        sender = Sender(session, url, {}, max_retry_wait_s=60.0, timeout_s=0.2)
        outcome = await sender.send(BatchLine("x", "POST", "/v1/embeddings", {"input": "x"}))
    assert outcome.error is not None and outcome.error["code"] == "timeout" and sender.retries == 0


async def test_a_reply_cut_off_midway_is_asked_again() -> None:
    """A gateway that dies while it writes an answer: the client sees a torn body (not a
    connection refused), and the request is sent again, not the whole batch lost."""
    attempts = 0

    async def torn_once(request: web.Request) -> web.StreamResponse:
        nonlocal attempts
        attempts += 1
        if attempts > 1:
            return web.json_response({"ok": True})
        response = web.StreamResponse(headers={"Content-Length": "100", "Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"o')
        assert request.transport is not None
        request.transport.close()
        return response

    async with serving({"/v1/embeddings": torn_once}) as url, aiohttp.ClientSession() as session:
        sender = Sender(session, url, {}, max_retry_wait_s=10.0, timeout_s=5.0)
        outcome = await sender.send(BatchLine("x", "POST", "/v1/embeddings", {"input": "x"}))
    assert (outcome.status_code, outcome.body, attempts, sender.retries) == (200, {"ok": True}, 2, 1)
