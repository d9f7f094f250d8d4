"""Anthropic's Messages requests read as the OpenAI chat requests of the same meaning."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from shoal.services.gateway.anthropic_api import (
    CountTokensRequest,
    MessagesRequest,
    ModelInfo,
    ModelPageQuery,
    chat_request,
    model_page,
    shows_thinking,
    stop_reason,
    stop_sequences,
    tool_use_id,
)
from shoal.services.gateway.errors import ApiError, BadRequest, Unavailable, anthropic_error
from shoal.services.gateway.openai_api import FunctionCall, ToolCallOut

TOOL = {"name": "get_time", "description": "The time", "input_schema": {"type": "object", "properties": {}}}


def _chat(**fields: Any) -> dict[str, Any]:
    body = msgspec.convert({"model": "m", "max_tokens": 5, **fields}, MessagesRequest)
    return msgspec.to_builtins(chat_request(body, None))


def test_blocks_keep_their_order_as_messages() -> None:
    chat = _chat(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}], messages=[
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "they want the time", "signature": "x"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "12:00"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no zone", "is_error": True},
            {"type": "text", "text": "And in Paris?", "cache_control": {"type": "ephemeral"}}]}])
    assert [(m["role"], m.get("content")) for m in chat["messages"]] == [
        ("system", "Be brief.\n\nBe kind."), ("user", "Time?"), ("assistant", "Let me look."),
        ("tool", "12:00"), ("tool", "Error: no zone"), ("user", "And in Paris?")]
    call = chat["messages"][2]["tool_calls"][0]
    assert (call["id"], call["function"]) == ("toolu_1", {"name": "get_time", "arguments": '{"zone": "UTC"}'})
    assert [m.get("tool_call_id") for m in chat["messages"][3:5]] == ["toolu_1", "toolu_2"]
    assert chat["max_tokens"] == 5 and chat["stream"] is False and not chat["continue_final_message"]


def test_blocks_a_text_model_can_read_are_read_and_those_in_tool_results_it_cannot_are_named() -> None:
    """A tool that read an image stays in the history: its result says the image was left
    out (a 400 would fail every later turn); documents and search results given as text are text."""
    chat = _chat(messages=[
        {"role": "user", "content": [
            {"type": "document", "title": "Notes", "source": {"type": "text", "media_type": "text/plain",
                                                              "data": "The tide is high."}},
            {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Part A."},
                                                                           {"type": "text", "text": "Part B."}]}},
            {"type": "search_result", "title": "Tides", "source": "https://example.org/tides",
             "content": [{"type": "text", "text": "Twice a day."}]},
            {"type": "text", "text": "Summarize."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {"p": "a.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "Read a.png:"}, {"type": "image", "source": {"type": "base64", "data": "iVBO"}},
            {"type": "tool_reference", "tool_name": "read"}]}]}])
    assert chat["messages"][0]["content"] == ("Notes\n\nThe tide is high.\n\nPart A.\n\nPart B.\n\n"
                                              "Tides\nhttps://example.org/tides\nTwice a day.\n\nSummarize.")
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "t1", "name": None, "tool_calls": None,
                                   "content": "Read a.png:\n\n[image left out: this model reads text only]"}


def test_neighbouring_turns_of_one_role_are_one_message() -> None:
    """As Anthropic combines them; a turn whose thinking alone was dropped leaves none behind."""
    chat = _chat(messages=[
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
                                     {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""}]},
        {"role": "user", "content": "Still there?"},
        {"role": "assistant", "content": []}, {"role": "assistant", "content": "Yes."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "done"}]},
        {"role": "user", "content": "Thanks"}])
    assert [(m["role"], m["content"]) for m in chat["messages"]] == [
        ("user", "<system-reminder>be brief</system-reminder>\n\nHi\n\nStill there?"), ("assistant", "Yes."),
        ("tool", "done"), ("user", "Thanks")]  # a tool result is never merged into a user's turn
    assert chat["messages"][1]["tool_calls"][0]["id"] == "t"  # text, then its calls: one assistant turn


def test_a_last_assistant_turn_is_continued() -> None:
    chat = _chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}])
    assert chat["continue_final_message"] is True and chat["messages"][-1] == {"role": "assistant", "content": "Hel",
                                                                               "name": None, "tool_calls": None,
                                                                               "tool_call_id": None}


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, ("auto", None)),
    ({"type": "any"}, ("required", None)),
    ({"type": "none"}, ("none", None)),
    ({"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
     ({"type": "function", "function": {"name": "get_time"}}, False)),
])
def test_tool_choices(choice: dict[str, Any], expected: tuple[Any, bool | None]) -> None:
    long_name = {**TOOL, "name": "mcp__filesystem_server__" + "x" * 90}  # Anthropic takes names of 128
    assert _chat(messages=[{"role": "user", "content": "x"}], tools=[long_name] * 200)["tools"][0]["function"][
        "name"] == long_name["name"]
    chat = _chat(messages=[{"role": "user", "content": "Time?"}], tools=[TOOL], tool_choice=choice)
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == expected
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_time", "description": "The time", "parameters": TOOL["input_schema"], "strict": None}}]


def test_sampling_thinking_and_output_config() -> None:
    chat = _chat(messages=[{"role": "user", "content": "Hi"}], temperature=0.5, top_k=3, top_p=0.9, stream=True,
                 metadata={"user_id": "u1"}, output_config={"effort": "xhigh", "format": {
                     "type": "json_schema", "schema": {"type": "object"}}})
    assert (chat["temperature"], chat["top_k"], chat["top_p"], chat["stream"], chat["user"]) == (0.5, 3, 0.9, True, "u1")
    assert chat["reasoning_effort"] == "high"
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output",
                                                                             "schema": {"type": "object"}}}

    def thinking(value: dict[str, Any] | None, reasoning: Any = "qwen3") -> tuple[dict[str, Any] | None, bool]:
        body = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                **({"thinking": value} if value else {})}, CountTokensRequest)
        return chat_request(body, reasoning).chat_template_kwargs, shows_thinking(body.thinking)

    # As Anthropic's models: no thinking unless asked for, and no thinking blocks then
    assert thinking(None) == ({"enable_thinking": False}, False)
    assert thinking({"type": "disabled"}) == ({"enable_thinking": False}, False)
    assert thinking({"type": "enabled", "budget_tokens": 2048}) == ({"enable_thinking": True}, True)
    assert thinking({"type": "adaptive", "display": "omitted"}) == ({"enable_thinking": True}, False)
    assert thinking({"type": "enabled"}, reasoning=None) == (None, True)  # a model that does not think: nothing to set
    # DeepSeek-R1's reader wants the block opened: it is never told not to think, its thinking is hidden
    assert thinking(None, reasoning="deepseek_r1") == (None, False)
    assert thinking({"type": "enabled"}, reasoning="deepseek_r1") == ({"enable_thinking": True}, True)
    beta = _chat(messages=[{"role": "user", "content": "Hi"}],
                 output_format={"type": "json_schema", "schema": {"type": "array"}})
    assert beta["response_format"]["json_schema"]["schema"] == {"type": "array"}
    stops = msgspec.convert({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                             "stop_sequences": ["a", "", "b", "c", "d", "e"]}, MessagesRequest)
    assert stop_sequences(stops) == ["a", "b", "c", "d", "e"]  # more than /v1's 4


@pytest.mark.parametrize(("messages", "tools", "says"), [
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], None, "image blocks are not supported"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}], None,
     "a user message cannot hold a 'tool_use' block"),
    ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}], None,
     "an assistant message cannot hold a 'tool_result' block"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}], None, "needs its id"),
    ([{"role": "user", "content": [{"type": "document", "source": {"type": "base64", "data": "JVBER"}}]}], None,
     "document blocks are not supported"),
    ([{"role": "user", "content": [{"type": "server_tool_use", "id": "s"}]}], None, "cannot hold a 'server_tool_use'"),
    ([{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}], None, "nothing to answer"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "tool_use", "id": "x"}]}]}], None, "a 'tool_use' block cannot be here"),
    ([{"role": "user", "content": "x"}], [{"type": "bash_20250124", "name": "bash"}], "one of Anthropic's own"),
])
def test_what_cannot_be_served_is_a_400_naming_it(messages: list[Any], tools: list[Any] | None, says: str) -> None:
    with pytest.raises(BadRequest) as caught:
        _chat(messages=messages, **({"tools": tools} if tools else {}))
    assert says in caught.value.message


def test_answers_in_anthropics_terms() -> None:
    assert [stop_reason(f, s) for f, s in [("stop", None), ("stop", "END"), ("length", None), ("tool_calls", None)]
            ] == ["end_turn", "stop_sequence", "max_tokens", "tool_use"]
    call = ToolCallOut("call_abc", FunctionCall("f", '{"a": 1}'))
    assert (tool_use_id(call), call.arguments_object()) == ("toolu_abc", {"a": 1})
    assert ToolCallOut("call_x", FunctionCall("f", "[1]")).arguments_object() == {"arguments": "[1]"}
    assert msgspec.to_builtins(anthropic_error(Unavailable("busy"))) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    assert anthropic_error(ApiError("boom")).error.type == "api_error"


def test_model_pages_go_after_and_before_an_id() -> None:
    models = [ModelInfo(f"m{i}", f"m{i}", "2026-01-01T00:00:00Z") for i in range(5)]

    def ids(**query: Any) -> tuple[list[str], bool]:
        page = model_page(models, msgspec.convert(query, ModelPageQuery))
        assert (page.first_id, page.last_id) == ((page.data[0].id, page.data[-1].id) if page.data else (None, None))
        return [model.id for model in page.data], page.has_more

    assert ids() == (["m0", "m1", "m2", "m3", "m4"], False)
    assert ids(limit=2) == (["m0", "m1"], True)
    assert ids(limit=2, after_id="m1") == (["m2", "m3"], True)
    assert ids(limit=2, after_id="m3") == (["m4"], False)
    assert ids(limit=2, before_id="m3") == (["m1", "m2"], True)
    assert ids(limit=2, before_id="m1") == (["m0"], False)
    assert ids(after_id="gone") == ([], False)
