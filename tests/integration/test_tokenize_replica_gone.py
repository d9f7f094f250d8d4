"""A replica that goes away between the gateway choosing it and answering (put to sleep while
the gateway's view still says ready) costs a ``/tokenize`` (and Anthropic's
``count_tokens``) nothing: the gateway asks a serving replica again. A soak of unloads under
load found these answered 503 before."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.micro import add_service
from transformers import AutoTokenizer

from shoal.services.worker.service import WorkerIdentity
from shoal.services.worker.tokenize_api import add_tokenize_endpoints
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import ModelSpec, ReplicaRecord
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.integration.gateway_harness import call, gateway_running

MODEL = "demo/llama-5m"


async def test_a_replica_gone_before_it_answers_is_replaced_by_one_that_serves(
        bus: Bus, nats_server: EmbeddedNatsServer, demo_models_root: Path) -> None:
    await bus.models.put(subjects.model_token(MODEL), ModelSpec(key=MODEL, path=MODEL, registered_at=1.0))
    gone = ReplicaRecord(replica_id="gone", model=MODEL, node_id="n1", gpu_bytes={0: 1 << 30}, state="ready")
    await bus.replicas.put(subjects.replica_kv_key(MODEL, "gone"), gone)  # nothing serves its subjects
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / MODEL)
    worker = await add_service(bus.nc, name="shoal-worker", version="0.0.1")
    await add_tokenize_endpoints(worker, WorkerIdentity(MODEL, "serving", "n1"), tokenizer, None, lambda: 2048)

    async def the_view_catches_up() -> None:  # as the scheduler's sleep reaches the KV
        await asyncio.sleep(0.6)
        await bus.replicas.delete(subjects.replica_kv_key(MODEL, "gone"))
        await bus.replicas.put(subjects.replica_kv_key(MODEL, "serving"), ReplicaRecord(
            replica_id="serving", model=MODEL, node_id="n1", gpu_bytes={0: 1 << 30}, state="ready"))

    async with gateway_running(nats_server.url, request_timeout_s=30.0) as url:
        catching_up = asyncio.create_task(the_view_catches_up())
        status, body, _ = await call("POST", url + "/detokenize", json={"model": MODEL, "tokens": [450, 1205]})
        await catching_up
        assert status == 200 and body["prompt"] == tokenizer.decode([450, 1205])
        status, body, _ = await call("POST", url + "/v1/messages/count_tokens", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        assert status == 200 and body["input_tokens"] > 0
    await worker.stop()
