"""The fallback `hf` engine honours the sampling fields it accepts (a logit bias reaches
Hugging Face `generate` as its `sequence_bias`) and refuses, naming the field, what it cannot
do (log probabilities, JSON schemas)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from shoal.services.worker.generation import GenerationRequest, RequestRejected
from shoal.services.worker.hf_engine import HFGenerateEngine
from shoal.shared.messages import SamplingParams


async def _ending(engine: HFGenerateEngine, params: SamplingParams) -> tuple[int, str | None]:
    """(tokens generated, finish reason)."""
    outputs = [output async for output in engine.generate(GenerationRequest("r", [5, 6, 7, 8], params))]
    return outputs[-1].num_completion_tokens, outputs[-1].finish_reason


async def test_the_hf_engine_takes_stop_token_ids_and_min_tokens(demo_models_root: Path) -> None:
    """Token 300, made certain by a bias, ends the answer as a stop token: at once, or after min_tokens."""
    path = demo_models_root / "demo" / "llama-5m"
    engine = HFGenerateEngine(AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path),
                              2048)
    try:
        forced = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={300: 100.0})
        assert await _ending(engine, forced) == (8, "length")
        stopping = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={300: 100.0},
                                  stop_token_ids=[300])
        assert await _ending(engine, stopping) == (1, "stop")
        stopping.min_tokens = 3
        assert await _ending(engine, stopping) == (4, "stop")
        token_text = AutoTokenizer.from_pretrained(path).decode([300])  # a stop string names what ended the text
        stop_string = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={300: 100.0},
                                     stop=[token_text])
        outputs = [output async for output in engine.generate(GenerationRequest("r", [5, 6, 7, 8], stop_string))]
        assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", token_text)
    finally:
        await engine.close()


async def _text(engine: HFGenerateEngine, params: SamplingParams) -> str:
    request = GenerationRequest("r", [5, 6, 7, 8], params)
    return "".join([output.text async for output in engine.generate(request)])


async def test_the_hf_engine_takes_a_logit_bias_and_refuses_logprobs_json_and_prompt_scores(demo_models_root: Path) -> None:
    path = demo_models_root / "demo" / "llama-5m"
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = HFGenerateEngine(AutoModelForCausalLM.from_pretrained(path).eval(), tokenizer, 2048)
    try:
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        plain = await _text(engine, greedy)
        forced = await _text(engine, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                    logit_bias={300: 100.0}))
        assert forced == tokenizer.decode([300] * 6) != plain
        with pytest.raises(RequestRejected) as caught:
            await _text(engine, SamplingParams(max_tokens=2, logprobs=1))
        assert caught.value.param == "logprobs" and caught.value.status == 400
        with pytest.raises(RequestRejected) as caught:
            await _text(engine, SamplingParams(max_tokens=2, json_schema='{"type": "object"}'))
        assert caught.value.param == "response_format"
        with pytest.raises(RequestRejected) as caught:
            await _text(engine, SamplingParams(max_tokens=2, json_schema='{"type": "array"}', grammar_param="tools"))
        assert caught.value.param == "tools" and "tools" in str(caught.value)
        with pytest.raises(RequestRejected) as caught:
            await _text(engine, SamplingParams(max_tokens=2, echo=True, prompt_logprobs=1, logprobs=1))
        assert caught.value.param == "echo"
    finally:
        await engine.close()
