"""Shoal's paged engine on real models: greedy output equals Hugging Face `generate`, token for token.

The demo models (random seeded weights, made locally) are Llama and Qwen2; a tiny random
Mistral-style model checks that a third architecture runs unchanged. Exactness tests read
tokens through `TokenEcho`, a detokenizer that writes every token id as ``<id>``, so the
engine's text output is its exact token sequence.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MistralConfig,
)

from shoal.cli.demo_models import make_demo_models
from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.factory import build_paged_engine
from shoal.services.worker.engine.packed_load import load_packed
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.engine.sizing import KVPoolTooSmall, measure_weight_bytes
from shoal.services.worker.generation import GenerationOutput, GenerationRequest, RequestRejected
from shoal.services.worker.loader import LoadedModel
from shoal.shared.messages import SamplingParams
from shoal.shared.model_memory import get_activation_bytes, get_model_shape
from tests.token_echo import TokenEcho, echo

DEMO_MODELS = ("demo/llama-5m", "demo/qwen2-25m")
PACKED = ":packed"
"""A model key with this suffix is loaded by `packed_load` (and compared with the model's own)."""
NUM_NEW_TOKENS = 12
BLOCK_SIZE = 4


def _tiny_mistral() -> torch.nn.Module:
    config = MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=300,
        max_position_embeddings=256,
        sliding_window=128,
    )
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config).eval()


class _OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens: the reference."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float) -> None:
        self.num_prompt_tokens, self.presence, self.frequency = num_prompt_tokens, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for row, token_ids in enumerate(input_ids[:, self.num_prompt_tokens :].tolist()):
            for token_id in set(token_ids):
                count = token_ids.count(token_id)
                scores[row, token_id] -= self.frequency * count + self.presence
        return scores


class Models:
    """Fresh model instances for engines, and memoized Hugging Face `generate` references
    computed on instances of their own (an engine switches its model's attention)."""

    def __init__(self, models_root: Path) -> None:
        self.root = models_root
        self._references: dict[str, Any] = {}
        self._completions: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def load(self, key: str) -> Any:
        if key == "mistral-tiny":
            return _tiny_mistral()
        if key.endswith(PACKED):  # read straight into the native forward's panels, as a worker does
            model_dir = self.root / key.removesuffix(PACKED)
            loaded = load_packed(model_dir, AutoConfig.from_pretrained(model_dir), attn_implementation=None)
            assert loaded is not None, "the demo models load packed"
            return loaded[0]
        return AutoModelForCausalLM.from_pretrained(self.root / key).eval()

    def greedy(
        self, key: str, prompt: list[int], num_new_tokens: int = NUM_NEW_TOKENS, **penalties: float
    ) -> list[int]:
        """Hugging Face `generate`, greedy, EOS ignored (no EOS id at all, so nothing is masked).

        `penalties`: ``repetition_penalty`` (Hugging Face's own), ``presence_penalty`` and
        ``frequency_penalty`` (OpenAI's, by `_OpenAIPenalties`)."""
        key = key.removesuffix(PACKED)  # the reference: Hugging Face's own load
        memo_key = (key, tuple(prompt), num_new_tokens, tuple(sorted(penalties.items())))
        if memo_key not in self._completions:
            if key not in self._references:
                self._references[key] = self.load(key)
            input_ids = torch.tensor([prompt])
            config = GenerationConfig(
                max_new_tokens=num_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                repetition_penalty=penalties.get("repetition_penalty", 1.0),
            )
            processors = LogitsProcessorList(
                [_OpenAIPenalties(len(prompt), penalties.get("presence_penalty", 0.0),
                                  penalties.get("frequency_penalty", 0.0))]
            )
            with torch.inference_mode():
                output = self._references[key].generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    generation_config=config,
                    logits_processor=processors,
                )
            completion = output[0, len(prompt) :].tolist()
            assert len(completion) == num_new_tokens
            self._completions[memo_key] = completion
        return self._completions[memo_key]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("models")
    make_demo_models(root, names=DEMO_MODELS)
    return Models(root)


