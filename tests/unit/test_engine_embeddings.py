"""Embedding requests in the paged engine (``SamplingParams.embed``): the prompt's last token's
final hidden state, L2-normalized, equal to a Hugging Face forward of the same model, through
either forward pass, in chunks, beside generating requests; no text, no completion tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.generation import Engine, GenerationOutput, GenerationRequest
from shoal.services.worker.hf_engine import HFGenerateEngine
from shoal.shared.messages import SamplingParams
from tests.token_echo import TokenEcho

MODELS = ("llama-5m", "qwen2-25m")


def _reference(model_dir: Path, prompt: list[int], normalize: bool = True) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        hidden = model.get_decoder()(torch.tensor([prompt])).last_hidden_state[0, -1]
    return (torch.nn.functional.normalize(hidden, dim=-1) if normalize else hidden).numpy()


async def _final(engine: Engine, request: GenerationRequest) -> tuple[str, GenerationOutput]:
    text = ""
    async for output in engine.generate(request):
        text += output.text
        if output.finished:
            return text, output
    raise AssertionError("no final output")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("native", [True, False], ids=["native", "transformers"])
async def test_an_embedding_is_the_normalized_last_hidden_state(demo_models_root: Path, name: str,
                                                               native: bool) -> None:
    model_dir = demo_models_root / "demo" / name
    engine = PagedEngine(AutoModelForCausalLM.from_pretrained(model_dir).eval(), TokenEcho(),
                         config=EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                                             native_forward=native))
    prompts = [[5, 6, 7], list(range(10, 47))]  # the second in chunks of the 16-token budget
    try:
        embed = SamplingParams(embed=True)
        generating = GenerationRequest("gen", list(range(50, 60)), SamplingParams(max_tokens=8, temperature=0.0,
                                                                                  ignore_eos=True))
        results = await asyncio.gather(_final(engine, generating), *(
            _final(engine, GenerationRequest(f"e{i}", prompt, embed)) for i, prompt in enumerate(prompts)))
        (gen_text, gen_final), *embedded = results
        assert gen_final.num_completion_tokens == 8 and gen_text, "generation beside them is unchanged"
        for prompt, (text, final) in zip(prompts, embedded, strict=True):
            assert text == "" and final.num_completion_tokens == 0 and final.num_prompt_tokens == len(prompt)
            assert final.finish_reason == "stop" and final.embedding is not None
            vector = np.frombuffer(final.embedding, dtype="<f4")
            np.testing.assert_allclose(vector, _reference(model_dir, prompt), atol=2e-4)
            assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
        raw = SamplingParams(embed=True, embed_normalize=False)  # vLLM's normalize: false
        _, final = await _final(engine, GenerationRequest("raw", prompts[0], raw))
        assert final.embedding is not None
        np.testing.assert_allclose(np.frombuffer(final.embedding, dtype="<f4"),
                                   _reference(model_dir, prompts[0], normalize=False), rtol=1e-3, atol=1e-3)
    finally:
        await engine.close()


async def test_the_hf_engine_embeds_as_the_paged_engine_does(demo_models_root: Path) -> None:
    model_dir = demo_models_root / "demo" / "llama-5m"
    engine = HFGenerateEngine(AutoModelForCausalLM.from_pretrained(model_dir).eval(),
                              AutoTokenizer.from_pretrained(model_dir), 2048)
    try:
        text, final = await _final(engine, GenerationRequest("e", [5, 6, 7, 8], SamplingParams(embed=True)))
        assert text == "" and final.num_completion_tokens == 0 and final.embedding is not None
        np.testing.assert_allclose(np.frombuffer(final.embedding, dtype="<f4"), _reference(model_dir, [5, 6, 7, 8]),
                                   atol=1e-5)
        _, raw = await _final(engine, GenerationRequest("r", [5, 6, 7, 8], SamplingParams(embed=True,
                                                                                          embed_normalize=False)))
        assert raw.embedding is not None
        np.testing.assert_allclose(np.frombuffer(raw.embedding, dtype="<f4"),
                                   _reference(model_dir, [5, 6, 7, 8], normalize=False), rtol=1e-4, atol=1e-4)
    finally:
        await engine.close()
