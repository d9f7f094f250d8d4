"""Function calling at the gateway: a request's tools and tool_choice (services/gateway/tools.py),
and a choice's text read into content and calls (services/gateway/tool_call_parser.py)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import ChatCompletionRequest, decode_body
from shoal.services.gateway.tool_call_parser import ToolCallReader
from shoal.services.gateway.tools import ToolPlan, forced, tool_plan, tool_specs
from shoal.shared.messages import SamplingParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _request(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields
    request = decode_body(msgspec.json.encode(body), ChatCompletionRequest)
    assert isinstance(request, ChatCompletionRequest)
    return request


def _read(plan: ToolPlan, pieces: list[str], finish_reason: str = "stop") -> tuple[str, list[tuple[str, Any]], str]:
    """Feed `pieces` one by one; (all content, [(name, arguments as a value)], finish reason)."""
    reader = ToolCallReader(plan)
    content, calls = [], []
    for piece in pieces:
        text, new_calls = reader.feed(piece)
        content.append(text)
        calls += new_calls
    text, new_calls, reason = reader.finish(finish_reason)
    content.append(text)
    calls += new_calls
    assert len({call.id for call in calls}) == len(calls), "every call has its own id"
    assert all(call.id.startswith("call_") for call in calls)
    return "".join(content), [(call.function.name, json.loads(call.function.arguments)) for call in calls], reason


def _characters(text: str) -> list[str]:
    return list(text)


# --------------------------------------------------------------------------- the request


def test_no_tools_means_no_plan_and_a_forcing_choice_without_tools_is_400() -> None:
    assert tool_plan(_request()) is None and tool_specs(_request()) is None
    assert tool_plan(_request(tool_choice="none")) is None and tool_plan(_request(tool_choice="auto")) is None
    with pytest.raises(BadRequest) as raised:
        tool_plan(_request(tool_choice="required"))
    assert raised.value.param == "tool_choice"


def test_tools_default_to_auto_and_keep_their_definitions() -> None:
    request = _request(tools=[WEATHER, TIME])
    assert tool_plan(request) == ToolPlan("auto", parallel=True)
    assert tool_plan(request, "llama3_json") == ToolPlan("auto", parallel=True, format="llama3_json")
    specs = tool_specs(request)
    assert specs is not None and [spec.name for spec in specs] == ["get_weather", "get_time"]
    assert specs[0].description == "Weather in a city" and specs[0].parameters == WEATHER["function"]["parameters"]
    assert specs[1].parameters is None
    assert tool_plan(_request(tools=[WEATHER], tool_choice="none", parallel_tool_calls=False)) == ToolPlan(
        "none", parallel=False)


def test_a_named_choice_must_name_one_of_the_tools() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    assert tool_plan(_request(tools=[WEATHER, TIME], tool_choice=named)) == ToolPlan("named", True, "get_time")
    with pytest.raises(BadRequest) as raised:
        tool_plan(_request(tools=[WEATHER], tool_choice=named))
    assert raised.value.param == "tool_choice" and "get_time" in raised.value.message


def test_two_functions_of_one_name_are_400() -> None:
    with pytest.raises(BadRequest) as raised:
        tool_specs(_request(tools=[WEATHER, WEATHER]))
    assert raised.value.param == "tools" and "get_weather" in raised.value.message


def test_required_forces_an_array_of_calls_and_named_forces_the_arguments() -> None:
    request = _request(tools=[WEATHER, TIME], tool_choice="required")
    params = forced(SamplingParams(), tool_plan(request), request)
    assert params.grammar_param == "tools" and params.json_schema is not None  # errors blame the schemas
    schema = json.loads(params.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    weather, time_ = schema["items"]["anyOf"]
    assert weather["properties"]["name"] == {"const": "get_weather"}
    assert weather["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert time_["properties"]["arguments"] == {"type": "object", "properties": {}}  # no parameters: none

    one = _request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(forced(SamplingParams(), tool_plan(one), one).json_schema or "")["maxItems"] == 1

    named = _request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(forced(SamplingParams(), tool_plan(named), named).json_schema or "") == \
        WEATHER["function"]["parameters"]


def test_auto_and_none_leave_the_sampling_free_and_forcing_with_response_format_is_400() -> None:
    for choice in ("auto", "none"):
        request = _request(tools=[WEATHER], tool_choice=choice)
        assert forced(SamplingParams(), tool_plan(request), request) == SamplingParams()
    request = _request(tools=[WEATHER], tool_choice="required")
    with pytest.raises(BadRequest) as raised:
        forced(SamplingParams(json_schema='{"type": "object"}'), tool_plan(request), request)
    assert raised.value.param == "response_format"


# --------------------------------------------------------------------------- the answer

QWEN_STYLE = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("split", [lambda t: [t], _characters, lambda t: [t[i:i + 7] for i in range(0, len(t), 7)]])
def test_hermes_calls_are_read_out_of_the_text_however_it_is_split(split: Any) -> None:
    content, calls, reason = _read(ToolPlan("auto"), split(QWEN_STYLE))
    assert content == "I will look it up.\n"
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert reason == "tool_calls"


def test_content_streams_at_once_but_a_possible_tag_start_is_held_back() -> None:
    reader = ToolCallReader(ToolPlan("auto"))
    assert reader.feed("Hello <b> world <tool") == ("Hello <b> world ", [])
    assert reader.feed("box>") == ("<toolbox>", [])  # not the tag after all: given out
    assert reader.feed("a < b <") == ("a < b ", [])
    assert reader.finish("stop") == ("<", [], "stop")  # the end: nothing more can follow


def test_plain_text_passes_through_with_its_finish_reason() -> None:
    assert _read(ToolPlan("auto"), _characters("No tools needed, 1 < 2.")) == ("No tools needed, 1 < 2.", [], "stop")
    assert _read(ToolPlan("auto"), ["cut off"], "length") == ("cut off", [], "length")


def test_a_block_that_is_not_a_call_stays_in_the_content() -> None:
    text = "<tool_call>\nnot json\n</tool_call> and <tool_call>{\"no_name\": 1}</tool_call>"
    assert _read(ToolPlan("auto"), _characters(text)) == (text, [], "stop")


def test_an_unclosed_block_is_a_call_when_its_json_is_whole_else_content() -> None:
    whole = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
    assert _read(ToolPlan("auto"), [whole]) == ("", [("get_time", {"tz": "UTC"})], "tool_calls")
    cut = '<tool_call>\n{"name": "get_time", "argu'
    assert _read(ToolPlan("auto"), [cut], "length") == (cut, [], "length")


def test_arguments_as_a_string_or_as_parameters_are_read_and_sent_as_json_text() -> None:
    text = ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
            '<tool_call>{"name": "b", "parameters": {"y": "é"}}</tool_call>')
    reader = ToolCallReader(ToolPlan("auto"))
    _, calls = reader.feed(text)
    assert [(c.function.name, c.function.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", '{"y": "é"}')]


@pytest.mark.parametrize("split", [lambda t: [t], _characters])
def test_text_after_a_call_is_content_less_the_leading_whitespace(split: Any) -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n \nand then'
    assert _read(ToolPlan("auto"), split(text), "length") == ("and then", [("a", {})], "length")


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    content, calls, reason = _read(ToolPlan("auto", parallel=False), _characters(QWEN_STYLE))
    assert calls == [("get_weather", {"city": "Paris"})] and reason == "tool_calls"
    assert content == "I will look it up.\n", "the later call is dropped, not turned into content"


def test_required_answers_are_read_when_the_choice_ends() -> None:
    reader = ToolCallReader(ToolPlan("required"))
    answer = '[{"name": "get_weather", "arguments": {"city":\n "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    assert reader.feed(answer) == ("", [])
    content, calls, reason = reader.finish("stop")
    assert content == "" and reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]


def test_a_named_answer_is_the_functions_arguments() -> None:
    content, calls, reason = _read(ToolPlan("named", function="get_time"), _characters('{"tz" :  "CET"}'))
    assert (content, calls, reason) == ("", [("get_time", {"tz": "CET"})], "tool_calls")


@pytest.mark.parametrize(("plan", "text", "calls"), [
    (ToolPlan("required"), '[{"name": "get_weather", "arguments": {"ci', [("get_weather", '{"ci')]),
    (ToolPlan("required"), '[{"name":"get_time","arguments":{}} , {"name": "get_weather", "arguments": {"city": "Ro',
     [("get_time", "{}"), ("get_weather", '{"city": "Ro')]),
    (ToolPlan("required"), '[ {"name":"get_time","arguments":{}},\n {"na', [("get_time", "{}")]),
    (ToolPlan("named", function="get_time"), '{"tz": "CE', [("get_time", '{"tz": "CE')]),
    (ToolPlan("named", function="get_time"), "", [("get_time", "")]),
])
def test_a_forced_answer_cut_short_is_the_calls_begun(plan: ToolPlan, text: str, calls: list[tuple[str, str]]) -> None:
    """As OpenAI and vLLM answer at max_tokens: every whole call, then the one cut, its
    arguments as far as they came (LangChain reports it as an invalid call, not as no call)."""
    reader = ToolCallReader(plan)
    assert reader.feed(text) == ("", [])
    content, made, reason = reader.finish("length")
    assert (content, [(c.function.name, c.function.arguments) for c in made], reason) == ("", calls, "length")


@pytest.mark.parametrize(("plan", "text"), [
    (ToolPlan("required"), "[]"),
    (ToolPlan("required"), '{"name": "get_time"}'),
    (ToolPlan("required"), '[{"nam'),
    (ToolPlan("named", function="get_time"), "[1]"),
])
def test_a_forced_answer_that_begins_no_call_is_the_content(plan: ToolPlan, text: str) -> None:
    assert _read(plan, [text], "length") == (text, [], "length")


LLAMA = ToolPlan("auto", format="llama3_json")


@pytest.mark.parametrize("split", [lambda t: [t], _characters])
def test_llama3_calls_are_read_when_the_answer_starts_with_an_object(split: Any) -> None:
    text = ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    reader = ToolCallReader(LLAMA)
    assert all(reader.feed(piece) == ("", []) for piece in split(text)), "calls come when the answer ends"
    content, calls, reason = reader.finish("stop")
    assert content == "" and reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_a_llama3_answer_in_words_streams_as_content() -> None:
    reader = ToolCallReader(LLAMA)
    assert reader.feed("  ") == ("", [])  # the first non-blank character decides
    assert reader.feed("It is {sunny}") == ("  It is {sunny}", [])
    assert reader.feed(' {"name": "f", "parameters": {}}') == (' {"name": "f", "parameters": {}}', [])
    assert reader.finish("stop") == ("", [], "stop")


@pytest.mark.parametrize("text", ['{"name": "f", "parameters": {"x"', '{"answer": 42}', '{"name": "f"} trailing words'])
def test_a_llama3_object_that_is_not_calls_is_the_content(text: str) -> None:
    assert _read(LLAMA, _characters(text), "length") == (text, [], "length")


def test_llama3_without_parallel_calls_keeps_the_first() -> None:
    plan = ToolPlan("auto", parallel=False, format="llama3_json")
    text = '{"name": "a", "parameters": {}};{"name": "b", "parameters": {}}'
    assert _read(plan, [text]) == ("", [("a", {})], "tool_calls")


MISTRAL = ToolPlan("auto", format="mistral")
PYTHONIC = ToolPlan("auto", format="pythonic")


@pytest.mark.parametrize("split", [lambda t: [t], _characters])
def test_mistral_calls_are_a_json_array_read_when_the_answer_ends(split: Any) -> None:
    text = ' [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    assert _read(MISTRAL, split(text)) == ("", [("get_weather", {"city": "Paris"}), ("get_time", {})], "tool_calls")


@pytest.mark.parametrize("text", ['[{"name": "f", "arguments": {"x"', "[1, 2]", "[]", '[{"name": "f"}] and words'])
def test_a_mistral_array_that_is_not_calls_is_the_content(text: str) -> None:
    assert _read(MISTRAL, _characters(text), "length") == (text, [], "length")


@pytest.mark.parametrize("split", [lambda t: [t], _characters])
def test_pythonic_calls_are_parsed_never_run(split: Any) -> None:
    text = '[get_weather(city="Paris", days=[1, 2], exact=True, note=None), get_time()]'
    assert _read(PYTHONIC, split(text)) == (
        "", [("get_weather", {"city": "Paris", "days": [1, 2], "exact": True, "note": None}), ("get_time", {})],
        "tool_calls")


@pytest.mark.parametrize("text", [
    '[get_weather("Paris")]',                   # positional: no argument names
    '[get_weather(city=open("/etc/passwd"))]',  # not a literal: never evaluated
    "[f(**kwargs)]", "[obj.method(a=1)]", "[f(a=1e999)]", "[f(a={1, 2})]", "[1, 2]", "[f(a=1)", "[" * 500 + "]" * 500,
])
def test_a_pythonic_list_that_is_not_literal_calls_is_the_content(text: str) -> None:
    assert _read(PYTHONIC, [text]) == (text, [], "stop")


def test_a_pythonic_answer_in_words_streams_as_content() -> None:
    reader = ToolCallReader(PYTHONIC)
    assert reader.feed("It is [sunny]") == ("It is [sunny]", [])
    assert reader.finish("stop") == ("", [], "stop")