def _prompts(vocab_size: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def _request(request_id: str, prompt: list[int], **params: object) -> GenerationRequest:
    defaults: dict[str, object] = {"max_tokens": NUM_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return GenerationRequest(request_id, prompt, SamplingParams(**{**defaults, **params}))  # type: ignore[arg-type]


async def _collect(
    outputs: AsyncIterator[GenerationOutput], first: GenerationOutput | None = None
) -> tuple[str, GenerationOutput]:
    """All text of a stream (after `first`, if already read), and its final output."""
    text, num_tokens = "", 0
    if first is not None:
        text, num_tokens = first.text, first.num_new_tokens
        if first.finished:
            return text, first
    async for output in outputs:
        text += output.text
        num_tokens += output.num_new_tokens
        if output.finished:
            assert num_tokens == output.num_completion_tokens, "num_new_tokens must add up to the completion"
            return text, output
    raise AssertionError("the stream ended without a finished output")


def _engine(model: torch.nn.Module, tokenizer: object = None, **config: object) -> PagedEngine:
    defaults: dict[str, object] = {"num_blocks": 128, "block_size": BLOCK_SIZE, "max_num_batched_tokens": 64}
    return PagedEngine(model, tokenizer or TokenEcho(), config=EngineConfig(**{**defaults, **config}))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- exactness


@pytest.mark.parametrize("key", [*DEMO_MODELS, "mistral-tiny", *(key + PACKED for key in DEMO_MODELS)])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix", "no-prefix"])
async def test_greedy_alone_equals_hf_generate(models: Models, key: str, prefix_caching: bool) -> None:
    model = models.load(key)
    prompts = _prompts(model.config.vocab_size, [1, 5, 16, 37])
    expected = [models.greedy(key, prompt) for prompt in prompts]
    engine = _engine(model, enable_prefix_caching=prefix_caching)
    try:
        for index, prompt in enumerate(prompts):
            text, final = await _collect(engine.generate(_request(f"r{index}", prompt)))
            assert text == echo(expected[index]), f"prompt {index} ({len(prompt)} tokens)"
            assert (final.finish_reason, final.num_completion_tokens) == ("length", NUM_NEW_TOKENS)
            assert final.num_prompt_tokens == len(prompt)
    finally:
        await engine.close()


@pytest.mark.parametrize("budget", [2048, 320], ids=["whole-prompt-passes", "chunked"])
async def test_long_prompts_greedy_equal_hf_generate(models: Models, budget: int) -> None:
    """Prompts near the model's 2,048 positions, prefilled together (the tiled causal attention
    of the native forward, whole or in chunks over a prefix already in the pool, next to the
    other's decode rows)."""
    key = "demo/llama-5m"
    model = models.load(key)
    prompts = _prompts(model.config.vocab_size, [1900, 700], seed=3)
    expected = [models.greedy(key, prompt) for prompt in prompts]
    num_blocks = sum(-(-(len(p) + NUM_NEW_TOKENS) // BLOCK_SIZE) for p in prompts) + 4
    engine = _engine(model, num_blocks=num_blocks, max_num_batched_tokens=budget)
    try:
        results = await asyncio.gather(*(
            _collect(engine.generate(_request(f"r{index}", prompt))) for index, prompt in enumerate(prompts)
        ))
        for index, (text, final) in enumerate(results):
            assert text == echo(expected[index]), f"prompt {index} ({len(prompts[index])} tokens)"
            assert final.num_completion_tokens == NUM_NEW_TOKENS
    finally:
        await engine.close()


@pytest.mark.parametrize("key", [*DEMO_MODELS, *(key + PACKED for key in DEMO_MODELS)])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix", "no-prefix"])
async def test_greedy_batched_with_staggered_arrivals_equals_hf(
    models: Models, key: str, prefix_caching: bool
) -> None:
    """Requests of different lengths arrive while others decode, some sharing a long prefix."""
    model = models.load(key)
    vocab_size = model.config.vocab_size
    shared = _prompts(vocab_size, [13], seed=1)[0]
    prompts = [*_prompts(vocab_size, [3, 29, 8, 1, 50, 17]), [*shared, 7, 8], [*shared, 9], shared]
    expected = [models.greedy(key, prompt) for prompt in prompts]
    # A chunk budget below the longest prompt makes prefills chunked too.
    engine = _engine(model, enable_prefix_caching=prefix_caching, max_num_batched_tokens=24, max_num_seqs=16)
    try:
        tasks: list[asyncio.Task[tuple[str, GenerationOutput]]] = []
        for index, prompt in enumerate(prompts):
            stream = engine.generate(_request(f"r{index}", prompt))
            first = await anext(stream)  # wait for this one's first token before the next arrives
            tasks.append(asyncio.create_task(_collect(stream, first)))
            await asyncio.sleep(0.002 * (index % 3))
        results = await asyncio.gather(*tasks)
        for index, (text, final) in enumerate(results):
            assert text == echo(expected[index]), f"prompt {index} ({len(prompts[index])} tokens)"
            assert final.finish_reason == "length"
        if prefix_caching:
            # The first of the three computes the 3 shared blocks; the other two reuse them.
            assert engine.get_stats().pool.num_cache_hits == 2 * 3
        else:
            assert engine.get_stats().pool.num_cache_hits == 0
    finally:
        await engine.close()


async def test_a_shared_prefix_hits_the_cache_and_saves_blocks(models: Models) -> None:
    model = models.load("demo/llama-5m")
    prefix = _prompts(model.config.vocab_size, [24], seed=5)[0]  # 6 full blocks
    prompts = [[*prefix, 11, 12, 13], [*prefix, 21]]
    expected = [models.greedy("demo/llama-5m", prompt) for prompt in prompts]
    allocations = {}
    for prefix_caching in (True, False):
        engine = _engine(model, enable_prefix_caching=prefix_caching)
        try:
            for index, prompt in enumerate(prompts):
                text, _ = await _collect(engine.generate(_request(f"r{index}", prompt)))
                assert text == echo(expected[index])
            stats = engine.get_stats().pool
            allocations[prefix_caching] = stats.num_allocations
            if prefix_caching:
                assert (stats.num_cache_hits, stats.num_cache_misses) == (6, 6)
        finally:
            await engine.close()
    assert allocations[False] - allocations[True] == 6


async def test_more_requests_than_the_pool_holds_all_complete_exactly(models: Models) -> None:
    model = models.load("demo/llama-5m")
    prompts = _prompts(model.config.vocab_size, [9, 14, 6, 11, 17, 8, 12, 10], seed=7)
    expected = [models.greedy("demo/llama-5m", prompt) for prompt in prompts]
    # 16 blocks of 4 tokens = 64 tokens; the 8 requests need 8 x ~23 = 184 at their end.
    engine = _engine(model, num_blocks=16, max_num_seqs=8)
    try:
        results = await asyncio.gather(
            *(_collect(engine.generate(_request(f"r{i}", prompt))) for i, prompt in enumerate(prompts))
        )
        for index, (text, final) in enumerate(results):
            assert final.finish_reason == "length", final
            assert text == echo(expected[index]), f"prompt {index}"
        assert engine.get_stats().num_preemptions > 0
        stats = engine.get_stats().pool
        assert stats.num_used_blocks == 0
        assert stats.num_peak_used_blocks == 16
    finally:
        await engine.close()


# ---------------------------------------------------------------------- request lifecycle


async def test_cancel_frees_blocks_at_once(models: Models) -> None:
    model = models.load("demo/llama-5m")
    engine = _engine(model)
    try:
        prompt = _prompts(model.config.vocab_size, [30])[0]
        stream = engine.generate(_request("long", prompt, max_tokens=10_000))
        num_tokens = 0
        for _ in range(3):
            output = await anext(stream)
            assert not output.finished
            num_tokens += output.num_new_tokens
        assert engine.get_stats().pool.num_used_blocks >= 8
        assert engine.cancel("long")
        assert engine.get_stats().pool.num_used_blocks == 0
        assert not engine.cancel("long")
        final = await anext(stream)
        while not final.finished:  # tokens generated before the cancel still come first
            num_tokens += final.num_new_tokens
            final = await anext(stream)
        assert num_tokens + final.num_new_tokens == final.num_completion_tokens
        assert (final.finish_reason, final.finished) == ("cancelled", True)
        assert engine.num_free_slots() > 0
    finally:
        await engine.close()


async def test_a_consumer_that_stops_reading_cancels_its_request(models: Models) -> None:
    model = models.load("demo/llama-5m")
    engine = _engine(model)
    try:
        stream = engine.generate(_request("gone", [5, 6, 7], max_tokens=10_000))
        await anext(stream)
        await stream.aclose()
        assert engine.get_stats().pool.num_used_blocks == 0
        assert not engine.cancel("gone")
    finally:
        await engine.close()


async def test_stop_strings_and_max_tokens(models: Models) -> None:
    model = models.load("demo/llama-5m")
    tokenizer = AutoTokenizer.from_pretrained(models.root / "demo/llama-5m")
    prompt = tokenizer("Once upon a time").input_ids
    full_text = str(tokenizer.decode(models.greedy("demo/llama-5m", prompt, 20), skip_special_tokens=True))
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    engine = _engine(model, tokenizer)
    try:
        text, final = await _collect(engine.generate(_request("stop", prompt, max_tokens=20, stop=[stop])))
        assert (final.finish_reason, final.stop_reason, text) == ("stop", stop, full_text[: full_text.index(stop)])
        assert final.num_completion_tokens < 20
        assert engine.get_stats().pool.num_used_blocks == 0
        text, final = await _collect(engine.generate(_request("length", prompt, max_tokens=5)))
        assert (final.finish_reason, final.num_completion_tokens, final.stop_reason) == ("length", 5, None)
        assert full_text.startswith(text)
    finally:
        await engine.close()


async def test_eos_ends_generation_unless_ignored(models: Models) -> None:
    model = models.load("demo/llama-5m")
    prompt = [5, 6, 7, 8]
    expected = models.greedy("demo/llama-5m", prompt)
    eos = expected[4]  # pretend the fifth greedy token is EOS
    engine = _engine(model)
    try:
        request = GenerationRequest(
            "eos", prompt, SamplingParams(max_tokens=12, temperature=0.0), eos_token_ids=frozenset({eos})
        )
        text, final = await _collect(engine.generate(request))
        end = expected.index(eos) + 1
        assert (final.finish_reason, final.num_completion_tokens, text) == (
            "stop",
            end,
            echo(expected[:end]),
        )
    finally:
        await engine.close()


async def test_seeded_sampling_is_reproducible_in_any_batch(models: Models) -> None:
    model = models.load("demo/qwen2-25m")
    engine = _engine(model)
    prompt = [10, 20, 30, 40, 50]
    sampled = {"temperature": 0.9, "top_p": 0.9, "max_tokens": 16}
    try:
        alone, _ = await _collect(engine.generate(_request("a", prompt, seed=1234, **sampled)))
        batch = await asyncio.gather(
            _collect(engine.generate(_request("b", prompt, seed=1234, **sampled))),
            _collect(engine.generate(_request("c", prompt[:3], seed=99, **sampled))),
            _collect(engine.generate(_request("d", prompt, seed=5678, **sampled))),
        )
        assert batch[0][0] == alone
        assert batch[2][0] != alone
        greedy, _ = await _collect(engine.generate(_request("g", prompt, max_tokens=16)))
        assert alone != greedy
    finally:
        await engine.close()


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.5},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.7, "presence_penalty": -0.3},
        {"repetition_penalty": 0.8, "frequency_penalty": 1.0},
    ],
    ids=["repetition", "presence", "frequency+presence", "repetition+frequency"],
)
async def test_penalties_equal_the_reference_in_a_mixed_batch(models: Models, penalties: dict[str, float]) -> None:
    """Greedy with penalties equals `generate` with the same penalties, batched with
    requests without any (whose output must not change)."""
    key = "demo/llama-5m"
    model = models.load(key)
    # Short prompts from a small range of tokens: repeats, so every penalty bites.
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 40, (length,), generator=generator).tolist() for length in (6, 19, 3)]
    num_new = 24
    penalized = [models.greedy(key, prompt, num_new, **penalties) for prompt in prompts]
    plain = [models.greedy(key, prompt, num_new) for prompt in prompts]
    assert penalized != plain, "the penalties must change something for this test to mean anything"
    engine = _engine(model, max_num_seqs=8)
    try:
        streams = [
            _collect(engine.generate(_request(f"p{i}", prompt, max_tokens=num_new, **penalties)))
            for i, prompt in enumerate(prompts)
        ] + [
            _collect(engine.generate(_request(f"g{i}", prompt, max_tokens=num_new)))
            for i, prompt in enumerate(prompts)
        ]
        results = await asyncio.gather(*streams)
        texts = [text for text, _ in results]
        assert texts[: len(prompts)] == [echo(tokens) for tokens in penalized]
        assert texts[len(prompts) :] == [echo(tokens) for tokens in plain]
    finally:
        await engine.close()


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/llama-5m" + PACKED])
async def test_logit_bias_equals_the_reference_in_a_mixed_batch(models: Models, key: str) -> None:
    """Greedy with a logit bias equals `generate` with the same bias (Hugging Face's
    `sequence_bias`), batched with requests without one; the packed model's forward hands
    the sampler its argmax, which a biased row must not take."""
    prompts = _prompts(1000, (5, 17))
    num_new = 16
    plain = [models.greedy(key, prompt, num_new) for prompt in prompts]
    bias = {plain[0][0]: -100.0, plain[1][3]: -100.0, 42: 4.0, 7: 2.5}
    reference = models.load(key.removesuffix(PACKED))
    biased = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            output = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                        max_new_tokens=num_new, eos_token_id=None, pad_token_id=0,
                                        sequence_bias=[[[t], b] for t, b in bias.items()])
        biased.append(output[0, len(prompt):].tolist())
    assert all(b != p for b, p in zip(biased, plain, strict=True)), "the bias must change every completion"
    assert all(plain[0][0] not in b for b in biased), "a -100 bias bans its token"
    engine = _engine(models.load(key), max_num_seqs=8)
    try:
        streams = [_collect(engine.generate(_request(f"b{i}", p, max_tokens=num_new, logit_bias=bias)))
                   for i, p in enumerate(prompts)]
        streams += [_collect(engine.generate(_request(f"g{i}", p, max_tokens=num_new))) for i, p in enumerate(prompts)]
        texts = [text for text, _ in await asyncio.gather(*streams)]
        assert texts == [echo(tokens) for tokens in biased + plain]
    finally:
        await engine.close()


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/llama-5m" + PACKED])
@pytest.mark.parametrize("stop", [[], ["<999999>"]], ids=["detokenized-by-consumer", "detokenized-in-step"])
async def test_logprobs_are_the_models_distribution_for_every_token(models: Models, key: str, stop: list[str]) -> None:
    """Each generated token comes with its log probability and its `logprobs` most likely
    alternatives under the model's raw distribution (checked against one Hugging Face forward
    over prompt and completion), whatever the sampling settings; requests beside it that do
    not ask get none."""
    prompt = _prompts(1000, (9,), seed=4)[0]
    engine = _engine(models.load(key), max_num_seqs=8)
    try:
        asking = _collect_logprobs(engine, _request("lp", prompt, max_tokens=10, temperature=0.9, seed=1,
                                                    logprobs=3, repetition_penalty=1.3, stop=stop))
        plain = _collect_logprobs(engine, _request("plain", prompt, max_tokens=10, stop=stop))
        (text, entries), (_, none) = await asyncio.gather(asking, plain)
    finally:
        await engine.close()
    assert none == []
    completion = [entry.token_id for entry in entries]
    assert text == echo(completion) and len(completion) == 10
    reference = models.load(key.removesuffix(PACKED))
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for step, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(expected[step, entry.token_id].item(), abs=1e-4)
        top_values, top_ids = expected[step].topk(3)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/llama-5m" + PACKED, "demo/qwen2-25m"])
