"""The engine on the path CUDA takes, run on the CPU: decode rows on the paged op, prefill rows
on SDPA, each layer's KV on its layer's device (two injected device labels, so two pools),
index tensors per device. Greedy output equals Hugging Face `generate`, token for token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.paged_engine import PagedEngine
from tests.token_echo import TokenEcho, echo
from tests.unit.test_engine_correctness import DEMO_MODELS, Models, _collect, _prompts, _request


@pytest.fixture(scope="module")
def models(demo_models_root: Path) -> Models:
    return Models(demo_models_root)


def _split_engine(model: torch.nn.Module, **config: object) -> PagedEngine:
    num_layers = model.config.num_hidden_layers  # type: ignore[union-attr]
    labels = tuple("cpu:0" if layer < num_layers // 2 else "cpu:1" for layer in range(num_layers))
    defaults: dict[str, object] = {
        "num_blocks": 128, "block_size": 4, "max_num_batched_tokens": 24, "max_num_seqs": 16,
        "kernels_path": True, "kv_layer_devices": labels,
    }
    engine = PagedEngine(model, TokenEcho(), config=EngineConfig(**{**defaults, **config}))  # type: ignore[arg-type]
    assert engine.forward == "transformers" and engine._runner.kernels_path
    assert [run.device for run in engine._runner.pools.runs] == [torch.device("cpu", 0), torch.device("cpu", 1)]
    return engine


@pytest.mark.parametrize("key", DEMO_MODELS)
async def test_mixed_batches_on_the_kernels_path_over_two_pools_equal_hf(models: Models, key: str) -> None:
    """Staggered arrivals (decode rows and prefills in one pass), chunked prefills (a chunk
    over the sequence's earlier chunks: gathered from the blocks), prefix-cache hits."""
    model = models.load(key)
    vocab_size = model.config.vocab_size
    shared = _prompts(vocab_size, [13], seed=1)[0]
    prompts = [*_prompts(vocab_size, [3, 29, 8, 1, 50, 17]), [*shared, 7, 8], [*shared, 9], shared]
    expected = [models.greedy(key, prompt) for prompt in prompts]
    engine = _split_engine(model)
    try:
        tasks = []
        for index, prompt in enumerate(prompts):
            stream = engine.generate(_request(f"r{index}", prompt))
            first = await anext(stream)
            tasks.append(asyncio.create_task(_collect(stream, first)))
            await asyncio.sleep(0.002 * (index % 3))
        results = await asyncio.gather(*tasks)
        for index, (text, final) in enumerate(results):
            assert text == echo(expected[index]), f"prompt {index} ({len(prompts[index])} tokens)"
            assert final.finish_reason == "length"
        assert engine.get_stats().pool.num_cache_hits == 2 * 3
        assert all(run.pool.any() for run in engine._runner.pools.runs), "both pools hold K/V"
    finally:
        await engine.close()


async def test_preemption_on_the_kernels_path(models: Models) -> None:
    key = "demo/llama-5m"
    model = models.load(key)
    prompts = _prompts(model.config.vocab_size, [9, 14, 6, 11, 17, 8, 12, 10], seed=7)
    expected = [models.greedy(key, prompt) for prompt in prompts]
    engine = _split_engine(model, num_blocks=16, max_num_seqs=8, max_num_batched_tokens=64)
    try:
        results = await asyncio.gather(
            *(_collect(engine.generate(_request(f"r{i}", prompt))) for i, prompt in enumerate(prompts))
        )
        for index, (text, _) in enumerate(results):
            assert text == echo(expected[index]), f"prompt {index}"
        assert engine.get_stats().num_preemptions > 0
    finally:
        await engine.close()
