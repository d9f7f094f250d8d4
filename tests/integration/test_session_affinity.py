"""Session affinity on a real nats-server with real workers (the paged engine with its session
cache on llama-5m): turns on a replica's own subject, a paused replica moving them, a stopping
one deleting its consumer, a gateway moving a turn stranded on a replica that went away, and
the sessions endpoints each replica serves."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats.js.errors
import pytest
import torch
from nats.micro import add_service
from nats.micro.service import Service

from shoal.cli.inspection import inspect, status
from shoal.services.gateway.session_routes import SessionRoutes
from shoal.services.worker.engine.factory import build_paged_engine
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.loader import load_model
from shoal.services.worker.prompts import eos_token_ids
from shoal.services.worker.service import WorkerIdentity, WorkerService
from shoal.services.worker.sessions_api import add_session_endpoints
from shoal.shared import subjects
from shoal.shared.bus import MOVED_ATTEMPT_OFFSET, Bus, ensure_replica_consumer
from shoal.shared.kv_cache.cost_model import CostModel
from shoal.shared.kv_cache.session_settings import SessionSettings
from shoal.shared.messages import (
    DropSession,
    FinalReply,
    InferenceRequest,
    ListSessions,
    ModelSpec,
    ReplicaRecord,
    SamplingParams,
    SessionRoute,
    TokenChunk,
    drop_session_reply_decoder,
    encode_json,
    encode_msgpack,
    session_list_decoder,
)
from shoal.shared.micro import request_json
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.integration.gateway_harness import call, gateway_running, metric_value
from tests.integration.test_worker_serving import _collect

MODEL = "demo/llama-5m"
SESSIONS = SessionSettings(cost_model=CostModel(seconds_per_token=1e-4, seconds_per_token_pair=1e-6))
KV_CACHE_TOKENS = 2048
PROMPT = "The lighthouse keeper walked down to the harbour before dawn and counted the boats. " * 3


class Replicas:
    """Workers of MODEL on the test's bus, each a real paged engine with a session cache."""

    def __init__(self, bus: Bus, models_root: Path) -> None:
        self.bus = bus
        self.models_root = models_root
        self.services: dict[str, WorkerService] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.micro: dict[str, Service] = {}

    def add(self, replica_id: str) -> WorkerService:
        spec = ModelSpec(key=MODEL, path=MODEL)
        replica = ReplicaRecord(replica_id=replica_id, model=MODEL, node_id="n1", gpu_bytes={0: 1 << 30})
        loaded = load_model(self.models_root, spec, replica, device=torch.device("cpu"))
        engine = build_paged_engine(loaded, kv_cache_tokens=KV_CACHE_TOKENS, sessions=SESSIONS)
        identity = WorkerIdentity(MODEL, replica_id, "n1")
        service = WorkerService(self.bus, engine, loaded.tokenizer, identity,
                                eos_token_ids=eos_token_ids(loaded.tokenizer, loaded.model),
                                max_model_len=loaded.max_model_len)
        self.services[replica_id] = service
        self.tasks[replica_id] = asyncio.create_task(service.run())
        return service

    async def serve_sessions(self, replica_id: str) -> None:
        """The replica's sessions endpoints, on a micro service of its own (as a worker has)."""
        service = self.services[replica_id]
        micro = await add_service(self.bus.nc, name="shoal-worker", version="0.0.0")
        await add_session_endpoints(micro, WorkerIdentity(MODEL, replica_id, "n1"), lambda: service.engine)
        self.micro[replica_id] = micro

    async def stop(self, replica_id: str) -> None:
        if replica_id in self.micro:
            await self.micro.pop(replica_id).stop()
        await self.services[replica_id].stop(drain_timeout_s=5.0)
        await self.tasks.pop(replica_id)
        await self.services.pop(replica_id).engine.close()


@pytest.fixture
async def replicas(bus: Bus, demo_models_root: Path) -> AsyncIterator[Replicas]:
    workers = Replicas(bus, demo_models_root)
    try:
        yield workers
    finally:
        for replica_id in list(workers.services):
            await workers.stop(replica_id)


def _request(request_id: str, session_id: str | None = "s1", prompt: str = PROMPT) -> InferenceRequest:
    return InferenceRequest(request_id=request_id, model=MODEL, deadline=time.time() + 60,
                            params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                            reply_to=subjects.reply_subject("test", request_id), gateway_id="test", prompt=prompt,
                            session_id=session_id)