async def test_prompt_logprobs_score_every_prompt_token_however_the_prompt_is_cut(models: Models, key: str) -> None:
    """``echo`` with ``logprobs``: the first output carries every prompt token's log probability
    (but the first's) and alternatives, equal to one Hugging Face forward over the prompt:
    prefilled in chunks (budget 64) beside other requests, and computed anew although the
    prefix cache holds the prompt (a cache hit has no rows to score)."""
    prompt, other = _prompts(1000, (150, 40), seed=5)
    engine = _engine(models.load(key), max_num_seqs=8)
    try:
        await _collect(engine.generate(_request("warm", prompt, max_tokens=2)))  # caches the prompt
        hits = engine.get_stats().pool.num_cache_hits
        scoring = _first_and_rest(engine.generate(_request("score", prompt, max_tokens=3, prompt_logprobs=2)))
        beside = _collect(engine.generate(_request("beside", other, max_tokens=20)))
        (first, text, final), _ = await asyncio.gather(scoring, beside)
        assert engine.get_stats().pool.num_cache_hits == hits, "the scored prompt took no cached block"
        plain_text, _ = await _collect(engine.generate(_request("plain", prompt, max_tokens=3)))
        assert engine.get_stats().pool.num_cache_hits > hits, "...though the cache held it"
    finally:
        await engine.close()
    assert text == plain_text, "scoring the prompt leaves the completion as it was"
    assert final is first or final.prompt_logprobs is None, "only the first output carries them"
    _assert_prompt_scores(models, key, prompt, first.prompt_logprobs, num_top=2)


