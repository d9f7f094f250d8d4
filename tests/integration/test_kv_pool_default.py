"""The default KV budget holds 32 concurrent requests of 2,048 tokens without preemption.

The replica is sized the way a cluster sizes it: the node agent's inspection estimates the
model's memory from its config with the default ``kv_cache_tokens`` (`inspect_model`, as a
node with virtual GPUs runs it), placement reserves that figure (the replica's allocation),
the worker loads the model into it and builds its engine with the worker's factory. Then 32
requests of 1,920 prompt tokens and 128 output tokens (the demo models' whole 2,048-token
context) run at once, and the engine's own counter says whether any was preempted.

The same estimate must hold a bfloat16 model's pool as a CPU worker runs it: the native
packed load keeps bfloat16 only in the products' panels and computes, and caches K/V, in
float32 (estimated at 2 bytes, llama-100m's pool held 52,192 of its 65,536 tokens).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from shoal.services.node_agent.model_files import inspect_model
from shoal.services.worker.engine.attention import ATTN_IMPLEMENTATION, register_attention
from shoal.services.worker.engine.factory import build_paged_engine, get_min_engine_bytes_for
from shoal.services.worker.generation import GenerationRequest
from shoal.services.worker.loader import LoadedModel, load_model
from shoal.shared.config import WorkerConfig
from shoal.shared.messages import InspectModel, ModelFacts, ModelSpec, ReplicaRecord, SamplingParams
from shoal.shared.model_memory import get_model_shape
from shoal.shared.model_settings import DEFAULT_KV_CACHE_TOKENS

NUM_REQUESTS = 32
CONTEXT_TOKENS = 2048
NUM_OUTPUT_TOKENS = 128


def load_as_placed(models_root: Path, spec: ModelSpec, worker: WorkerConfig) -> tuple[ModelFacts, LoadedModel]:
    """The model's estimate from a CPU node's inspection, and the model loaded into an
    allocation of that many bytes as the worker loads it for the paged engine."""
    facts = inspect_model(
        models_root,
        InspectModel(spec.path, spec.dtype, spec.kv_cache_tokens),
        runtime_overhead_bytes=worker.runtime_overhead_bytes,
        on_cpu=True,
    )
    replica = ReplicaRecord(replica_id="r-kv", model=spec.key, node_id="n", gpu_bytes={0: facts.estimated_bytes})
    register_attention()
    device = torch.device("cpu")
    loaded = load_model(
        models_root,
        spec,
        replica,
        device=device,
        attn_implementation=ATTN_IMPLEMENTATION,
        min_kv_reserve_bytes=get_min_engine_bytes_for(device, worker),
        native_pack=True,
    )
    return facts, loaded


async def test_the_default_pool_serves_32_full_context_requests_without_preemption(demo_models_root: Path) -> None:
    spec = ModelSpec(key="demo/llama-5m", path="demo/llama-5m")
    assert spec.kv_cache_tokens == DEFAULT_KV_CACHE_TOKENS == NUM_REQUESTS * CONTEXT_TOKENS
    worker = WorkerConfig()
    facts, loaded = load_as_placed(demo_models_root, spec, worker)
    assert facts.max_model_len == CONTEXT_TOKENS
    engine = build_paged_engine(loaded, worker, kv_cache_tokens=spec.kv_cache_tokens)
    try:
        assert engine.kv_cache_tokens >= NUM_REQUESTS * CONTEXT_TOKENS
        vocab_size = loaded.model.config.vocab_size
        generator = torch.Generator().manual_seed(7)
        prompts = [
            torch.randint(5, vocab_size, (CONTEXT_TOKENS - NUM_OUTPUT_TOKENS,), generator=generator).tolist()
            for _ in range(NUM_REQUESTS)
        ]
        params = SamplingParams(max_tokens=NUM_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)

        async def run(index: int) -> tuple[str | None, int]:
            final = None
            async for output in engine.generate(GenerationRequest(f"full-{index}", prompts[index], params)):
                final = output
            assert final is not None
            return final.finish_reason, final.num_completion_tokens or 0

        results = await asyncio.gather(*(run(index) for index in range(NUM_REQUESTS)))
        assert results == [("length", NUM_OUTPUT_TOKENS)] * NUM_REQUESTS
        stats = engine.get_stats()
        assert stats.num_preemptions == 0
        blocks_per_request = CONTEXT_TOKENS // 16
        assert stats.pool.num_allocations == NUM_REQUESTS * blocks_per_request
        # they ran together: at the peak, nearly every request held nearly all its blocks
        assert stats.pool.num_peak_used_blocks > NUM_REQUESTS * (blocks_per_request - 8)
    finally:
        await engine.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/qwen2-25m", "demo/llama-100m"])
async def test_the_estimate_holds_the_default_pool_as_a_cpu_worker_loads_the_model(
    demo_models_root: Path, key: str, dtype: str
) -> None:
    spec = ModelSpec(key=key, path=key, dtype=dtype)
    worker = WorkerConfig()
    _, loaded = load_as_placed(demo_models_root, spec, worker)
    assert loaded.dtype == torch.float32  # bfloat16 weights included: panels, computed in float32
    estimated_weights = get_model_shape(loaded.model.config, dtype, on_cpu=True).weight_bytes
    assert abs(loaded.weight_bytes - estimated_weights) < 4096  # the rotary tables (buffers)
    engine = build_paged_engine(loaded, worker, kv_cache_tokens=spec.kv_cache_tokens)
    try:
        assert engine.kv_cache_tokens == spec.kv_cache_tokens == DEFAULT_KV_CACHE_TOKENS
    finally:
        await engine.close()
