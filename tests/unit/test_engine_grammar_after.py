"""A grammar that waits for the reasoning to end (``SamplingParams.grammar_after``, a reasoning
model's ``</think>``): the text up to the marker is free, the rest follows the grammar; a
prompt that already ends with the marker (thinking off) is shaped from its first token. Here
the marker is one token's text ("User", token 346 of the demo tokenizer), which a logit bias
makes the model write first."""

from __future__ import annotations

import re

from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.generation import GenerationRequest
from shoal.shared.messages import SamplingParams

MARKER_TOKEN = 346
DIGITS = r"[0-9]{3}"


async def _text(engine: PagedEngine, eos_token_id: int, prompt: list[int], params: SamplingParams
                ) -> tuple[str, str | None]:
    text = ""
    async for output in engine.generate(GenerationRequest("r", prompt, params, eos_token_ids=frozenset({eos_token_id}))):
        text += output.text
        if output.finished:
            return text, output.finish_reason
    raise AssertionError("no final output")


async def test_the_grammar_shapes_only_the_text_after_the_marker(small_engine) -> None:  # type: ignore[no-untyped-def]
    paged, tokenizer = small_engine
    marker = tokenizer.decode([MARKER_TOKEN])
    params = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={MARKER_TOKEN: 100.0}, regex=DIGITS,
                            grammar_param="guided_regex", grammar_after=marker)
    text, reason = await _text(paged, tokenizer.eos_token_id, [5, 6, 7], params)
    assert text.startswith(marker) and re.fullmatch(DIGITS, text[len(marker):]) and reason == "stop", text
    # Without waiting, the grammar shapes every token: the biased marker never comes.
    unwaiting = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={MARKER_TOKEN: 100.0}, regex=DIGITS,
                               grammar_param="guided_regex")
    assert re.fullmatch(DIGITS, (await _text(paged, tokenizer.eos_token_id, [5, 6, 7], unwaiting))[0])


async def test_a_prompt_that_ends_the_reasoning_is_shaped_from_the_first_token(small_engine) -> None:  # type: ignore[no-untyped-def]
    paged, tokenizer = small_engine
    params = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={MARKER_TOKEN: 100.0}, regex=DIGITS,
                            grammar_param="guided_regex", grammar_after=tokenizer.decode([MARKER_TOKEN]))
    text, reason = await _text(paged, tokenizer.eos_token_id, [5, 6, MARKER_TOKEN], params)
    assert re.fullmatch(DIGITS, text) and reason == "stop", text
