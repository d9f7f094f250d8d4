"""A reasoning model's answer split into reasoning and content as it streams
(services/gateway/reasoning.py), and read for calls after (services/gateway/answer_reader.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.services.gateway.answer_reader import AnswerReader
from shoal.services.gateway.reasoning import ReasoningReader
from shoal.services.gateway.tool_call_parser import ToolCallReader
from shoal.services.gateway.tools import ToolPlan
from shoal.shared.model_settings import ReasoningParser


def _split(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reader = ReasoningReader(parser)
    reasoning, content = [], []
    for piece in pieces:
        r, c = reader.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = reader.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize(
    ("parser", "answer", "reasoning", "content"),
    [
        ("deepseek_r1", "Let me think.\n</think>\n\nIt is 4.", "Let me think.\n", "It is 4."),
        ("deepseek_r1", "<think>\nHmm</think>4", "Hmm", "4"),
        ("deepseek_r1", "Still thinking when cut", "Still thinking when cut", ""),
        ("deepseek_r1", "</think>Just the answer", "", "Just the answer"),
        ("deepseek_r1", "a < b </thin", "a < b </thin", ""),
        ("qwen3", "<think>\nCount: 2+2.\n</think>\n\nIt is 4.", "Count: 2+2.\n", "It is 4."),
        ("qwen3", "\n <think>x</think>y", "x", "y"),
        ("qwen3", "It is 4.", "", "It is 4."),
        ("qwen3", "It is 4. </think> no block opened", "", "It is 4. </think> no block opened"),
        ("qwen3", "<thin", "", "<thin"),
        ("qwen3", "<think>never closed", "never closed", ""),
        ("qwen3", "", "", ""),
    ],
)
def test_the_answer_splits_into_reasoning_and_content(parser: ReasoningParser, answer: str, reasoning: str,
                                                      content: str) -> None:
    assert _split(parser, [answer]) == (reasoning, content)


@settings(max_examples=200, deadline=None)
@given(parser=st.sampled_from(["deepseek_r1", "qwen3"]),
       answer=st.sampled_from(["<think>\nplan a < b</think>\n\nanswer </think>", "plan</think>answer",
                               "  <think>x</th</think>y<think>z", "no tags at all <"]),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_any_chunking_splits_as_the_whole_answer_does(parser: ReasoningParser, answer: str, cuts: list[int]) -> None:
    """Tags split across chunks at any place never leak into either part."""
    bounds = sorted({min(cut, len(answer)) for cut in cuts})
    pieces = [answer[a:b] for a, b in zip([0, *bounds], [*bounds, len(answer)], strict=True)]
    assert _split(parser, pieces) == _split(parser, [answer])


def test_calls_are_read_from_the_content_only() -> None:
    reader = AnswerReader(ReasoningReader("qwen3"), ToolCallReader(ToolPlan("auto")))
    answer = ('<think>I could write <tool_call>{"name": "no", "arguments": {}}</tool_call> here.</think>\n'
              'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    read = reader.feed(answer[:30]) + reader.feed(answer[30:])
    rest, finish_reason = reader.finish("stop")
    read += rest
    assert read.reasoning.startswith("I could write <tool_call>") and read.content.strip() == "Checking."
    (call,) = read.calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"zone": "UTC"})
    assert finish_reason == "tool_calls"


def test_without_a_parser_or_tools_text_passes_through() -> None:
    reader = AnswerReader()
    assert reader.passes_through
    assert reader.feed("<think>x</think>").content == "<think>x</think>"


@pytest.mark.parametrize(
    ("parser", "chunks", "num_reasoning_tokens"),
    [
        ("deepseek_r1", ["plan", " more", "</think>", "answer"], 3),   # the closing chunk is the thinking's
        ("deepseek_r1", ["<", "think>", "x", "</think>", "y"], 4),     # undecided chunks count once it thinks
        ("deepseek_r1", ["<"], 1),                                     # cut while undecided: all reasoning
        ("qwen3", ["<th", "ink>x", "</think>", "y", "z"], 3),
        ("qwen3", ["<", "b>", "hi"], 0),                               # no think block: no reasoning
        ("qwen3", ["Hi"], 0),
    ],
)
def test_reasoning_tokens_are_those_of_the_chunks_that_came_while_thinking(
        parser: ReasoningParser, chunks: list[str], num_reasoning_tokens: int) -> None:
    reader = ReasoningReader(parser)
    for chunk in chunks:
        reader.feed(chunk, num_tokens=1)
    reader.finish()
    assert reader.num_reasoning_tokens == num_reasoning_tokens


@pytest.mark.parametrize(
    ("parser", "continued", "answer", "reasoning", "content"),
    [
        ("deepseek_r1", "Let me see.</think>", "It is 4.", "", "It is 4."),        # the block closed in the prefix
        ("deepseek_r1", "Let me see", " more</think>4", " more", "4"),            # R1: a prefix is thinking
        ("qwen3", "<think>Count", " 2+2</think>4", " 2+2", "4"),                   # an open block
        ("qwen3", "<think>\nCount 2+2.</think>", "\n\n4", "", "4"),                # blanks after a tag dropped
        ("qwen3", "The answer:", " 4", "", " 4"),                                  # qwen3: no block, content
        ("qwen3", "", "<think>x</think>y", "x", "y"),                               # an empty prefix decides nothing
    ],
)
def test_an_answer_that_goes_on_with_a_message_starts_where_the_message_left_off(
        parser: ReasoningParser, continued: str, answer: str, reasoning: str, content: str) -> None:
    reader = ReasoningReader(parser, continued)
    r, c = reader.feed(answer, num_tokens=3)
    r2, c2 = reader.finish()
    assert (r + r2, c + c2) == (reasoning, content)
    assert (reader.num_reasoning_tokens > 0) == bool(reasoning)