async def test_a_scored_prompt_preempted_in_its_prefill_is_scored_once_and_exactly(models: Models) -> None:
    """A pool too small for the batch preempts the newest sequence, here the one scoring its
    prompt, between its prefill chunks: the rows scored before are not scored again, the
    rest are, and every score is still the model's."""
    key = "demo/llama-5m"
    prompts = _prompts(1000, (30, 30, 30, 61), seed=6)
    engine = _engine(models.load(key), num_blocks=20, max_num_seqs=8, max_num_batched_tokens=16)
    try:
        runs = [_collect(engine.generate(_request(f"r{i}", p, max_tokens=12))) for i, p in enumerate(prompts[:3])]
        scoring = _first_and_rest(engine.generate(_request("score", prompts[3], max_tokens=4, prompt_logprobs=0)))
        *_, (first, _, final) = await asyncio.gather(*runs, scoring)
        assert engine.get_stats().num_preemptions > 0
    finally:
        await engine.close()
    assert final.finish_reason == "length"
    _assert_prompt_scores(models, key, prompts[3], first.prompt_logprobs, num_top=0)


def _assert_prompt_scores(models: Models, key: str, prompt: list[int], scores: Any, num_top: int) -> None:
    """`scores` are every prompt token's (but the first's) under one Hugging Face forward."""
    assert scores is not None and len(scores) == len(prompt) - 1
    reference = models.load(key.removesuffix(PACKED))
    with torch.inference_mode():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    for position, entry in enumerate(scores):
        assert entry.token_id == prompt[position + 1]
        assert entry.logprob == pytest.approx(expected[position, entry.token_id].item(), abs=1e-4), position
        if num_top:
            top_values, top_ids = expected[position].topk(num_top)
            assert [t for t, _ in entry.top] == top_ids.tolist(), position
            assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        else:
            assert entry.top == ()


