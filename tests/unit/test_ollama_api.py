"""Ollama's API bodies at the gateway (services/gateway/ollama_api.py): each request rewritten
as the OpenAI request of the same meaning, what Shoal cannot honour refused naming it, and
the model listing's fields (routes_ollama_models.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.ollama_api import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    chat_request,
    embed_request,
    generate_request,
    keep_alive_s,
    stop_strings,
)
from shoal.services.gateway.openai_api import (
    UNLIMITED_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    decode_body,
    json_schema_of,
    sampling_params,
)
from shoal.services.gateway.routes_ollama_models import _family, _parameter_size


def _decode(schema: type[Any], **fields: Any) -> Any:
    return decode_body(json.dumps({"model": "m", **fields}).encode(), schema)


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), (0, 0), ("0", 0.0), (300, 300), ("300", 300.0), ("5m", 300.0), ("1h30m", 5400.0),
    ("-1", -1.0), ("-1m", -60.0), ("1.5s", 1.5), ("250ms", 0.25), ("10us", 1e-5), ("0s", 0.0),
])
def test_keep_alive_is_seconds_or_a_go_duration(value: Any, seconds: float | None) -> None:
    assert keep_alive_s(value) == pytest.approx(seconds) if seconds is not None else keep_alive_s(value) is None


@pytest.mark.parametrize("value", ["", "soon", "5 m", "5x", "m5", "1h-30m", "--1", "inf", "nan"])
def test_a_keep_alive_that_is_no_duration_is_a_400(value: str) -> None:
    with pytest.raises(BadRequest) as caught:
        keep_alive_s(value)
    assert caught.value.param == "keep_alive" and repr(value) in caught.value.message


def test_chat_options_become_the_sampling_fields_they_mean() -> None:
    body = _decode(ChatRequest, messages=[{"role": "user", "content": "hi"}], options={
        "temperature": 0.3, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 7, "num_predict": 12,
        "stop": ["\n\n"], "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25,
        "num_ctx": 8192, "num_thread": 4, "repeat_last_n": 64, "mirostat": 0, "typical_p": 1.0,
        "some_future_option": True})
    chat = chat_request(body, None)
    params = sampling_params(chat, chat.max_tokens, 16)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (0.3, 0.9, 20, 0.05, 7)
    assert (params.max_tokens, params.stop, params.repetition_penalty) == (12, ["\n\n"], 1.1)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, 0.25)
    assert chat.stream is True  # Ollama streams unless told not to


@pytest.mark.parametrize("num_predict", [None, -1, -2])
def test_no_num_predict_generates_until_the_context_is_full(num_predict: int | None) -> None:
    options = {} if num_predict is None else {"num_predict": num_predict}
    body = _decode(GenerateRequest, prompt="x", options=options, stream=False)
    assert generate_request(body, None).max_tokens == UNLIMITED_MAX_TOKENS


@pytest.mark.parametrize("options", [{"mirostat": 2}, {"tfs_z": 0.9}, {"typical_p": 0.5, "mirostat_eta": 0.2}])
def test_sampling_steps_shoal_lacks_are_ignored_as_current_ollama_ignores_them(options: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "hi"}]
    plain = sampling_params(chat_request(_decode(ChatRequest, messages=messages), None), None, 16)
    assert sampling_params(chat_request(_decode(ChatRequest, messages=messages, options=options), None),
                           None, 16) == plain


def test_option_values_ollama_takes_are_clamped_to_what_the_sampler_takes() -> None:
    """Ollama bounds no option: a value past Shoal's bounds samples as the nearest it takes,
    integers may come as floats, and -1 seeds, 0 predictions and 0 penalties mean "none"."""
    body = _decode(ChatRequest, messages=[{"role": "user", "content": "hi"}], options={
        "temperature": 7, "top_k": 40.0, "seed": -1, "num_predict": 0, "repeat_penalty": 0,
        "presence_penalty": 3.5, "min_p": 1.5, "stop": ["", "a", "b", "c", "d", "e"]})
    chat = chat_request(body, None)
    params = sampling_params(chat, chat.max_tokens, 16)
    assert (params.temperature, params.top_k, params.seed, params.max_tokens) == (2.0, 40, None, UNLIMITED_MAX_TOKENS)
    assert params.repetition_penalty == 1.0
    assert (params.presence_penalty, params.min_p) == (2.0, 1.0)
    assert params.stop == ["a", "b", "c", "d"] and stop_strings(body.options) == ["a", "b", "c", "d", "e"]
    top_p_zero = chat_request(_decode(ChatRequest, messages=[{"role": "user", "content": "hi"}],
                                      options={"top_p": 0}), None)
    assert sampling_params(top_p_zero, None, 16).temperature == 0.0  # only the likeliest token: greedy


def test_numbers_of_any_size_are_clamped_not_a_crash() -> None:
    body = _decode(ChatRequest, messages=[{"role": "user", "content": "hi"}], options={
        "temperature": 10**340, "presence_penalty": -(10**400), "num_predict": 5e9, "top_k": 1e300, "seed": 10**30})
    chat = chat_request(body, None)
    params = sampling_params(chat, chat.max_tokens, 16)
    assert (params.temperature, params.presence_penalty, params.max_tokens) == (2.0, -2.0, UNLIMITED_MAX_TOKENS)
    assert params.top_k == 2**31 - 1 and params.seed == 2**63 - 1


def test_nulls_are_absent_fields_as_go_reads_them() -> None:
    body = _decode(ChatRequest, stream=None, options=None, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": None}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_7"}])
    chat = chat_request(body, None)
    assert chat.stream is True
    messages = chat_messages(chat, 10_000)
    assert [(m.role, m.content) for m in messages] == [
        ("system", "Be brief."), ("user", "hi"), ("assistant", ""), ("tool", "42")]
    assert messages[2].tool_calls is not None and messages[2].tool_calls[0].arguments == "{}"
    assert messages[3].tool_call_id == "call_7"
    generate = _decode(GenerateRequest, prompt=None, raw=None, stream=None)
    assert generate.prompt is None and generate.raw is None  # nothing to generate: the route loads the model


def test_a_last_assistant_message_is_continued() -> None:
    prefilled = [{"role": "user", "content": "Name a sea."}, {"role": "assistant", "content": "The Bal"}]
    assert chat_request(_decode(ChatRequest, messages=prefilled), None).continue_final_message is True
    called = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "function": {"name": "f", "arguments": {"a": 1}}}]}]
    chat = chat_request(_decode(ChatRequest, messages=called), None)
    assert chat.continue_final_message is None and chat.messages[1].tool_calls is not None
    assert chat.messages[1].tool_calls[0].id == "call_1"  # the client's id, kept


def test_past_calls_and_tool_results_become_openai_turns() -> None:
    body = _decode(ChatRequest, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "thinking": "they want weather",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "3 degrees", "tool_name": "get_weather"},
    ], tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
    chat = chat_request(body, None)
    messages = chat_messages(chat, 10_000)
    (call,) = messages[1].tool_calls or []
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    assert (messages[2].role, messages[2].name, messages[2].content) == ("tool", "get_weather", "3 degrees")
    assert chat.tools is not None and chat.tools[0].function.name == "get_weather"


@pytest.mark.parametrize(("message", "fault"), [
    ({"role": "user", "content": "look", "images": ["aGVsbG8="]}, "images"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}, "tool_calls"),
])
def test_what_a_text_model_cannot_take_is_refused(message: dict[str, Any], fault: str) -> None:
    with pytest.raises(BadRequest) as caught:
        chat_request(_decode(ChatRequest, messages=[message]), None)
    assert fault in caught.value.message


def test_format_json_is_any_object_and_a_schema_is_followed() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert json.loads(json_schema_of(chat_request(_decode(ChatRequest, messages=messages, format="json"), None))
                      or "null") == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = chat_request(_decode(ChatRequest, messages=messages, format=schema), None)
    assert json.loads(json_schema_of(chat) or "null") == schema
    assert json_schema_of(chat_request(_decode(ChatRequest, messages=messages, format=""), None)) is None


def test_think_turns_a_reasoning_models_thinking_off_or_sets_its_effort() -> None:
    messages = [{"role": "user", "content": "hi"}]
    off = chat_request(_decode(ChatRequest, messages=messages, think=False), "deepseek_r1")
    assert off.chat_template_kwargs == {"enable_thinking": False}
    high = chat_request(_decode(ChatRequest, messages=messages, think="high"), "deepseek_r1")
    assert high.reasoning_effort == "high" and high.chat_template_kwargs is None
    assert chat_request(_decode(ChatRequest, messages=messages, think=False), None).chat_template_kwargs is None
    with pytest.raises(BadRequest) as caught:
        chat_request(_decode(ChatRequest, messages=messages, think=True), None)
    assert caught.value.param == "think" and "does not support thinking" in caught.value.message


def test_generate_is_a_templated_chat_turn_or_with_raw_the_prompt_as_it_is() -> None:
    templated = generate_request(_decode(GenerateRequest, prompt="Why?", system="Be brief."), None)
    assert isinstance(templated, ChatCompletionRequest)
    assert [(m.role, m.content) for m in templated.messages] == [("system", "Be brief."), ("user", "Why?")]
    raw = generate_request(_decode(GenerateRequest, prompt="[INST] Why? [/INST]", raw=True, logprobs=True,
                                   top_logprobs=3), None)
    assert isinstance(raw, CompletionRequest) and raw.prompt == "[INST] Why? [/INST]" and raw.logprobs == 3


@pytest.mark.parametrize(("fields", "param"), [
    ({"suffix": "end"}, "suffix"), ({"template": "{{ .Prompt }}"}, "template"), ({"context": [1, 2]}, "context"),
    ({"images": ["aGVsbG8="]}, "images"), ({"raw": True, "think": True}, "think"),
    ({"raw": True, "format": "json"}, "format"), ({"raw": True, "system": "Be brief."}, "system"),
])
def test_what_generate_cannot_honour_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        generate_request(_decode(GenerateRequest, prompt="x", **fields), "deepseek_r1")
    assert caught.value.param == param


def test_embed_inputs_and_the_older_embeddings_prompt() -> None:
    embedded = embed_request(_decode(EmbedRequest, input=["a", "b"]))
    assert embedded.input == ["a", "b"]
    cut = (embedded.truncate_prompt_tokens, embedded.truncation_side)
    assert cut == (-1, "right")  # Ollama truncates by default, keeping each input's start
    assert embed_request(_decode(EmbedRequest, input="a", truncate=False)).truncate_prompt_tokens is None
    older = embed_request(_decode(EmbeddingsRequest, prompt="a"))
    assert older.input == "a" and (older.truncate_prompt_tokens, older.truncation_side) == (-1, "right")
    assert len(embed_request(_decode(EmbedRequest, input=["x"] * 1000)).input) == 1000  # computed in batches
    for nothing in ("", [], None):
        assert _decode(EmbedRequest, input=nothing).inputs == []  # the route loads the model, embeds nothing


@pytest.mark.parametrize(("num_parameters", "size"), [
    (None, ""), (0, ""), (999, "999"), (5_300_000, "5.3M"), (96_040_000, "96.0M"), (7_615_616_512, "7.6B")])
def test_parameter_sizes_read_as_ollama_writes_them(num_parameters: int | None, size: str) -> None:
    assert _parameter_size(num_parameters) == size


@pytest.mark.parametrize(("architecture", "family"), [
    ("LlamaForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen2"), ("GPT2LMHeadModel", "gpt2"), ("", "")])
def test_a_family_is_the_architectures_model_type(architecture: str, family: str) -> None:
    assert _family(architecture) == family
