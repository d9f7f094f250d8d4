"""The engine on real GPUs as it will serve (issue 13): bf16 end to end with long prompts
(prefill on SDPA, decode on the paged kernel with split contexts), and a replica whose layers
span two GPUs (each layer's KV on its layer's device). Skipped without CUDA; the same logic
runs on the CPU in tests/unit/test_engine_device_path.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.services.worker.engine.paged_engine import EngineConfig, PagedEngine
from shoal.services.worker.generation import GenerationRequest
from shoal.shared.messages import SamplingParams
from tests.token_echo import TokenEcho

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODEL = "demo/llama-100m"
NUM_NEW_TOKENS = 16


def _tokens(text: str) -> list[int]:
    return [int(part) for part in text.replace(">", "").split("<") if part]


async def _generate(engine: PagedEngine, request_id: str, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    text = ""
    async for output in engine.generate(GenerationRequest(request_id, prompt, params)):
        text += output.text
    return _tokens(text)


def _prompts(vocab_size: int, lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(5, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _assert_top_tokens(reference: Any, prompt: list[int], completion: list[int], k: int = 3) -> None:
    """Teacher-forced: every generated token is among transformers' `k` most likely there
    (bf16 rounding may swap near-ties; broken attention would not land in the top 3 of 32K)."""
    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.inference_mode():
        logits = reference(ids).logits[0, len(prompt) - 1 : -1]
    top = logits.topk(k, dim=-1).indices.tolist()
    misses = [i for i, token in enumerate(completion) if token not in top[i]]
    assert not misses, f"tokens {misses} of {completion} are not in transformers' top {k}"


async def test_bf16_end_to_end_with_long_prompts(demo_models_root: Path) -> None:
    path = demo_models_root / MODEL
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    reference = reference.to("cuda").eval()
    engine = PagedEngine(model, TokenEcho(), config=EngineConfig(num_blocks=1024, block_size=16,
                                                                 max_num_batched_tokens=2048))
    try:
        assert engine.kernels == "cuda"
        prompts = _prompts(model.config.vocab_size, [7, 300, 1500, 2000])
        completions = await asyncio.gather(*(_generate(engine, f"r{i}", p) for i, p in enumerate(prompts)))
        for prompt, completion in zip(prompts, completions, strict=True):
            assert len(completion) == NUM_NEW_TOKENS
            _assert_top_tokens(reference, prompt, completion)
    finally:
        await engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
async def test_a_replica_over_two_gpus_keeps_each_layers_kv_on_its_device(demo_models_root: Path) -> None:
    path = demo_models_root / MODEL
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    device_map: dict[str, Any] = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    for layer in range(num_layers):
        device_map[f"model.layers.{layer}"] = 0 if layer < num_layers // 2 else 1
    from accelerate import dispatch_model

    model = dispatch_model(model, device_map=device_map)
    engine = PagedEngine(model, TokenEcho(), config=EngineConfig(num_blocks=256, block_size=16))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda:0").eval()
    try:
        devices = [key_cache.device for key_cache, _ in engine._runner.layer_caches]
        assert devices == [torch.device("cuda", 0 if i < num_layers // 2 else 1) for i in range(num_layers)]
        prompt = _prompts(model.config.vocab_size, [200])[0]
        completion = await _generate(engine, "two-gpus", prompt)
        ids = torch.tensor([prompt], device="cuda:0")
        with torch.inference_mode():
            expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW_TOKENS,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert completion == expected[0, len(prompt):].tolist()
    finally:
        await engine.close()
