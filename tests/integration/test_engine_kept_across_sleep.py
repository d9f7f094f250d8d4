"""A worker's park and restore (`ReplicaRuntime.to_cache` / `from_cache`) keep its engine across
the sleep when the wake is onto the allocation the engine was sized for, and build a new one
when it is not; either way the replica answers as before. A real model, a real engine, a real
`WorkerService` on a real nats-server (its serving loop not started: requests go to the engine)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import torch

from shoal.kernels import cpu_kernels
from shoal.services.worker.control import ReplicaRuntime
from shoal.services.worker.engine.attention import register_attention
from shoal.services.worker.engine.factory import build_paged_engine
from shoal.services.worker.generation import Engine, GenerationRequest, RequestRejected
from shoal.services.worker.loader import LoadedModel, load_model
from shoal.services.worker.service import WorkerIdentity, WorkerService
from shoal.shared.bus import Bus
from shoal.shared.config import WorkerConfig
from shoal.shared.messages import ModelSpec, ReplicaRecord, SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels.try_load() is None, reason="no native CPU library")

MODEL = "demo/llama-5m"
REPLICA = ReplicaRecord(replica_id="r1", model=MODEL, node_id="n", gpu_bytes={0: 1 << 30})
WORKER = WorkerConfig(torch_threads=1)


def _build(loaded: LoadedModel) -> tuple[Engine, int]:
    engine = build_paged_engine(loaded, WORKER, warm_up=False)
    return engine, engine.held_bytes


async def _answer(engine: Engine | None, request_id: str) -> str:
    assert engine is not None
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    text = ""
    async for output in engine.generate(GenerationRequest(request_id, [5, 17, 300, 41, 9, 77], params)):
        text += output.text
    return text


@pytest.fixture
async def runtime(bus: Bus, demo_models_root: Path) -> AsyncIterator[ReplicaRuntime]:
    register_attention()
    loaded = load_model(demo_models_root, ModelSpec(key=MODEL, path=MODEL), REPLICA, device=torch.device("cpu"),
                        attn_implementation="shoal_paged", native_pack=True)
    engine, _ = _build(loaded)
    service = WorkerService(bus, engine, loaded.tokenizer, WorkerIdentity(MODEL, REPLICA.replica_id, "n"),
                            eos_token_ids=frozenset(), max_model_len=loaded.max_model_len)
    runtime = ReplicaRuntime(REPLICA, loaded, engine, service, _build, lambda loaded, held: loaded.weight_bytes + held,
                             drain_timeout_s=1.0)
    yield runtime
    for kept in (runtime.engine, runtime.suspended):
        if kept is not None:
            await kept.close()


async def test_a_wake_onto_the_same_allocation_resumes_the_engine_it_parked(runtime: ReplicaRuntime) -> None:
    engine = runtime.engine
    before = await _answer(engine, "before")
    assert (await runtime.to_cache()).ok
    assert runtime.engine is None and runtime.suspended is engine
    with pytest.raises(RequestRejected):
        await _answer(engine, "asleep")

    reply = await runtime.from_cache(REPLICA)
    assert reply.ok and reply.measured_bytes == runtime.loaded.weight_bytes + engine.held_bytes
    assert runtime.engine is engine and runtime.service.engine is engine and runtime.suspended is None
    assert await _answer(runtime.engine, "after") == before


async def test_a_wake_onto_another_allocation_builds_a_new_engine(runtime: ReplicaRuntime) -> None:
    engine = runtime.engine
    before = await _answer(engine, "before")
    assert (await runtime.to_cache(drop=True)).weights_dropped

    moved = msgspec.structs.replace(REPLICA, gpu_bytes={0: 2 << 30})
    assert (await runtime.from_cache(moved)).ok
    assert runtime.engine is not None and runtime.engine is not engine
    assert runtime.service.engine is runtime.engine and runtime.suspended is None
    with pytest.raises(RequestRejected, match="shutting down"):
        await _answer(engine, "old engine")  # the kept one was closed
    assert await _answer(runtime.engine, "after") == before
