"""A worker whose engine dies of a CUDA error hands its requests back and stops taking more;
another replica runs them as their next attempt. Real nats-server, real models and engines;
the CUDA error is injected where a real one surfaces (the forward pass), there being no GPU."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from shoal.services.worker.engine.paged_engine import EngineConfig, PagedEngine
from shoal.services.worker.hf_engine import HFGenerateEngine
from shoal.services.worker.loader import load_model
from shoal.services.worker.prompts import eos_token_ids
from shoal.services.worker.service import WorkerIdentity, WorkerService
from shoal.shared.bus import Bus
from shoal.shared.messages import FinalReply, ModelSpec, ReplicaRecord, TokenChunk
from tests.integration.test_worker_serving import MODEL, _collect, _publish, _request

CPU = torch.device("cpu")


def _service(bus: Bus, loaded: Any, engine: Any, replica_id: str) -> WorkerService:
    return WorkerService(bus, engine, loaded.tokenizer, WorkerIdentity(MODEL, replica_id, "n1"),
                         eos_token_ids=eos_token_ids(loaded.tokenizer, loaded.model),
                         max_model_len=loaded.max_model_len)


async def test_requests_of_a_worker_killed_by_a_device_assert_run_again_elsewhere(
    bus: Bus, demo_models_root: Path
) -> None:
    spec = ModelSpec(key=MODEL, path=MODEL)
    doomed_loaded = load_model(demo_models_root, spec, ReplicaRecord(replica_id="r1", model=MODEL, node_id="n1",
                                                                     gpu_bytes={0: 1 << 30}), device=CPU,
                               attn_implementation=None)
    engine = PagedEngine(doomed_loaded.model, doomed_loaded.tokenizer, config=EngineConfig(num_blocks=64))
    execute, num_passes = engine._runner.execute, 0

    def fails_on_the_third_pass(step: Any) -> torch.Tensor:
        nonlocal num_passes
        num_passes += 1
        if num_passes == 3:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return execute(step)

    engine._runner.execute = fails_on_the_third_pass  # type: ignore[method-assign]
    doomed = _service(bus, doomed_loaded, engine, "r1")
    doomed_run = asyncio.create_task(doomed.run())

    request = _request("survivor", max_tokens=8)
    collector = asyncio.create_task(_collect(bus, request.reply_to))
    await asyncio.sleep(0.2)
    await _publish(bus, request)
    await asyncio.wait_for(doomed.failed.wait(), 60)
    assert doomed.failure is not None and "device-side assert triggered" in str(doomed.failure)
    assert doomed.num_requests_by_outcome["handed_back"] == 1
    assert not doomed.is_serving or not doomed._serving.is_set(), "the dead worker takes nothing more"

    healthy_loaded = load_model(demo_models_root, spec, ReplicaRecord(replica_id="r2", model=MODEL, node_id="n1",
                                                                      gpu_bytes={0: 1 << 30}), device=CPU)
    healthy = _service(bus, healthy_loaded,
                       HFGenerateEngine(healthy_loaded.model, healthy_loaded.tokenizer, healthy_loaded.max_model_len),
                       "r2")
    healthy_run = asyncio.create_task(healthy.run())
    replies = await collector
    final = replies[-1]
    assert isinstance(final, FinalReply), replies
    assert final.attempt == 2 and final.replica_id == "r2" and final.completion_tokens == 8
    first_attempt = [r for r in replies if isinstance(r, TokenChunk) and r.attempt == 1]
    assert all(r.replica_id == "r1" for r in first_attempt)
    assert healthy.num_requests_by_outcome["ok"] == 1

    for service, task in ((healthy, healthy_run), (doomed, doomed_run)):
        await service.stop(drain_timeout_s=5.0)
        await task
    await engine.close()
