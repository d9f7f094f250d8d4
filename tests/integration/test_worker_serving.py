"""A real worker (real model, real engine) against a real nats-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats.errors
import pytest
import torch

from shoal.services.worker.hf_engine import HFGenerateEngine
from shoal.services.worker.loader import load_model
from shoal.services.worker.prompts import eos_token_ids
from shoal.services.worker.service import WorkerIdentity, WorkerService
from shoal.shared import subjects
from shoal.shared.bus import Bus, ensure_model_consumer
from shoal.shared.messages import (
    CancelRequest,
    ErrorReply,
    FinalReply,
    InferenceRequest,
    ModelSpec,
    ReplicaRecord,
    Reply,
    SamplingParams,
    TokenChunk,
    encode_msgpack,
    reply_decoder,
)

MODEL = "demo/llama-5m"


@pytest.fixture
async def worker(bus: Bus, demo_models_root: Path) -> AsyncIterator[WorkerService]:
    spec = ModelSpec(key=MODEL, path=MODEL)
    replica = ReplicaRecord(replica_id="r1", model=MODEL, node_id="n1", gpu_bytes={0: 1 << 30})
    loaded = load_model(demo_models_root, spec, replica, device=torch.device("cpu"))
    engine = HFGenerateEngine(loaded.model, loaded.tokenizer, loaded.max_model_len)
    service = WorkerService(bus, engine, loaded.tokenizer, WorkerIdentity(MODEL, "r1", "n1"),
                            eos_token_ids=eos_token_ids(loaded.tokenizer, loaded.model),
                            max_model_len=loaded.max_model_len)
    yield service
    await service.stop(drain_timeout_s=5.0)


async def _publish(bus: Bus, request: InferenceRequest) -> None:
    await bus.js.publish(subjects.infer_subject(request.model), encode_msgpack(request),
                         headers={subjects.HDR_REPLY_TO: request.reply_to})


def _request(request_id: str, *, max_tokens: int = 5, deadline_s: float = 60.0, **kwargs) -> InferenceRequest:  # type: ignore[no-untyped-def]
    return InferenceRequest(
        request_id=request_id,
        model=MODEL,
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        deadline=time.time() + deadline_s,
        reply_to=subjects.reply_subject("test", request_id),
        gateway_id="test",
        prompt=kwargs.pop("prompt", "Once upon a time"),
        **kwargs,
    )


async def _collect(bus: Bus, subject: str, *, until_final: bool = True, timeout: float = 60.0) -> list[Reply]:
    replies: list[Reply] = []
    done = asyncio.Event()

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        reply = reply_decoder.decode(msg.data)
        replies.append(reply)
        if isinstance(reply, FinalReply | ErrorReply):
            if msg.reply:  # confirmed, as a gateway does (the worker resends an unconfirmed final reply)
                await msg.respond(b"")
            done.set()

    sub = await bus.nc.subscribe(subject, cb=on_msg)
    try:
        if until_final:
            await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return replies


async def test_request_published_before_any_worker_is_served_once_one_starts(bus: Bus, worker: WorkerService) -> None:
    await ensure_model_consumer(bus.js, MODEL)
    request = _request("early")
    collector = asyncio.create_task(_collect(bus, request.reply_to))
    await asyncio.sleep(0.05)
    await _publish(bus, request)
    await asyncio.sleep(0.5)  # nothing serves the model yet: the request waits in the stream
    assert not collector.done()
    info = await bus.js.consumer_info(subjects.REQUESTS_STREAM, subjects.consumer_name(MODEL))
    assert info.num_pending == 1

    serving = asyncio.create_task(worker.run())
    replies = await collector
    chunks = [r for r in replies if isinstance(r, TokenChunk)]
    final = replies[-1]
    assert isinstance(final, FinalReply)
    assert final.completion_tokens == 5 and final.finish_reason == "length"
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert final.seq == len(chunks) and {c.attempt for c in chunks} == {1}
    await asyncio.sleep(0.2)
    info = await bus.js.consumer_info(subjects.REQUESTS_STREAM, subjects.consumer_name(MODEL))
    assert info.num_pending == 0 and info.num_ack_pending == 0, "the request must be acked after its final reply"
    await worker.stop(drain_timeout_s=5.0)
    await serving


async def test_expired_and_malformed_requests_are_termed_not_run(bus: Bus, worker: WorkerService) -> None:
    serving = asyncio.create_task(worker.run())
    await asyncio.sleep(0.2)
    await bus.js.publish(subjects.infer_subject(MODEL), b"\x93garbage")
    expired = _request("late", deadline_s=-1.0)
    collector = asyncio.create_task(_collect(bus, expired.reply_to))
    await asyncio.sleep(0.05)
    await _publish(bus, expired)
    replies = await collector
    assert isinstance(replies[-1], ErrorReply) and replies[-1].status == 504
    # The worker survived both and still serves.
    ok = _request("after")
    collector = asyncio.create_task(_collect(bus, ok.reply_to))
    await asyncio.sleep(0.05)
    await _publish(bus, ok)
    assert isinstance((await collector)[-1], FinalReply)
    await worker.stop(drain_timeout_s=5.0)
    await serving


async def test_cancel_stops_a_running_request(bus: Bus, worker: WorkerService) -> None:
    serving = asyncio.create_task(worker.run())
    await asyncio.sleep(0.2)
    long = _request("long", max_tokens=2000)
    replies: list[Reply] = []
    first_chunk = asyncio.Event()

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        replies.append(reply_decoder.decode(msg.data))
        first_chunk.set()

    sub = await bus.nc.subscribe(long.reply_to, cb=on_msg)
    await _publish(bus, long)
    await asyncio.wait_for(first_chunk.wait(), 30)
    await bus.nc.publish(subjects.cancel_subject(MODEL), encode_msgpack(CancelRequest("long")))
    for _ in range(100):
        if worker.num_in_flight == 0:
            break
        await asyncio.sleep(0.05)
    assert worker.num_in_flight == 0, "a cancelled request must stop generating"
    await sub.unsubscribe()
    assert not any(isinstance(r, FinalReply) for r in replies)
    assert sum(1 for r in replies if isinstance(r, TokenChunk)) < 2000
    await worker.stop(drain_timeout_s=5.0)
    await serving


async def test_prompt_longer_than_the_model_gets_400_context_length_exceeded(bus: Bus, worker: WorkerService) -> None:
    serving = asyncio.create_task(worker.run())
    request = _request("huge", prompt_token_ids=[5] * 5000, prompt=None)
    collector = asyncio.create_task(_collect(bus, request.reply_to))
    await asyncio.sleep(0.05)
    await _publish(bus, request)
    replies = await collector
    assert isinstance(replies[-1], ErrorReply) and (replies[-1].status, replies[-1].code) == (
        400, "context_length_exceeded")
    await worker.stop(drain_timeout_s=5.0)
    await serving


async def test_penalties_the_hf_engine_cannot_apply_get_400_naming_the_field(
    bus: Bus, worker: WorkerService
) -> None:
    serving = asyncio.create_task(worker.run())
    request = _request("penalized")
    request.params = SamplingParams(max_tokens=3, temperature=0.0, presence_penalty=0.5)
    collector = asyncio.create_task(_collect(bus, request.reply_to))
    await asyncio.sleep(0.05)
    await _publish(bus, request)
    replies = await collector
    assert isinstance(replies[-1], ErrorReply)
    assert (replies[-1].status, replies[-1].param) == (400, "presence_penalty")
    await worker.stop(drain_timeout_s=5.0)
    await serving


async def test_a_forged_reply_subject_gets_no_reply_and_the_request_is_dropped(bus: Bus, worker: WorkerService
                                                                                ) -> None:
    """A request whose reply subject is not its gateway's inbox (here: a KV key of shoal_gpus)
    is termed: the worker publishes nothing there, and serves the next request as usual."""
    serving = asyncio.create_task(worker.run())
    forged = msgspec.structs.replace(_request("forged"), reply_to="$KV.shoal_gpus.node-a.0")
    before = await bus.gpus.get("node-a.0")
    watched = await bus.nc.subscribe("$KV.shoal_gpus.>")
    await bus.js.publish(subjects.infer_subject(MODEL), encode_msgpack(forged),
                         headers={subjects.HDR_REPLY_TO: forged.reply_to})
    honest = _request("honest")
    collector = asyncio.create_task(_collect(bus, honest.reply_to))
    await asyncio.sleep(0.05)
    await _publish(bus, honest)
    assert isinstance((await collector)[-1], FinalReply)
    with pytest.raises(nats.errors.TimeoutError):
        await watched.next_msg(timeout=0.5)
    assert await bus.gpus.get("node-a.0") == before is None
    assert worker.num_requests_by_outcome["ok"] == 1
    info = await bus.js.consumer_info(subjects.REQUESTS_STREAM, subjects.consumer_name(MODEL))
    assert info.num_pending == 0 and info.num_ack_pending == 0, "the forged request was termed, not redelivered"
    await worker.stop(drain_timeout_s=5.0)
    await serving


async def test_tokenising_a_huge_prompt_does_not_stall_the_other_requests(bus: Bus, worker: WorkerService) -> None:
    """A 4 MiB prompt takes seconds to tokenise; it runs off the event loop, so a small request
    published after it is answered first, and the huge one gets its 4xx (longer than the model)."""
    serving = asyncio.create_task(worker.run())
    await _publish(bus, _request("warm"))  # the first request of a process pays one-off costs
    huge = _request("huge", prompt="All work and no play makes Jack a dull boy. " * (4 * 2**20 // 44))
    small = _request("small")
    arrivals: list[str] = []
    collectors = [asyncio.create_task(_collect(bus, r.reply_to, timeout=300.0)) for r in (huge, small)]
    for name, collector in (("huge", collectors[0]), ("small", collectors[1])):
        collector.add_done_callback(lambda _, name=name: arrivals.append(name))
    await asyncio.sleep(0.05)
    await _publish(bus, huge)
    await asyncio.sleep(0.3)  # the huge one is being tokenised
    await _publish(bus, small)
    huge_replies, small_replies = await asyncio.gather(*collectors)
    assert isinstance(small_replies[-1], FinalReply)
    error = huge_replies[-1]
    assert isinstance(error, ErrorReply) and error.status in (400, 413), error
    assert arrivals == ["small", "huge"], "the small request waited for the huge one's tokenisation"
    await worker.stop(drain_timeout_s=5.0)
    await serving