async def _first_and_rest(outputs: AsyncIterator[GenerationOutput]) -> tuple[GenerationOutput, str, GenerationOutput]:
    """A stream's first output, all its text, and its final output."""
    first = await anext(outputs)
    text, final = await _collect(outputs, first)
    return first, text, final


async def _collect_logprobs(engine: PagedEngine, request: GenerationRequest) -> tuple[str, list[Any]]:
    """A request's text and its outputs' log probabilities, which must cover its tokens."""
    text, entries = "", []
    async for output in engine.generate(request):
        text += output.text
        entries += output.logprobs
        if output.finished:
            assert len(entries) == (output.num_completion_tokens if request.params.logprobs is not None else 0)
            return text, entries
    raise AssertionError("the stream ended without a finished output")


async def test_a_json_schema_shapes_its_request_and_leaves_the_batch_alone(models: Models) -> None:
    """A request with a JSON schema writes JSON that follows it, then ends (greedy and sampled,
    on the packed model's forward); greedy requests beside it equal `generate`."""
    key = "demo/llama-5m"
    tokenizer = AutoTokenizer.from_pretrained(models.root / key)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50},
                                               "tag": {"enum": ["a", "b"]}},
              "required": ["n", "tag"], "additionalProperties": False}
    prompts = _prompts(1000, (7, 12), seed=9)
    plain = [models.greedy(key, prompt, 8) for prompt in prompts]
    engine = _engine(models.load(key + PACKED), tokenizer, max_num_seqs=8)
    try:
        shaped = [_collect(engine.generate(GenerationRequest(
            f"json{i}", prompt, SamplingParams(max_tokens=200, temperature=temperature, seed=i,
                                               json_schema=json.dumps(schema)), eos_token_ids=frozenset({eos}))))
            for i, (prompt, temperature, eos) in enumerate(zip(prompts, (0.0, 1.2), [tokenizer.eos_token_id] * 2,
                                                               strict=True))]
        free = [_collect(engine.generate(_request(f"g{i}", p, max_tokens=8))) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*shaped, *free)
    finally:
        await engine.close()
    for text, final in results[:2]:
        assert final.finish_reason == "stop"
        value = json.loads(text)
        assert set(value) == {"n", "tag"} and 0 <= value["n"] <= 50 and value["tag"] in ("a", "b")
    assert [text for text, _ in results[2:]] == [tokenizer.decode(tokens) for tokens in plain]


