"""Chat requests rendered by the model's chat template (services/worker/prompts.py), tools and
tool turns included, on the demo models' real tokenizer and template."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from transformers import AutoTokenizer

from shoal.services.worker.generation import RequestRejected
from shoal.services.worker.prompts import (
    NUM_KEPT_FIRST_TOKENS,
    chat_prompt,
    prompt_budget,
    prompt_chars,
    prompt_token_ids,
    truncated,
)
from shoal.shared.messages import ChatMessage, InferenceRequest, SamplingParams, ToolCall, ToolSpec

WEATHER = ToolSpec("get_weather", "Weather in a city",
                   {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


@pytest.fixture(scope="module")
def tokenizer(demo_models_root: Path) -> object:
    return AutoTokenizer.from_pretrained(demo_models_root / "demo" / "qwen2-25m")


def _request(messages: list[ChatMessage], tools: list[ToolSpec] | None = None) -> InferenceRequest:
    return InferenceRequest("r1", "demo/qwen2-25m", SamplingParams(), 0.0, "reply", messages=messages, tools=tools)


def test_a_conversation_without_tools_is_plain_chatml(tokenizer: object) -> None:
    text = chat_prompt(tokenizer, _request([ChatMessage("system", "Be brief."), ChatMessage("user", "hi")]))
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tools_are_listed_in_the_system_turn(tokenizer: object) -> None:
    text = chat_prompt(tokenizer, _request([ChatMessage("system", "Be brief."), ChatMessage("user", "Paris?")],
                                           [WEATHER, ToolSpec("get_time")]))
    system, user, assistant = text.split("<|im_start|>")[1:]
    assert system.startswith("system\nBe brief.\n\n# Tools")
    assert ('{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", '
            '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
            ) in system
    assert '{"name": "get_time", "parameters": {"type": "object", "properties": {}}}' in system
    assert "<tool_call>" in system and user == "user\nParis?<|im_end|>\n" and assistant == "assistant\n"


def test_past_calls_and_their_results_are_rendered_as_the_model_writes_and_reads_them(tokenizer: object) -> None:
    messages = [
        ChatMessage("user", "Weather in Paris and Oslo?"),
        ChatMessage("assistant", "", tool_calls=[ToolCall("c1", "get_weather", '{"city": "Paris"}'),
                                                 ToolCall("c2", "get_weather", "not json")]),
        ChatMessage("tool", "12C", tool_call_id="c1"),
        ChatMessage("tool", "3C", tool_call_id="c2"),
    ]
    text = chat_prompt(tokenizer, _request(messages, [WEATHER]))
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": not json}\n</tool_call><|im_end|>\n'
            ) in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n12C\n</tool_response>\n<tool_response>\n3C\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert prompt_chars(_request(messages)) == len("Weather in Paris and Oslo?") + len('{"city": "Paris"}') + \
        len("not json") + len("12C") + len("3C")


def test_tools_for_a_template_that_ignores_them_are_400_naming_tools(tokenizer: object) -> None:
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(RequestRejected) as raised:
        chat_prompt(plain, _request([ChatMessage("user", "hi")], [WEATHER]))
    assert raised.value.param == "tools"
    assert chat_prompt(plain, _request([ChatMessage("user", "hi")])) == "hi"


@pytest.mark.parametrize(("keep", "side", "max_model_len", "expected"), [
    (None, "left", 4, [1, 2, 3, 4, 5, 6]),           # no cut asked: the engine refuses what is too long
    (3, "left", None, [4, 5, 6]),                    # vLLM's: the latest tokens stay
    (3, "right", None, [1, 2, 3]),                   # Ollama's embeddings: the start stays
    (-1, "left", 4, [4, 5, 6]),                      # the context, with room for one more token
    (-1, "right", 4, [1, 2, 3]),
    (-1, "left", None, [1, 2, 3, 4, 5, 6]),
    (10, "left", 4, [1, 2, 3, 4, 5, 6]),             # shorter than asked: as it is
])
def test_a_prompt_is_cut_as_truncate_prompt_tokens_asks(keep: int | None, side: str, max_model_len: int | None,
                                                        expected: list[int]) -> None:
    params = SamplingParams(truncate_prompt_tokens=keep, truncation_side=side)  # type: ignore[arg-type]
    assert truncated([1, 2, 3, 4, 5, 6], params, max_model_len) == expected


def test_a_conversation_too_long_loses_as_few_of_its_oldest_messages_as_make_it_fit(tokenizer: object) -> None:
    """Ollama's truncation (``fit_context``): system messages and the last one stay; the
    oldest others go, no more than needed to leave room to answer (`prompt_budget`)."""
    turns = [ChatMessage("user" if i % 2 == 0 else "assistant", f"turn {i}: " + "the tide comes in " * 3)
             for i in range(21)]
    messages = [ChatMessage("system", "Be brief."), *turns]
    params = SamplingParams(fit_context=True)
    request = InferenceRequest("r1", "demo/qwen2-25m", params, 0.0, "reply", messages=messages)
    whole = prompt_token_ids(tokenizer, request)  # type: ignore[arg-type]
    limit = len(whole) // 2
    budget = prompt_budget(params, limit)
    assert budget == limit - 16  # room for max_tokens
    fitted = prompt_token_ids(tokenizer, request, max_model_len=limit)  # type: ignore[arg-type]
    assert len(fitted) <= budget

    def rendered(kept: list[ChatMessage]) -> list[int]:
        text = chat_prompt(tokenizer, _request(kept))
        return list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]

    dropped = next(n for n in range(len(turns)) if rendered([messages[0], *turns[n:]]) == fitted)
    assert 0 < dropped < len(turns) - 1  # the system message and the last turn kept
    assert turns[dropped].role == "user"  # what is kept starts with a user's turn (alternating templates)
    assert len(rendered([messages[0], *turns[dropped - 2:]])) > budget  # one turn fewer dropped would not fit
    unfitted = msgspec.structs.replace(request, params=SamplingParams())
    assert prompt_token_ids(tokenizer, unfitted, max_model_len=limit) == whole  # type: ignore[arg-type]


@pytest.mark.parametrize(("max_tokens", "max_model_len", "budget"), [
    (16, 100, 84),        # room for the answer asked for
    (1 << 30, 100, 75),   # "until the context ends" (Ollama's default): a quarter of it
    (1, 100, 99),
    (0, 100, 99),         # room for one token at least
    (16, 1, 1),
])
def test_a_fitted_prompt_leaves_room_for_max_tokens_up_to_a_quarter_of_the_context(
        max_tokens: int, max_model_len: int, budget: int) -> None:
    assert prompt_budget(SamplingParams(max_tokens=max_tokens), max_model_len) == budget


@pytest.mark.parametrize(("max_tokens", "max_model_len", "expected"), [
    (2, 8, [1, 2, 3, 4, 9, 10]),    # its first 4 tokens and its latest, 8 - 2 in all
    (99, 8, [1, 2, 3, 4, 9, 10]),   # a quarter of the context: room for 2
    (99, 2, [10]),
    (2, 12, list(range(1, 11))),    # short enough: as it is
    (2, None, list(range(1, 11))),
])
def test_a_prompt_fitted_to_the_context_keeps_its_first_tokens_and_its_latest(
        max_tokens: int, max_model_len: int | None, expected: list[int]) -> None:
    params = SamplingParams(max_tokens=max_tokens, fit_context=True)
    assert truncated(list(range(1, 11)), params, max_model_len) == expected


def test_a_message_or_prompt_too_long_alone_loses_its_start_but_the_templates_opening(tokenizer: object) -> None:
    """Ollama's truncation of what dropping messages cannot fit: the prompt's first
    `NUM_KEPT_FIRST_TOKENS` and its latest tokens, room left to answer; a prompt that fits, or
    a request that does not ask, is as it was."""
    text = " ".join(f"word{i}" for i in range(400))
    params = SamplingParams(max_tokens=8, fit_context=True)
    chat = InferenceRequest("r1", "demo/qwen2-25m", params, 0.0, "reply",
                            messages=[ChatMessage("system", "Be brief."), ChatMessage("user", text)])
    completion = msgspec.structs.replace(chat, messages=None, prompt=text)
    for request in (chat, completion):
        whole = prompt_token_ids(tokenizer, msgspec.structs.replace(request, params=SamplingParams()))  # type: ignore[arg-type]
        fitted = prompt_token_ids(tokenizer, request, max_model_len=200)  # type: ignore[arg-type]
        assert len(whole) > 200 and len(fitted) == 200 - 8
        assert fitted == whole[:NUM_KEPT_FIRST_TOKENS] + whole[-(200 - 8 - NUM_KEPT_FIRST_TOKENS):]
        assert prompt_token_ids(tokenizer, request, max_model_len=len(whole) + 8) == whole  # type: ignore[arg-type]
    opening = tokenizer.decode(prompt_token_ids(tokenizer, chat, max_model_len=200)[:NUM_KEPT_FIRST_TOKENS])  # type: ignore[arg-type, attr-defined]
    assert opening.startswith("<|im_start|>system\n")
