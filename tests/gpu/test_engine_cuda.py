"""Shoal's paged engine on a GPU: greedy output equals Hugging Face `generate` on the same GPU.

The engine runs the CUDA kernels (`engine.kernels == "cuda"`, never the torch reference
path) for write_kv, paged_attention and copy_blocks, inside the demo models. Like
`tests/unit/test_engine_correctness.py` on the CPU, the engine's text is its token ids
(`TokenEcho`), compared token for token with `generate` (greedy, float32, EOS ignored):
alone, batched with chunked prefill, with a prefix-cache hit, with preemptions, and built
by the worker's factory (warm-up pass at the full token budget). Skipped without CUDA.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.factory import build_paged_engine
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.generation import GenerationOutput, GenerationRequest
from shoal.services.worker.loader import LoadedModel, model_weight_bytes
from shoal.shared.messages import SamplingParams
from tests.token_echo import TokenEcho, echo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
DEMO_MODELS = ("demo/llama-5m", "demo/qwen2-25m")
NUM_NEW_TOKENS = 12
BLOCK_SIZE = 4


def _load(root: Path, key: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(root / key, dtype=torch.float32).to(DEVICE).eval()


class References:
    """Greedy `generate` on the GPU, on model instances of its own (an engine switches its
    model's attention to Shoal's), memoized."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[str, Any] = {}
        self._completions: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def greedy(self, key: str, prompt: list[int]) -> list[int]:
        memo_key = (key, tuple(prompt))
        if memo_key not in self._completions:
            if key not in self._models:
                self._models[key] = _load(self.root, key)
            input_ids = torch.tensor([prompt], device=DEVICE)
            config = GenerationConfig(
                max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            with torch.inference_mode():
                output = self._models[key].generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
                )
            self._completions[memo_key] = output[0, len(prompt) :].tolist()
        return self._completions[memo_key]


@pytest.fixture(scope="module")
def references(demo_models_root: Path) -> References:
    return References(demo_models_root)


def _prompts(vocab_size: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def _request(request_id: str, prompt: list[int]) -> GenerationRequest:
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return GenerationRequest(request_id, prompt, params)


async def _collect(outputs: AsyncIterator[GenerationOutput]) -> tuple[str, GenerationOutput]:
    text = ""
    async for output in outputs:
        text += output.text
        if output.finished:
            return text, output
    raise AssertionError("the stream ended without a finished output")


def _engine(model: Any, **config: Any) -> PagedEngine:
    defaults: dict[str, Any] = {"num_blocks": 128, "block_size": BLOCK_SIZE, "max_num_batched_tokens": 64}
    engine = PagedEngine(model, TokenEcho(), config=EngineConfig(**{**defaults, **config}))
    assert engine.kernels == "cuda", "the GPU tests run Shoal's kernels, not the torch reference path"
    assert all(key_cache.is_cuda for key_cache, _ in engine._runner.layer_caches)
    return engine


@pytest.mark.parametrize("key", DEMO_MODELS)
async def test_greedy_alone_equals_hf_generate(
    demo_models_root: Path, references: References, key: str
) -> None:
    model = _load(demo_models_root, key)
    prompts = _prompts(model.config.vocab_size, [1, 5, 16, 37, 200])
    engine = _engine(model, num_blocks=256)
    try:
        for index, prompt in enumerate(prompts):
            text, final = await _collect(engine.generate(_request(f"r{index}", prompt)))
            assert text == echo(references.greedy(key, prompt)), f"prompt {index} ({len(prompt)} tokens)"
            assert (final.finish_reason, final.num_completion_tokens) == ("length", NUM_NEW_TOKENS)
    finally:
        await engine.close()


@pytest.mark.parametrize("key", DEMO_MODELS)
async def test_greedy_batched_with_a_prefix_hit_equals_hf(
    demo_models_root: Path, references: References, key: str
) -> None:
    """Requests of many lengths at once, chunked prefills (a 24-token budget), and three
    sharing a 13-token prefix: the later two reuse its 3 cached blocks."""
    model = _load(demo_models_root, key)
    vocab_size = model.config.vocab_size
    shared = _prompts(vocab_size, [13], seed=1)[0]
    prompts = _prompts(vocab_size, [3, 29, 8, 1, 50, 17])
    engine = _engine(model, max_num_batched_tokens=24, max_num_seqs=16)
    try:
        first, _ = await _collect(engine.generate(_request("shared", shared)))
        assert first == echo(references.greedy(key, shared))
        batch = [*prompts, [*shared, 7, 8], [*shared, 9]]
        results = await asyncio.gather(
            *(_collect(engine.generate(_request(f"r{i}", prompt))) for i, prompt in enumerate(batch))
        )
        for index, (text, final) in enumerate(results):
            assert text == echo(references.greedy(key, batch[index])), f"prompt {index}"
            assert final.finish_reason == "length"
        assert engine.get_stats().pool.num_cache_hits == 2 * 3
    finally:
        await engine.close()


async def test_preempted_requests_finish_exactly(demo_models_root: Path, references: References) -> None:
    key = "demo/llama-5m"
    model = _load(demo_models_root, key)
    prompts = _prompts(model.config.vocab_size, [9, 14, 6, 11, 17, 8, 12, 10], seed=7)
    # 16 blocks of 4 tokens = 64 tokens; the 8 requests need 8 x ~23 = 184 at their end.
    engine = _engine(model, num_blocks=16, max_num_seqs=8)
    try:
        results = await asyncio.gather(
            *(_collect(engine.generate(_request(f"r{i}", prompt))) for i, prompt in enumerate(prompts))
        )
        for index, (text, final) in enumerate(results):
            assert final.finish_reason == "length", final
            assert text == echo(references.greedy(key, prompts[index])), f"prompt {index}"
        assert engine.get_stats().num_preemptions > 0
        assert engine.get_stats().pool.num_used_blocks == 0
    finally:
        await engine.close()


async def test_the_factorys_engine_warms_up_at_the_budget_and_serves_exactly(
    demo_models_root: Path, references: References
) -> None:
    key = "demo/llama-5m"
    model = _load(demo_models_root, key)
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / key)
    loaded = LoadedModel(
        model, tokenizer, DEVICE, torch.float32, model_weight_bytes(model), 2048, allocation_bytes=2 << 30
    )
    torch.cuda.reset_peak_memory_stats(DEVICE)
    engine = build_paged_engine(loaded)
    try:
        assert engine.kernels == "cuda"
        assert engine.num_warm_up_tokens == 2048
        assert torch.cuda.max_memory_allocated(DEVICE) > engine.kv_cache_bytes, "the pass ran on the GPU"
        stats = engine.get_stats().pool
        assert (stats.num_allocations, stats.num_peak_used_blocks) == (0, 0)
        prompt = _prompts(model.config.vocab_size, [21], seed=3)[0]
        expected = tokenizer.decode(references.greedy(key, prompt), skip_special_tokens=True)
        text, _ = await _collect(engine.generate(_request("r", prompt)))
        assert text == expected
    finally:
        await engine.close()