async def test_requests_that_cannot_run_are_rejected(models: Models) -> None:
    model = models.load("demo/llama-5m")
    engine = _engine(model, num_blocks=8)  # 32 tokens of KV
    try:
        assert engine.max_model_len == 32
        with pytest.raises(RequestRejected) as rejected:
            await anext(engine.generate(_request("long", list(range(5, 37)))))
        assert (rejected.value.status, rejected.value.code) == (400, "context_length_exceeded")
        assert "32 tokens > 31 maximum" in str(rejected.value)
        with pytest.raises(RequestRejected) as rejected:
            await anext(engine.generate(_request("empty", [])))
        assert rejected.value.status == 400
        # Prompt + completion stop at the pool's capacity with "length"...
        _text, final = await _collect(engine.generate(_request("fits", list(range(5, 35)), max_tokens=50)))
        assert (final.finish_reason, final.num_completion_tokens) == ("length", 2)
        # ...unless the client's max_tokens must fit: then it is refused, naming max_tokens.
        with pytest.raises(RequestRejected) as rejected:
            await anext(engine.generate(_request("must", list(range(5, 35)), max_tokens=3, max_tokens_must_fit=True)))
        assert (rejected.value.status, rejected.value.param, rejected.value.code) == (
            400, "max_tokens", "context_length_exceeded")
        _text, final = await _collect(engine.generate(_request("room", list(range(5, 35)), max_tokens=2,
                                                                max_tokens_must_fit=True)))
        assert (final.finish_reason, final.num_completion_tokens) == ("length", 2)
    finally:
        await engine.close()


