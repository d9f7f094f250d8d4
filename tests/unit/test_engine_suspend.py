"""An engine kept across a sleep (`PagedEngine.suspend` / `resume`): what it held on its device
goes back, it refuses requests while parked, and after the wake it serves exactly as a new
engine would, with nothing cached from before."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from shoal.kernels import cpu_kernels
from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.generation import GenerationRequest, RequestRejected
from shoal.services.worker.loader import load_model
from shoal.shared.messages import ModelSpec, ReplicaRecord, SamplingParams
from tests.token_echo import TokenEcho

pytestmark = pytest.mark.skipif(cpu_kernels.try_load() is None, reason="no native CPU library")

PROMPT = [(7 * i) % 4000 + 5 for i in range(600)]
"""Long enough that its KV (llama-5m: 4 KiB a token) spans many pages of the pool."""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _run(engine: PagedEngine, request_id: str, max_tokens: int = 8) -> tuple[str, str | None]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    text, finish_reason = "", None
    async for output in engine.generate(GenerationRequest(request_id, PROMPT, params)):
        text += output.text
        finish_reason = output.finish_reason or finish_reason
    return text, finish_reason


@pytest.fixture
async def engine(demo_models_root: Path) -> PagedEngine:
    replica = ReplicaRecord(replica_id="r", model="m", node_id="n", gpu_bytes={0: 4 << 30})
    loaded = load_model(demo_models_root, ModelSpec(key="m", path="demo/llama-5m"), replica,
                        device=torch.device("cpu"), native_pack=True)
    engine = PagedEngine(loaded.model, TokenEcho(),
                         config=EngineConfig(num_blocks=1024, block_size=16, warm_up=False))
    yield engine
    await engine.close()


async def test_a_suspended_engine_gives_its_pool_back_and_serves_as_before_after_resume(engine: PagedEngine) -> None:
    assert engine.forward == "native"
    before, _ = await _run(engine, "first")
    assert (await _run(engine, "cached"))[0] == before
    assert engine.get_stats().pool.num_cache_hits > 0, "the second run reused the first's prompt blocks"
    rss = _rss_bytes()

    await engine.suspend()
    kv_bytes_written = 2 * len(PROMPT) * 4096  # two sequences' KV (4 KiB a token), at most
    assert rss - _rss_bytes() > 0.8 * len(PROMPT) * 4096, "the written blocks' pages went back"
    assert rss - _rss_bytes() <= kv_bytes_written + (1 << 20)
    assert engine.suspended
    with pytest.raises(RequestRejected) as rejected:
        await _run(engine, "while-asleep")
    assert rejected.value.status == 503

    engine.resume()
    assert not engine.suspended
    # The prefix cache was forgotten with the pool's contents: a hit now would read zeros and
    # change the answer.
    assert await _run(engine, "after") == (before, "length")
    stats = engine.get_stats().pool
    assert (stats.num_cache_hits, stats.num_used_blocks) == (0, 0)


async def test_a_request_still_running_at_suspend_is_cancelled(engine: PagedEngine) -> None:
    running = asyncio.create_task(_run(engine, "long", max_tokens=1500))
    while engine.get_stats().num_running == 0:
        await asyncio.sleep(0.01)
    await engine.suspend()
    _, finish_reason = await running
    assert finish_reason == "cancelled"
    engine.resume()
    assert (await _run(engine, "next", max_tokens=4))[1] == "length"


async def test_only_a_suspended_engine_resumes(engine: PagedEngine) -> None:
    with pytest.raises(RuntimeError, match="only a suspended engine resumes"):
        engine.resume()
    await engine.suspend()
    await engine.close()
    with pytest.raises(RuntimeError, match="only a suspended engine resumes"):
        engine.resume()
