"""A client that goes away mid-request, or a deadline that passes mid-stream, gets the
request cancelled at the worker.

Real parts throughout: the gateway on a real socket, a real worker (real model, real
engine) on a real nats-server, the test listening on the bus with its own NATS client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import torch
from nats.aio.msg import Msg

from shoal.services.worker.hf_engine import HFGenerateEngine
from shoal.services.worker.loader import load_model
from shoal.services.worker.prompts import eos_token_ids
from shoal.services.worker.service import WorkerIdentity, WorkerService
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import ModelSpec, ReplicaRecord, TokenChunk, cancel_decoder, reply_decoder
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.integration.gateway_harness import gateway_running, metric_value

MODEL = "demo/llama-5m"
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


class Served:
    """A gateway and one ready replica of MODEL, with what the test observes on the bus."""

    def __init__(self, url: str, worker: WorkerService) -> None:
        self.url = url
        self.worker = worker
        self.cancelled_ids: list[str] = []
        self.generating_ids: set[str] = set()
        """Requests some replica has sent a token for."""
        self.first_token = asyncio.Event()

    def num_cancelled_at_worker(self) -> float:
        return self.worker.num_requests_by_outcome["cancelled"]

    async def on_cancel(self, msg: Msg) -> None:
        self.cancelled_ids.append(cancel_decoder.decode(msg.data).request_id)

    async def on_reply(self, msg: Msg) -> None:
        reply = reply_decoder.decode(msg.data)
        if isinstance(reply, TokenChunk):
            self.generating_ids.add(reply.request_id)
            self.first_token.set()

    async def wait_until_cancelled(self, *request_ids: str) -> None:
        """Until the gateway has published the cancels and the worker has stopped generating."""
        for _ in range(600):
            if set(request_ids) <= set(self.cancelled_ids) and self.num_cancelled_at_worker() >= 1 \
                    and self.worker.num_in_flight == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"not cancelled: cancels seen {self.cancelled_ids}, worker "
                             f"cancelled {self.num_cancelled_at_worker()}, in flight {self.worker.num_in_flight}")


@pytest.fixture
async def served(bus: Bus, nats_server: EmbeddedNatsServer, demo_models_root: Path) -> AsyncIterator[Served]:
    spec = ModelSpec(key=MODEL, path=MODEL, registered_at=1.0)
    replica = ReplicaRecord(replica_id="r1", model=MODEL, node_id="n1", gpu_bytes={0: 1 << 30}, state="ready")
    await bus.models.put(subjects.model_token(MODEL), spec)
    await bus.replicas.put(subjects.replica_kv_key(MODEL, "r1"), replica)  # ready: no scheduler is asked
    loaded = load_model(demo_models_root, spec, replica, device=torch.device("cpu"))
    worker = WorkerService(bus, HFGenerateEngine(loaded.model, loaded.tokenizer, loaded.max_model_len),
                           loaded.tokenizer, WorkerIdentity(MODEL, "r1", "n1"),
                           eos_token_ids=eos_token_ids(loaded.tokenizer, loaded.model),
                           max_model_len=loaded.max_model_len)
    serving = asyncio.create_task(worker.run())
    async with gateway_running(nats_server.url, request_timeout_s=120.0) as url:
        observed = Served(url, worker)
        cancels = await bus.nc.subscribe(subjects.cancel_subject(MODEL), cb=observed.on_cancel)
        replies = await bus.nc.subscribe(f"{subjects.REPLY_PREFIX}.>", cb=observed.on_reply)
        try:
            yield observed
        finally:
            await cancels.unsubscribe()
            await replies.unsubscribe()
    await worker.stop(drain_timeout_s=5.0)
    await serving


async def test_a_client_leaving_a_stream_cancels_its_request_at_the_worker(served: Served) -> None:
    session = aiohttp.ClientSession()
    response = await session.post(served.url + "/v1/completions", json=LONG | {"stream": True})
    assert response.status == 200
    request_id = response.headers["X-Request-Id"]
    first = await asyncio.wait_for(response.content.readline(), 60)
    assert first.startswith(b"data: ")
    response.close()  # mid-stream: the connection goes, not just the response
    await session.close()
    await served.wait_until_cancelled(request_id)
    assert served.cancelled_ids == [request_id]


async def test_a_client_leaving_a_stream_of_several_choices_cancels_each_at_the_worker(served: Served) -> None:
    session = aiohttp.ClientSession()
    response = await session.post(served.url + "/v1/completions", json=LONG | {
        "stream": True, "n": 2, "prompt": ["Once upon a time", "The sea"]})
    assert response.status == 200
    request_id = response.headers["X-Request-Id"]
    first = await asyncio.wait_for(response.content.readline(), 60)
    assert first.startswith(b"data: ")
    response.close()
    await session.close()
    choice_ids = [f"{request_id}-{i}" for i in range(4)]
    await served.wait_until_cancelled(*choice_ids)
    assert sorted(served.cancelled_ids) == choice_ids
    assert served.worker.num_requests_by_outcome.get("ok", 0) == 0, "no choice ran to its end"


async def test_a_client_leaving_before_a_full_response_cancels_its_request_at_the_worker(served: Served) -> None:
    async with aiohttp.ClientSession() as session:
        async def post() -> None:
            async with session.post(served.url + "/v1/completions", json=LONG) as response:
                await response.read()

        waiting = asyncio.create_task(post())
        await asyncio.wait_for(served.first_token.wait(), 60)  # the worker is generating it
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    (request_id,) = served.generating_ids
    await served.wait_until_cancelled(request_id)
    assert served.cancelled_ids == [request_id]


async def test_a_deadline_passing_mid_stream_ends_it_with_a_504_event_counted_as_504(
        served: Served, nats_server: EmbeddedNatsServer) -> None:
    async with aiohttp.ClientSession() as session:
        # Warm the worker up through the patient gateway, so the first token comes at once.
        async with session.post(served.url + "/v1/completions", json=LONG | {"max_tokens": 2}) as response:
            assert response.status == 200
        async with gateway_running(nats_server.url, request_timeout_s=1.5) as hasty:
            async with session.post(hasty + "/v1/completions", json=LONG | {"stream": True}) as response:
                assert response.status == 200  # the first token came within the deadline
                request_id = response.headers["X-Request-Id"]
                events = [line[len(b"data: "):].strip() async for line in response.content
                          if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]"
            error = json.loads(events[-2])["error"]
            assert "deadline" in error["message"]
            assert any(json.loads(event)["choices"][0]["text"] for event in events[:-2])  # tokens came first
            sample = f'shoal_gateway_requests_total{{model="{MODEL}",kind="completion",outcome="504"}}'
            assert await metric_value(hasty, sample) == 1
            ok = f'shoal_gateway_requests_total{{model="{MODEL}",kind="completion",outcome="ok"}}'
            assert await metric_value(hasty, ok) is None
    assert request_id in served.cancelled_ids
    outcomes = served.worker.num_requests_by_outcome
    for _ in range(600):  # the worker stops at the deadline too, and counts the request as expired
        if outcomes["expired"] == 1 and served.worker.num_in_flight == 0:
            break
        await asyncio.sleep(0.05)
    assert outcomes["expired"] == 1 and served.worker.num_in_flight == 0


async def test_a_deadline_passing_mid_stream_ends_a_responses_stream_with_response_failed(
        served: Served, nats_server: EmbeddedNatsServer) -> None:
    body = {"model": MODEL, "input": "Once upon a time", "max_output_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(served.url + "/v1/completions", json=LONG | {"max_tokens": 2}) as response:
            assert response.status == 200  # warm
        async with gateway_running(nats_server.url, request_timeout_s=1.5) as hasty:
            async with session.post(hasty + "/v1/responses", json=body) as response:
                assert response.status == 200
                request_id = response.headers["X-Request-Id"]
                events = [json.loads(line[len(b"data: "):]) async for line in response.content
                          if line.startswith(b"data: ")]
            sample = f'shoal_gateway_requests_total{{model="{MODEL}",kind="responses",outcome="504"}}'
            assert await metric_value(hasty, sample) == 1
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert "deadline" in failed["response"]["error"]["message"]
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    (message,) = failed["response"]["output"]
    assert text and message["status"] == "incomplete" and message["content"][0]["text"] == text
    assert request_id in served.cancelled_ids