async def test_an_embedding_input_may_fill_the_context(models: Models) -> None:
    """An embedding generates nothing: no room to answer is kept (vLLM embeds up to max_model_len)."""
    engine = _engine(models.load("demo/llama-5m"), num_blocks=8)  # 32 tokens of KV
    try:
        _text, final = await _collect(engine.generate(_request("full", list(range(5, 37)), embed=True)))
        assert final.embedding is not None and final.num_prompt_tokens == 32
        with pytest.raises(RequestRejected) as rejected:
            await anext(engine.generate(_request("over", list(range(5, 38)), embed=True)))
        assert (rejected.value.status, rejected.value.code) == (400, "context_length_exceeded")
    finally:
        await engine.close()


async def test_free_slots_follow_max_num_seqs_and_free_blocks(models: Models) -> None:
    model = models.load("demo/llama-5m")
    engine = _engine(model, num_blocks=64, max_num_seqs=4)
    try:
        assert engine.num_free_slots() == 4
        streams = [engine.generate(_request(f"r{i}", [5, 6, 7], max_tokens=40)) for i in range(4)]
        for stream in streams:
            await anext(stream)
        assert engine.num_free_slots() == 0
        for index in range(4):
            engine.cancel(f"r{index}")
        assert engine.num_free_slots() == 4
    finally:
        await engine.close()