async def _run(bus: Bus, request: InferenceRequest, subject: str) -> list[TokenChunk | FinalReply]:
    collector = asyncio.create_task(_collect(bus, request.reply_to))
    await asyncio.sleep(0.05)
    await bus.js.publish(subject, encode_msgpack(request), headers={subjects.HDR_REPLY_TO: request.reply_to,
                                                                    subjects.HDR_MSG_ID: request.request_id})
    replies = await collector
    assert isinstance(replies[-1], FinalReply), replies[-1]
    return replies  # type: ignore[return-value]


def _sessions_stats(service: WorkerService):  # type: ignore[no-untyped-def]
    engine = service.engine
    assert isinstance(engine, PagedEngine)
    stats = engine.get_stats().sessions
    assert stats is not None
    return stats


async def test_a_turn_sent_to_a_replica_is_served_there_and_its_kv_reused(bus: Bus, replicas: Replicas) -> None:
    r1 = replicas.add("r1")
    await asyncio.sleep(0.3)
    own = subjects.replica_infer_subject(MODEL, "r1")
    first = await _run(bus, _request("t1"), own)
    assert {r.replica_id for r in first} == {"r1"} and {r.attempt for r in first} == {1}
    second = await _run(bus, _request("t2", prompt=PROMPT + "And then?"), own)
    assert second[-1].replica_id == "r1"
    stats = _sessions_stats(r1)
    assert (stats.num_hits, stats.num_misses) == (1, 1) and stats.num_gpu_reused_tokens >= 16
    info = await bus.js.consumer_info(subjects.REQUESTS_STREAM, subjects.replica_consumer_name("r1"))
    assert info.num_pending == 0 and info.num_ack_pending == 0, "turns are acked after their final reply"


async def test_a_paused_replica_moves_the_turns_sent_to_it_to_the_shared_queue(bus: Bus, replicas: Replicas) -> None:
    r1 = replicas.add("r1")
    replicas.add("r2")
    await asyncio.sleep(0.3)
    drained = asyncio.create_task(r1.pause(drain_timeout_s=1.0))  # the barrier before a park
    await drained
    replies = await _run(bus, _request("moved"), subjects.replica_infer_subject(MODEL, "r1"))
    assert {r.replica_id for r in replies} == {"r2"}
    # Numbered after r1's attempts (r1, paused, may have fetched it from the shared queue once
    # and handed it back: one more delivery).
    assert min(r.attempt for r in replies) > MOVED_ATTEMPT_OFFSET
    assert _sessions_stats(replicas.services["r2"]).num_misses == 1
    r1.resume(r1.engine)
    replies = await _run(bus, _request("back"), subjects.replica_infer_subject(MODEL, "r1"))
    assert {r.replica_id for r in replies} == {"r1"}, "serving again, it takes its own turns"


async def test_a_stopping_replica_deletes_its_consumer(bus: Bus, replicas: Replicas) -> None:
    replicas.add("r1")
    await asyncio.sleep(0.3)
    name = subjects.replica_consumer_name("r1")
    await bus.js.consumer_info(subjects.REQUESTS_STREAM, name)
    await replicas.stop("r1")
    with pytest.raises(nats.js.errors.NotFoundError):
        await bus.js.consumer_info(subjects.REQUESTS_STREAM, name)


async def test_each_replica_lists_and_drops_its_sessions(bus: Bus, replicas: Replicas) -> None:
    replicas.add("r1")
    await replicas.serve_sessions("r1")
    await asyncio.sleep(0.3)
    await _run(bus, _request("a", session_id="kept"), subjects.infer_subject(MODEL))
    listed = await request_json(bus.nc, subjects.worker_subject("r1", "sessions"), ListSessions(),
                                session_list_decoder)
    assert listed.enabled and [s.session_id for s in listed.sessions] == ["kept"]
    (kept,) = listed.sessions
    assert kept.num_tokens % 16 == 0 and kept.num_tokens >= 16 and kept.gpu_bytes > 0 and not kept.active
    assert listed.stats is not None and listed.stats.num_sessions == 1
    dropped = await request_json(bus.nc, subjects.worker_subject("r1", "drop_session"), DropSession("kept"),
                                 drop_session_reply_decoder)
    assert dropped.dropped and not dropped.active
    again = await request_json(bus.nc, subjects.worker_subject("r1", "drop_session"), DropSession("kept"),
                               drop_session_reply_decoder)
    assert not again.dropped
    listed = await request_json(bus.nc, subjects.worker_subject("r1", "sessions"), ListSessions(),
                                session_list_decoder)
    assert listed.sessions == []


