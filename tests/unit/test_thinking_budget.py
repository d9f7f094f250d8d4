"""A thinking budget (engine/thinking.py): where a think block starts, how its tokens are
counted, when the engine closes it; and, through the paged engine and a demo model, the
close written after exactly the budget's tokens, the grammar shaping what follows."""

from __future__ import annotations

import re
from collections import deque

import pytest
import torch

from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.engine.sampler import SamplingState, sample
from shoal.services.worker.engine.thinking import ThinkingBudget, forced_end
from shoal.services.worker.generation import GenerationRequest, RequestRejected
from shoal.shared.messages import SamplingParams

END = "</think>"
CLOSE = (7, 8, 9)


def _budget(budget: int, prompt_end: str, open_marker: str | None = None) -> ThinkingBudget | None:
    return ThinkingBudget.start(budget, open_marker, END, CLOSE, prompt_end)


def _feed(budget: ThinkingBudget, pieces: list[str]) -> list[tuple[int, ...]]:
    text, forced = "", []
    for piece in pieces:
        text += piece
        forced.append(budget.after_token(text))
    return forced


def test_a_block_the_prompt_opened_is_closed_after_the_budgets_tokens() -> None:
    budget = _budget(3, "<|assistant|>\n")
    assert budget is not None and budget.phase == "thinking" and budget.at_start() == ()
    assert _feed(budget, ["Let", " me", " see", " more"]) == [(), (), CLOSE, ()]  # once
    assert budget.phase == "done" and budget.num_thinking_tokens == 3


def test_an_opening_the_answer_writes_in_a_block_the_prompt_opened_is_not_counted() -> None:
    budget = _budget(2, "<|assistant|>\n")  # an older R1 template: the model writes <think> itself
    assert budget is not None
    assert _feed(budget, ["<th", "ink>", "\n", " hm", " so", " then"]) == [(), (), (), (), CLOSE, ()]
    words_first = _budget(2, "<|assistant|>\n")
    assert words_first is not None
    assert _feed(words_first, ["<b>", "<think>", " so"]) == [(), CLOSE, ()]  # a later <think> is thinking


def test_a_model_that_closes_its_block_in_time_is_left_alone() -> None:
    budget = _budget(4, "<think>\n")
    assert budget is not None
    assert _feed(budget, ["Easy", ".</", "think", ">", " Four", " and", " more"]) == [()] * 7
    assert budget.phase == "done" and budget.num_thinking_tokens == 3  # until the token that completes the marker


def test_a_prompt_that_closed_the_block_has_no_budget() -> None:
    assert _budget(3, "Think no more.</think>\n\n") is None


def test_nothing_to_think_closes_the_block_before_the_first_token() -> None:
    budget = _budget(0, "<|assistant|>")
    assert budget is not None and budget.at_start() == CLOSE and budget.phase == "done"
    assert _feed(budget, ["x"]) == [()]


def test_an_answer_that_opens_its_block_is_counted_from_the_opening() -> None:
    budget = _budget(2, "<|assistant|>\n", open_marker="<think>")
    assert budget is not None and budget.phase == "opening"
    assert _feed(budget, ["\n<", "think", ">", " hm", " well", " so"]) == [(), (), (), (), CLOSE, ()]
    zero = _budget(0, "<|assistant|>", open_marker="<think>")
    assert zero is not None and _feed(zero, ["<think>", " x"]) == [CLOSE, ()]
    opened_by_prompt = _budget(1, "<|assistant|>\n<think>\n", open_marker="<think>")
    assert opened_by_prompt is not None and opened_by_prompt.phase == "thinking"


def test_an_answer_that_does_not_open_a_block_is_not_cut() -> None:
    budget = _budget(1, "<|assistant|>", open_marker="<think>")
    assert budget is not None
    assert _feed(budget, ["<th", "ere", " is", " no"]) == [()] * 4
    assert budget.phase == "done"


def test_forced_tokens_replace_the_choice_and_the_random_stream_still_draws() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    greedy = SamplingState.from_params(SamplingParams(temperature=0.0))
    greedy.forced = deque([2, 0])
    other = SamplingState.from_params(SamplingParams(temperature=0.0))
    assert sample(logits, [greedy, other], argmax=logits.argmax(dim=-1)) == [2, 0]  # the fast path
    assert sample(logits, [greedy, other]) == [0, 0]
    assert sample(logits, [greedy, other]) == [1, 0] and not greedy.forced

    seeded, forced = (SamplingState.from_params(SamplingParams(temperature=1.0, seed=3)) for _ in range(2))
    forced.forced = deque([2])
    sample(logits[:1], [seeded])
    assert sample(logits[:1], [forced]) == [2]
    for _ in range(5):  # one draw each per token: the two streams stay in step
        assert sample(logits[:1], [seeded]) == sample(logits[:1], [forced])


async def _answer(engine: PagedEngine, prompt: list[int], params: SamplingParams) -> tuple[str, int]:
    text, num_tokens = "", 0
    async for output in engine.generate(GenerationRequest("r", prompt, params, eos_token_ids=frozenset())):
        text += output.text
        num_tokens += output.num_new_tokens
        if output.finished:
            return text, num_tokens
    raise AssertionError("no final output")


async def test_the_engine_closes_the_block_after_the_budgets_tokens(small_engine) -> None:  # type: ignore[no-untyped-def]
    paged, tokenizer = small_engine
    prompt = tokenizer.encode("The sea")
    thought, _ = await _answer(paged, prompt, SamplingParams(max_tokens=4, temperature=0.0))
    close = forced_end(END)
    num_close = len(tokenizer.encode(close, add_special_tokens=False))
    text, num_tokens = await _answer(paged, prompt, SamplingParams(max_tokens=20, temperature=0.0,
                                                                   thinking_budget=4))
    assert text.startswith(thought + close) and len(text) > len(thought + close), text
    assert text.count(END) == 1 and num_tokens == 20  # the thinking: the budget's 4 tokens, as greedy wrote them

    nothing, _ = await _answer(paged, prompt, SamplingParams(max_tokens=num_close + 2, temperature=0.0,
                                                             thinking_budget=0))
    assert nothing.startswith(close) and len(nothing) > len(close)
    thinking_off = prompt + tokenizer.encode(END, add_special_tokens=False)
    unbounded, _ = await _answer(paged, thinking_off, SamplingParams(max_tokens=8, temperature=0.0))
    assert (await _answer(paged, thinking_off, SamplingParams(max_tokens=8, temperature=0.0,
                                                              thinking_budget=1)))[0] == unbounded


async def test_the_grammar_shapes_the_answer_after_a_forced_close(small_engine) -> None:  # type: ignore[no-untyped-def]
    paged, tokenizer = small_engine
    prompt = tokenizer.encode("The sea")
    params = SamplingParams(max_tokens=30, temperature=0.0, regex="[0-9]{3}", grammar_param="guided_regex",
                            grammar_after=END, thinking_budget=3)
    free, _ = await _answer(paged, prompt, SamplingParams(max_tokens=3, temperature=0.0))
    text, _ = await _answer(paged, prompt, params)
    thought, _, answer = text.partition(forced_end(END))
    assert thought == free and re.fullmatch("[0-9]{3}", answer), text
    with pytest.raises(RequestRejected, match="thinking budget cannot be combined") as caught:
        await _answer(paged, prompt, SamplingParams(max_tokens=4, regex="[0-9]{3}", grammar_param="guided_regex",
                                                    thinking_budget=3))
    assert caught.value.param == "thinking_token_budget"