async def test_a_failed_forward_pass_fails_its_requests_not_the_engine(models: Models) -> None:
    model = models.load("demo/llama-5m")
    engine = _engine(model)
    execute = engine._runner.execute

    def fail_once(step: object) -> object:
        engine._runner.execute = execute  # type: ignore[method-assign]
        raise RuntimeError("device lost")

    engine._runner.execute = fail_once  # type: ignore[method-assign]
    try:
        _, final = await _collect(engine.generate(_request("doomed", [5, 6, 7])))
        assert (final.finish_reason, final.error) == ("error", "RuntimeError: device lost")
        assert engine.get_stats().pool.num_used_blocks == 0
        text, final = await _collect(engine.generate(_request("next", [5, 6, 7])))
        assert (final.finish_reason, text) == ("length", echo(models.greedy("demo/llama-5m", [5, 6, 7])))
    finally:
        await engine.close()


async def test_the_factory_sizes_the_pool_from_the_allocation(models: Models) -> None:
    model = models.load("demo/llama-5m")
    tokenizer = AutoTokenizer.from_pretrained(models.root / "demo/llama-5m")
    weight_bytes = measure_weight_bytes(model)
    shape = get_model_shape(model.config, torch.float32)
    reserve_bytes = get_activation_bytes(shape, 2048, 64)  # no CUDA context on a virtual GPU
    block_bytes = shape.get_kv_bytes_per_block(16)
    loaded = LoadedModel(
        model,
        tokenizer,
        torch.device("cpu"),
        torch.float32,
        weight_bytes,
        2048,
        allocation_bytes=weight_bytes + reserve_bytes + 100 * block_bytes + 5,
    )
    engine = build_paged_engine(loaded)
    try:
        assert engine.get_stats().pool.num_blocks == 100
        assert engine.kv_cache_bytes == 100 * block_bytes
        assert engine.reserve_bytes == reserve_bytes
        assert engine.max_model_len == 100 * 16
    finally:
        await engine.close()
    capped = build_paged_engine(loaded, kv_cache_tokens=40 * 16 - 3)
    try:
        assert capped.get_stats().pool.num_blocks == 40, "the model's KV budget caps a generous allocation"
    finally:
        await capped.close()
    with pytest.raises(KVPoolTooSmall, match="leaves no KV block"):
        build_paged_engine(replace(loaded, allocation_bytes=weight_bytes + reserve_bytes + block_bytes - 1))