async def test_the_gateway_moves_a_turn_stranded_on_a_replica_that_went_away(
        bus: Bus, replicas: Replicas, nats_server: EmbeddedNatsServer) -> None:
    """r1 holds the session by its route, and its record says it serves, but no worker runs it:
    the turn waits on r1's subject until r1's record goes, then the gateway moves it and r2,
    serving the shared queue, answers."""
    await bus.models.put(subjects.model_token(MODEL), ModelSpec(key=MODEL, path=MODEL, desired_replicas=2))
    for replica_id in ("r1", "r2"):
        await bus.replicas.put(subjects.replica_kv_key(MODEL, replica_id),
                               ReplicaRecord(replica_id=replica_id, model=MODEL, node_id="n1", state="ready"))
    await ensure_replica_consumer(bus.js, MODEL, "r1")
    replicas.add("r2")
    await replicas.serve_sessions("r2")
    async with gateway_running(nats_server.url) as base_url:
        routes = await bus.js.key_value(subjects.SESSIONS_BUCKET)
        await routes.put(subjects.session_route_key(MODEL, "s1"), encode_json(SessionRoute(replica_id="r1")))
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "session_id": "s1"}
        answering = asyncio.create_task(call("POST", base_url + "/v1/completions", json=body))
        await asyncio.sleep(2.0)
        assert not answering.done(), "r1 never answers: the turn waits on its subject"
        info = await bus.js.consumer_info(subjects.REQUESTS_STREAM, subjects.replica_consumer_name("r1"))
        assert info.num_pending == 1
        await bus.replicas.delete(subjects.replica_kv_key(MODEL, "r1"))
        status, payload, headers = await asyncio.wait_for(answering, 30.0)
        assert status == 200, payload
        assert headers["X-Shoal-Replica"] == "r2" and payload["usage"]["completion_tokens"] == 4
        assert await metric_value(base_url, f'shoal_gateway_requests_moved_total{{model="{MODEL}"}}') == 1
        assert await metric_value(
            base_url, f'shoal_gateway_session_turns_total{{model="{MODEL}",route="affinity"}}') == 1
        # The final reply named r2: the session's route follows it.
        entry = await routes.get(subjects.session_route_key(MODEL, "s1"))
        assert b'"r2"' in entry.value

        status, listed, _ = await call("GET", base_url + "/admin/sessions")
        assert status == 200, listed
        assert [(s["session_id"], s["replica_id"], s["routed"]) for s in listed["sessions"]] == [("s1", "r2", True)]
        assert listed["unreachable"] == [], "r1's record is gone: nobody asks it"
        await bus.replicas.put(subjects.replica_kv_key(MODEL, "r3"),
                               ReplicaRecord(replica_id="r3", model=MODEL, node_id="n1", state="ready"))
        await asyncio.sleep(0.3)
        status, listed, _ = await call("GET", base_url + "/admin/sessions")
        assert [u["replica_id"] for u in listed["unreachable"]] == ["r3"], "a replica that does not answer is named"


async def test_shoal_status_and_inspect_show_sessions(bus: Bus, replicas: Replicas) -> None:
    replicas.add("r1")
    await replicas.serve_sessions("r1")
    await bus.replicas.put(subjects.replica_kv_key(MODEL, "r1"),
                           ReplicaRecord(replica_id="r1", model=MODEL, node_id="n1", state="ready"))
    await bus.replicas.put(subjects.replica_kv_key(MODEL, "r9"),  # a record whose worker never answers
                           ReplicaRecord(replica_id="r9", model=MODEL, node_id="n1", state="ready"))
    await asyncio.sleep(0.3)
    await _run(bus, _request("a", session_id="shown"), subjects.infer_subject(MODEL))
    await _run(bus, _request("b", session_id="shown", prompt=PROMPT + "More."), subjects.infer_subject(MODEL))
    out = io.StringIO()
    await status(bus, out)
    text = out.getvalue()
    assert "Sessions (the session cache of each serving replica):" in text
    (line,) = [line for line in text.splitlines() if f"{MODEL} r1 " in line and "cached" in line]
    assert "1 cached" in line and "turns 1 hit / 1 miss (50%)" in line, line
    assert "returning-turn tokens:" in text and "r9" in text and "unavailable: nothing serves" in text

    routes = SessionRoutes(bus.js, ttl_s=60.0)
    await routes.start()
    await routes.put(MODEL, "shown", "r1")
    out = io.StringIO()
    await inspect(bus, out)
    assert 'KV bucket shoal_sessions' in out.getvalue() and '"replica_id":"r1"' in out.getvalue()
