"""The `openai` client against `shoal up`: what an application developer does first."""

from __future__ import annotations

import array
import asyncio
import base64
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cohere
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.conftest import ShoalUp, context_length, http_json

pytestmark = pytest.mark.e2e

SMALL = "demo/llama-5m"
OTHER = "demo/qwen2-25m"


def _chat_prompt_tokens(models_root: Path, model: str, messages: list[dict[str, str]]) -> int:
    tokenizer = AutoTokenizer.from_pretrained(models_root / model)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_lists_the_demo_models(client: openai.OpenAI) -> None:
    ids = {model.id for model in client.models.list()}
    assert {SMALL, OTHER, "demo/llama-100m"} <= ids


def test_non_streamed_chat_with_exact_usage(client: openai.OpenAI, demo_models_root: Path) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    response = client.chat.completions.create(
        model=SMALL, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant" and choice.message.content
    assert response.usage.completion_tokens == 8
    assert response.usage.prompt_tokens == _chat_prompt_tokens(demo_models_root, SMALL, messages)
    assert response.usage.total_tokens == response.usage.prompt_tokens + 8


def test_streamed_chat_from_another_model(client: openai.OpenAI, demo_models_root: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    stream = client.chat.completions.create(
        model=OTHER, messages=messages, max_completion_tokens=6, stream=True, seed=7, temperature=0.8,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 6
    flattened = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert usage.prompt_tokens == _chat_prompt_tokens(demo_models_root, OTHER, flattened)


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    kwargs = dict(model=SMALL, prompt="The sea", max_tokens=12, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert first.choices[0].text == second.choices[0].text


def test_penalties_and_vllm_sampling_fields_reach_the_engine(client: openai.OpenAI) -> None:
    greedy = dict(model=SMALL, prompt="a a a a a a", max_tokens=16, temperature=0)
    plain = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0].text
    penalized = client.completions.create(**greedy, frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    assert penalized.usage.completion_tokens == 16
    assert penalized.choices[0].text != plain, "penalties must change a greedy completion"
    # top_k 1 is greedy whatever the temperature
    top_1 = client.completions.create(**{**greedy, "temperature": 1.5}, seed=5,
                                      extra_body={"ignore_eos": True, "top_k": 1, "min_p": 0.2})
    assert top_1.choices[0].text == plain


def test_a_logit_bias_steers_the_tokens(client: openai.OpenAI, demo_models_root: Path) -> None:
    kwargs = dict(model=SMALL, prompt="The sea", max_tokens=5, temperature=0.7, seed=9, extra_body={"ignore_eos": True})
    free = client.completions.create(**kwargs)
    forced = client.completions.create(**kwargs, logit_bias={"300": 100})
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / SMALL)
    assert forced.choices[0].text == tokenizer.decode([300] * 5) != free.choices[0].text


def test_chat_logprobs_cover_every_token_with_its_alternatives(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SMALL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens == 6
    assert bytes(b for entry in content for b in entry.bytes).decode() == choice.message.content
    for entry in content:
        assert entry.token == bytes(entry.bytes).decode("utf-8", "replace")
        values = [top.logprob for top in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # greedy: the chosen token is the most likely one
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, values[0])
    plain = client.chat.completions.create(model=SMALL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_streamed_and_not_agree(client: openai.OpenAI) -> None:
    kwargs = dict(model=SMALL, prompt="Once upon", max_tokens=8, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0]
    logprobs = full.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert "".join(logprobs.tokens) == full.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert top[token] == value and max(top.values()) == value and 1 <= len(top) <= 2
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(logprobs.token_logprobs)
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset


def test_a_json_schema_gets_json_that_follows_it(client: openai.OpenAI) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "size", "ok"],
              "properties": {"name": {"type": "string", "maxLength": 8}, "size": {"enum": ["S", "M", "L"]},
                             "ok": {"type": "boolean"}}}
    for stream in (False, True):
        kwargs = dict(model=OTHER, messages=[{"role": "user", "content": "Describe a shirt."}], max_tokens=120,
                      response_format={"type": "json_schema", "json_schema": {"name": "shirt", "schema": schema}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                           if c.choices)
        else:
            response = client.chat.completions.create(**kwargs)
            assert response.choices[0].finish_reason == "stop"
            text = response.choices[0].message.content
        shirt = json.loads(text)
        assert set(shirt) == {"name", "size", "ok"} and shirt["size"] in ("S", "M", "L") and len(shirt["name"]) <= 8
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=OTHER, messages=[{"role": "user", "content": "x"}], response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 5}}})
    assert caught.value.body["param"] == "response_format"


def test_vllm_structured_outputs_shape_the_answer(client: openai.OpenAI) -> None:
    """guided_choice / guided_regex / guided_json and the structured_outputs object, on chat and completions."""
    choices = ["yes please", "no-way #1", "été"]
    chat: dict[str, Any] = dict(model=SMALL, messages=[{"role": "user", "content": "Well?"}], max_tokens=40, seed=2)
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        answer = client.chat.completions.create(**chat, extra_body=extra).choices[0]
        assert answer.message.content in choices and answer.finish_reason == "stop", (extra, answer)
    for extra in ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}):
        completion = client.completions.create(model=SMALL, prompt="Code:", max_tokens=20, seed=5, extra_body=extra)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", completion.choices[0].text), completion.choices[0].text
    schema = {"type": "object", "additionalProperties": False, "required": ["size", "ok"],
              "properties": {"size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}}}
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        shirt = json.loads(client.chat.completions.create(**chat, extra_body=extra).choices[0].message.content or "")
        assert set(shirt) == {"size", "ok"} and shirt["size"] in ("S", "M", "L")

    forced_tool = {"tools": [WEATHER_TOOL], "tool_choice": "required"}
    for extra, param in [({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
                         ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
                         ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
                         ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs"),
                         ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
                         ({"guided_regex": "(unclosed"}, "guided_regex"),
                         ({"guided_json": {"type": 5}}, "guided_json"),
                         ({"guided_choice": []}, "guided_choice"),
                         ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens"),
                         ({"guided_json": schema, **forced_tool}, "guided_json")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**chat, extra_body=extra)
        assert caught.value.body["param"] == param, (extra, caught.value.body)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}}}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


def _streamed_calls(chunks: list) -> tuple[str, list[dict], str | None]:  # type: ignore[type-arg]
    """(content, calls joined by index as the `openai` client's users join them, finish reason)."""
    content, calls, finish_reason = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return content, [calls[i] for i in sorted(calls)], finish_reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_tool_choice_calls_a_tool_with_arguments_that_follow_its_schema(client: openai.OpenAI,
                                                                                 tool_choice: object) -> None:
    kwargs = dict(model=OTHER, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=80,
                  tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice, parallel_tool_calls=False, seed=3)
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "unit"} and len(arguments["city"]) <= 8 and arguments["unit"] in "CF"
    else:
        assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"

    content, calls, finish_reason = _streamed_calls(list(client.chat.completions.create(**kwargs, stream=True)))
    assert content == "" and finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_a_forced_call_cut_at_max_tokens_is_still_the_call_begun(client: openai.OpenAI) -> None:
    """As OpenAI and vLLM answer (LangChain then reports an invalid call, not no call): the call,
    its arguments the JSON written so far, finish reason ``length``; streamed alike."""
    kwargs = dict(model=OTHER, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=3,
                  temperature=0, tools=[WEATHER_TOOL],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    content, calls, finish_reason = _streamed_calls(list(client.chat.completions.create(**kwargs, stream=True)))
    assert (content, finish_reason) == ("", "length")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


def test_a_tool_result_turn_reaches_the_models_template(client: openai.OpenAI, demo_models_root: Path) -> None:
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees, snow"},
    ]
    response = client.chat.completions.create(model=OTHER, messages=messages, tools=[WEATHER_TOOL], max_tokens=6,
                                              temperature=0, extra_body={"ignore_eos": True})
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / OTHER)
    rendered = [messages[0], messages[1] | {"tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}}]}, messages[2]]
    text = tokenizer.apply_chat_template(rendered, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n3 degrees, snow\n</tool_response>" in text and '"arguments": {"city": "Oslo"' in text
    assert response.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    choice = response.choices[0]  # tool_choice auto: this model writes text, not calls
    assert choice.finish_reason == "length" and choice.message.content and choice.message.tool_calls is None


def test_a_models_tool_call_parser_decides_how_its_answers_are_read(client: openai.OpenAI, shoal: ShoalUp) -> None:
    """A model registered with ``tool_call_parser = "llama3_json"`` has an answer that is a
    Llama-style call object read as a call; the same answer from a Hermes model is text. (The
    answer is made a call object with ``response_format``: random weights never write one.)"""
    code, payload = _post(shoal.base_url + "/admin/models", json.dumps(
        {"key": "org/llama-calls", "path": SMALL, "tool_call_parser": "llama3_json"}).encode())
    assert code == 200 and payload["model"]["tool_call_parser"] == "llama3_json", payload
    call_object = {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                   "properties": {"name": {"const": "get_time"}, "parameters": TIME_TOOL["function"]["parameters"]}}
    kwargs = dict(messages=[{"role": "user", "content": "Time?"}], tools=[TIME_TOOL], max_tokens=60, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": call_object}})

    llama = client.chat.completions.create(model="org/llama-calls", **kwargs).choices[0]
    assert llama.finish_reason == "tool_calls" and llama.message.content is None
    (call,) = llama.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")

    hermes = client.chat.completions.create(model=SMALL, **kwargs).choices[0]
    assert hermes.finish_reason == "stop" and hermes.message.tool_calls is None
    assert json.loads(hermes.message.content)["name"] == "get_time"


@pytest.mark.parametrize(("parser", "shape"), [
    ("pythonic", {"guided_regex": r'\[get_time\(zone="(UTC|CET)"\)\]'}),
    ("mistral", {"guided_json": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"const": "get_time"}, "arguments": TIME_TOOL["function"]["parameters"]}}}}),
])
def test_pythonic_and_mistral_calls_are_read_as_calls(client: openai.OpenAI, shoal: ShoalUp, parser: str,
                                                      shape: dict[str, Any]) -> None:
    """The answer is made a call in the model's format by a grammar (random weights never write one)."""
    key = f"org/{parser}-calls"
    code, payload = _post(shoal.base_url + "/admin/models", json.dumps(
        {"key": key, "path": SMALL, "tool_call_parser": parser}).encode())
    assert code == 200, payload
    choice = client.chat.completions.create(model=key, messages=[{"role": "user", "content": "Time?"}],
                                            tools=[TIME_TOOL], max_tokens=60, temperature=0, extra_body=shape).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_a_tool_whose_schema_cannot_be_followed_is_400_naming_tools(client: openai.OpenAI) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=OTHER, messages=[{"role": "user", "content": "x"}], tools=[bad],
                                       tool_choice="required")
    assert caught.value.body["param"] == "tools"


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(client: openai.OpenAI, demo_models_root: Path) -> None:
    """What lm-evaluation-harness sends for a log-likelihood: the prompt comes back with every
    token's log probability (the first's null), equal to a Hugging Face forward over it, then
    the completion's; streamed, the same."""
    prompt = "The cat sat on the mat because"
    kwargs = dict(model=SMALL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
                  extra_body={"ignore_eos": True})
    response = client.completions.create(**kwargs)
    choice, usage = response.choices[0], response.usage
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in logprobs.token_logprobs[1:])

    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / SMALL)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    assert len(prompt_ids) == usage.prompt_tokens
    model = AutoModelForCausalLM.from_pretrained(demo_models_root / SMALL)
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0, :-1].float(), dim=-1)
    scores = [expected[i, prompt_ids[i + 1]].item() for i in range(len(prompt_ids) - 1)]
    assert logprobs.token_logprobs[1:len(prompt_ids)] == pytest.approx(scores, abs=1e-3)
    assert "".join(logprobs.tokens[:len(prompt_ids)]).endswith(prompt)
    assert logprobs.text_offset == sorted(logprobs.text_offset)

    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset
    streamed_values = [v for lp in streamed for v in lp.token_logprobs]
    assert streamed_values[0] is None and streamed_values[1:] == pytest.approx(logprobs.token_logprobs[1:])

    by_ids = client.completions.create(model=SMALL, prompt=prompt_ids, max_tokens=2, echo=True)
    assert by_ids.choices[0].text.startswith(tokenizer.decode(prompt_ids, skip_special_tokens=True))


def test_completion_streamed_and_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model=SMALL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.object == "text_completion" and full.usage.completion_tokens == 10
    streamed = client.completions.create(model=SMALL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert text == full.choices[0].text, "greedy streamed and non-streamed completions must agree"


def test_stop_strings_end_the_text(client: openai.OpenAI) -> None:
    free = client.completions.create(model=SMALL, prompt="a b c", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(free) > 4
    stop = free[2:4]
    stopped = client.completions.create(model=SMALL, prompt="a b c", max_tokens=30, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[: free.index(stop)]


def test_n_choices_are_distinct_seeded_samples_with_the_prompt_counted_once(client: openai.OpenAI) -> None:
    kwargs = dict(model=SMALL, messages=[{"role": "user", "content": "Tell me."}], max_tokens=6, temperature=1.0,
                  extra_body={"ignore_eos": True})
    response = client.chat.completions.create(**kwargs, n=3, seed=40)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in response.choices)
    texts = [c.message.content for c in response.choices]
    # choice j samples with seed + j: each equals the single request with that seed
    singles = [client.chat.completions.create(**kwargs, seed=40 + j) for j in range(3)]
    assert texts == [single.choices[0].message.content for single in singles]
    assert len(set(texts)) == 3, "sampled choices differ"
    assert response.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert response.usage.completion_tokens == 18
    assert response.usage.total_tokens == response.usage.prompt_tokens + 18


def test_a_batch_of_prompts_answers_each_as_its_own_request_would(client: openai.OpenAI) -> None:
    prompts: list = ["Once upon a time", [5, 6, 7, 8], "The sea"]
    kwargs = dict(model=SMALL, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=prompts, n=2, **kwargs)
    singles = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 30


def test_streamed_choices_interleave_each_with_its_own_finish(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=OTHER, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2, seed=3, temperature=0.9,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert all(len(c.choices) <= 1 for c in chunks)
    assert [d.index for d in deltas[:2]] == [0, 1] and all(d.delta.role == "assistant" for d in deltas[:2])
    for index in (0, 1):
        own = [d for d in deltas if d.index == index]
        assert [d.finish_reason for d in own if d.finish_reason] == ["length"]
        assert own[-1].finish_reason == "length", "nothing of a choice follows its finish"
        streamed = "".join(d.delta.content or "" for d in own)
        alone = client.chat.completions.create(model=OTHER, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=5, seed=3 + index, temperature=0.9,
                                               extra_body={"ignore_eos": True})
        assert streamed == alone.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


async def test_twenty_concurrent_requests_over_two_models(shoal: ShoalUp) -> None:
    client = openai.AsyncOpenAI(base_url=shoal.v1, api_key="unused", max_retries=0, timeout=240)

    async def one(i: int) -> int:
        model = SMALL if i % 2 else OTHER
        response = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        return response.usage.completion_tokens

    results = await asyncio.gather(*(one(i) for i in range(20)))
    assert results == [4] * 20
    await client.close()


def _post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"", 400, None),
        ("/v1/chat/completions", b'{"model": "no/such-model", "messages": [{"role": "user", "content": "x"}]}',
         404, "model"),
        ("/v1/chat/completions", b'{"model": "demo/llama-5m", "messages": [{"role": "user", "content": "x"}], '
                                 b'"max_tokens": "many"}', 400, "max_tokens"),
        ("/v1/chat/completions", b'{"model": "demo/llama-5m", "messages": "hello"}', 400, "messages"),
        ("/v1/chat/completions", b'{"model": "demo/llama-5m", "messages": [{"role": "user", "content": "x"}], '
                                 b'"temperature": 9}', 400, "temperature"),
        ("/v1/chat/completions", b'{"model": "demo/llama-5m", "messages": [{"role": "user", "content": "x"}], '
                                 b'"n": 129}', 400, "n"),
        ("/v1/completions", b'{"model": "demo/llama-5m", "prompt": 42}', 400, "prompt"),
        ("/v1/completions", b'{"model": "demo/llama-5m"}', 400, None),
        ("/v1/chat/completions", b'{"model": "demo/llama-5m", "messages": [{"role": "user", "content": "x"}], '
                                 b'"max_tokens": 100000000000000000000}', 400, "max_tokens"),
        ("/v1/chat/completions", b'{"model": "demo/llama-5m", "messages": [{"role": "user", "content": "x"}], '
                                 b'"max_completion_tokens": 0}', 400, "max_completion_tokens"),
        ("/v1/completions", b'{"model": "demo/llama-5m", "prompt": "x", "seed": 100000000000000000000}', 400,
         "seed"),
        ("/v1/completions", b'{"model": "demo/llama-5m", "prompt": "x", "top_p": 0}', 400, "top_p"),
        ("/v1/chat/completions", b'{"model": "demo/llama-5m", "messages": [{"role": "user", "content": "x"}], '
                                 b'"frequency_penalty": 2.5}', 400, "frequency_penalty"),
        ("/v1/chat/completions", b'{"model": "demo/llama-5m", "messages": [{"role": "user", "content": "x"}], '
                                 b'"stream_options": {"include_usage": true}}', 400, "stream_options"),
        # Out of the model's vocabulary: only the worker knows; the error still names the field.
        ("/v1/completions", b'{"model": "demo/llama-5m", "prompt": [1, 999999], "max_tokens": 1}', 400, "prompt"),
        ("/v1/completions", b'{"model": "demo/llama-5m", "prompt": "x", "logit_bias": {"999999": 1}}', 400,
         "logit_bias"),
    ],
)
def test_bad_requests_get_openai_style_errors(shoal: ShoalUp, path: str, body: bytes, status: int,
                                              param: str | None) -> None:
    code, payload = _post(shoal.base_url + path, body)
    assert code == status
    error = payload["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error.get("param") == param


def test_null_fields_are_accepted_as_absent(shoal: ShoalUp) -> None:
    nulls = {"n": None, "stream": None, "stop": None, "seed": None, "temperature": None, "top_p": None,
             "user": None, "stream_options": None, "logprobs": None, "frequency_penalty": None,
             "presence_penalty": None, "logit_bias": None}
    body = {"model": SMALL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": None,
            "max_completion_tokens": 3, "ignore_eos": True} | nulls
    code, payload = _post(shoal.base_url + "/v1/chat/completions", json.dumps(body).encode())
    assert code == 200, payload
    assert payload["usage"]["completion_tokens"] == 3 and len(payload["choices"]) == 1


def test_a_prompt_or_max_tokens_beyond_the_context_is_a_400_the_client_raises_as_bad_request(
        client: openai.OpenAI) -> None:
    """What OpenAI and vLLM answer, ``BadRequestError`` with ``context_length_exceeded`` (what
    LangChain and LiteLLM look for), each naming the field as the route calls it."""
    context = context_length(client, SMALL)
    long_prompt, near_full = "word " * (2 * context), "word " * (context - 60)
    calls: list[tuple[str, Callable[[], object]]] = [
        ("prompt", lambda: client.completions.create(model=SMALL, prompt=long_prompt, max_tokens=2)),
        ("messages", lambda: client.chat.completions.create(
            model=SMALL, messages=[{"role": "user", "content": long_prompt}], max_tokens=2)),
        ("input", lambda: client.responses.create(model=SMALL, input=long_prompt, max_output_tokens=2)),
        ("input", lambda: client.embeddings.create(model=SMALL, input=[long_prompt])),
        ("max_tokens", lambda: client.completions.create(model=SMALL, prompt=near_full, max_tokens=context)),
        ("max_tokens", lambda: client.chat.completions.create(
            model=SMALL, messages=[{"role": "user", "content": near_full}], max_tokens=context)),
        ("max_completion_tokens", lambda: client.chat.completions.create(
            model=SMALL, messages=[{"role": "user", "content": near_full}], max_completion_tokens=context)),
        ("max_output_tokens", lambda: client.responses.create(model=SMALL, input=near_full,
                                                              max_output_tokens=context)),
    ]
    for param, call in calls:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        error = caught.value.body
        assert isinstance(error, dict) and (error["code"], error["param"]) == ("context_length_exceeded", param), error
    # A max_tokens Shoal chose (chat's default) stops at the context's end instead.
    cut = client.chat.completions.create(model=SMALL, messages=[{"role": "user", "content": near_full}],
                                         extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "length" and cut.usage is not None
    assert cut.usage.prompt_tokens + cut.usage.completion_tokens == context


def test_registering_a_model_whose_files_no_node_agent_finds_is_400(shoal: ShoalUp) -> None:
    code, payload = _post(shoal.base_url + "/admin/models", json.dumps({"key": "org/ghost", "path": "no/such"}).encode())
    assert code == 400, payload
    assert "no/such" in payload["error"]["message"]
    with urllib.request.urlopen(shoal.v1 + "/models", timeout=10) as response:
        assert "org/ghost" not in {m["id"] for m in json.loads(response.read())["data"]}
    code, payload = _post(shoal.base_url + "/admin/models", json.dumps({"key": "org/again", "path": SMALL}).encode())
    assert code == 200 and payload["model"]["weight_bytes"] > 0, payload


def test_health_and_metrics(shoal: ShoalUp) -> None:
    for path in ("/healthz", "/health"):
        with urllib.request.urlopen(shoal.base_url + path, timeout=10) as response:
            assert json.loads(response.read())["status"] == "ok"
    with urllib.request.urlopen(shoal.base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    assert "shoal_gateway_requests_total" in text
    assert all(line.startswith(("#", "shoal_")) for line in text.splitlines() if line)


def test_a_reasoning_models_thinking_comes_apart_from_its_answer(client: openai.OpenAI, shoal: ShoalUp) -> None:
    """A model registered with ``reasoning_parser = "deepseek_r1"``: what comes before
    ``</think>`` is ``reasoning``, the rest ``content``, streamed or not, in chat and in the
    Responses API. (The answer is made one with a thinking part by ``response_format``, which
    this model lets shape its thinking too: random weights never close a think block.)"""
    code, payload = _post(shoal.base_url + "/admin/models", json.dumps(
        {"key": "org/thinker", "path": SMALL, "reasoning_parser": "deepseek_r1",
         "grammar_after_reasoning": False}).encode())
    assert code == 200 and payload["model"]["reasoning_parser"] == "deepseek_r1", payload
    answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"const": "plan</think>answer"}}}
    kwargs = dict(messages=[{"role": "user", "content": "2+2?"}], max_tokens=40, response_format=answer)

    collected = client.chat.completions.create(model="org/thinker", **kwargs)
    message = collected.choices[0].message
    assert (message.reasoning, message.content) == ('"plan', 'answer"')
    assert message.reasoning_content == message.reasoning
    assert collected.usage is not None and collected.usage.completion_tokens_details is not None
    num_thinking = collected.usage.completion_tokens_details.reasoning_tokens
    assert 0 < num_thinking < collected.usage.completion_tokens, collected.usage
    chunks = list(client.chat.completions.create(model="org/thinker", stream=True,
                                                 stream_options={"include_usage": True}, **kwargs))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == '"plan'
    assert "".join(d.content or "" for d in deltas) == 'answer"'
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens_details is not None
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == num_thinking

    responses_kwargs: dict[str, Any] = dict(model="org/thinker", input="2+2?", max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "a", "schema": {"const": "plan</think>answer"}}})
    response = client.responses.create(**responses_kwargs)
    thinking, said = response.output
    assert thinking.type == "reasoning" and thinking.content[0].text == '"plan'
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == num_thinking
    assert said.type == "message" and response.output_text == 'answer"'
    with client.responses.stream(**responses_kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert [item.type for item in streamed.output] == ["reasoning", "message"]
    assert streamed.output[0].content[0].text == '"plan' and streamed.output_text == 'answer"'
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"

    plain = client.chat.completions.create(model=SMALL, **kwargs).choices[0].message
    assert plain.content == '"plan</think>answer"' and getattr(plain, "reasoning", None) is None


def test_a_reasoning_model_thinks_before_its_grammar_applies(client: openai.OpenAI, shoal: ShoalUp) -> None:
    """By default a grammar waits for ``</think>`` (tests/unit/test_engine_grammar_after.py
    shows the text after it shaped): these random weights never close their think block, so
    the schema's constant never comes, and the whole answer is reasoning."""
    code, payload = _post(shoal.base_url + "/admin/models", json.dumps(
        {"key": "org/free-thinker", "path": SMALL, "reasoning_parser": "deepseek_r1"}).encode())
    assert code == 200 and payload["model"].get("grammar_after_reasoning", True) is True, payload
    answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"const": "x"}}}
    choice = client.chat.completions.create(model="org/free-thinker", messages=[{"role": "user", "content": "2+2?"}],
                                            max_tokens=8, response_format=answer,
                                            extra_body={"ignore_eos": True}).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    assert choice.message.reasoning and choice.message.reasoning != '"x"'


def test_a_thinking_budget_closes_the_think_block_and_the_model_answers(client: openai.OpenAI,
                                                                       shoal: ShoalUp) -> None:
    """vLLM's ``thinking_token_budget``: these random weights never close their think block (an
    answer all reasoning, no content); with a budget of 3 the worker closes it after 3 tokens
    and the rest of ``max_tokens`` is the answer, streamed or not."""
    status, payload = http_json(shoal.base_url, "POST", "/admin/models",
                                {"key": "org/budget-thinker", "path": SMALL, "reasoning_parser": "deepseek_r1"})
    assert status == 200, payload
    kwargs: dict[str, Any] = dict(model="org/budget-thinker", messages=[{"role": "user", "content": "2+2?"}],
                                  temperature=0)
    unbounded = client.chat.completions.create(max_tokens=16, **kwargs).choices[0].message
    assert unbounded.reasoning and not unbounded.content
    three = client.chat.completions.create(max_tokens=3, **kwargs).choices[0].message.reasoning
    bounded = client.chat.completions.create(max_tokens=16, extra_body={"thinking_token_budget": 3}, **kwargs)
    message = bounded.choices[0].message
    assert message.reasoning.rstrip() == three.rstrip() and message.content, message
    assert bounded.usage.completion_tokens == 16
    assert 3 <= bounded.usage.completion_tokens_details.reasoning_tokens < 16
    chunks = list(client.chat.completions.create(max_tokens=16, stream=True, extra_body={"thinking_token_budget": 3},
                                                 **kwargs))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    unbudgeted = client.chat.completions.create(max_tokens=16, extra_body={"thinking_token_budget": -1}, **kwargs)
    assert unbudgeted.choices[0].message.reasoning == unbounded.reasoning

    with pytest.raises(openai.BadRequestError) as caught:  # a model without a reasoning parser
        client.chat.completions.create(model=SMALL, messages=kwargs["messages"], max_tokens=4,
                                       extra_body={"thinking_token_budget": 3})
    assert caught.value.body["param"] == "thinking_token_budget"


def test_an_answer_that_goes_on_after_a_closed_think_block_is_content(client: openai.OpenAI,
                                                                      shoal: ShoalUp) -> None:
    """continue_final_message with the thinking done in the prefix: the worker sees the prompt
    end with ``</think>`` and shapes the text from its first token, and the gateway reads it as
    content, the two agreeing on where the thinking ended."""
    code, payload = _post(shoal.base_url + "/admin/models", json.dumps(
        {"key": "org/r1-continued", "path": SMALL, "reasoning_parser": "deepseek_r1"}).encode())
    assert code == 200, payload
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Easy.</think>"}]
    answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"const": "four"}}}
    message = client.chat.completions.create(model="org/r1-continued", messages=messages, max_tokens=12,
                                             response_format=answer,
                                             extra_body={"continue_final_message": True}).choices[0].message
    assert message.content == '"four"' and not getattr(message, "reasoning", None), message


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, demo_models_root: Path) -> None:
    messages = [{"role": "user", "content": "2+2?"}]
    thinking_off = client.chat.completions.create(model=SMALL, messages=messages, max_tokens=1, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}})
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / SMALL)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    assert thinking_off.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=SMALL, messages=messages, extra_body={
            "chat_template_kwargs": {"add_generation_prompt": False}})
    assert caught.value.body["param"] == "chat_template_kwargs"


def test_tokenize_counts_the_tokens_generation_uses(client: openai.OpenAI, shoal: ShoalUp,
                                                   demo_models_root: Path) -> None:
    """vLLM's /tokenize and /detokenize: a chat's tokens after its template (tools included) are
    the prompt a request with it reports; a prompt's are the tokenizer's; a model with no
    replica yet gets one placed first."""
    code, payload = _post(shoal.base_url + "/admin/models", json.dumps({"key": "org/tokens", "path": SMALL}).encode())
    assert code == 200, payload
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    code, counted = _post(shoal.base_url + "/tokenize", json.dumps(
        {"model": "org/tokens", "messages": messages, "tools": [WEATHER_TOOL], "return_token_strs": True}).encode())
    assert code == 200, counted
    chat = client.chat.completions.create(model=SMALL, messages=messages, tools=[WEATHER_TOOL], max_tokens=1)
    assert counted["count"] == len(counted["tokens"]) == chat.usage.prompt_tokens
    assert len(counted["token_strs"]) == counted["count"] and counted["max_model_len"] == 2048

    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / SMALL)
    code, prompt = _post(shoal.base_url + "/tokenize", json.dumps({"model": SMALL, "prompt": "The sea"}).encode())
    assert code == 200 and prompt["tokens"] == tokenizer.encode("The sea", add_special_tokens=True), prompt
    assert prompt["token_strs"] is None
    code, text = _post(shoal.base_url + "/detokenize", json.dumps({"model": SMALL, "tokens": prompt["tokens"]}).encode())
    assert code == 200 and text == {"prompt": tokenizer.decode(prompt["tokens"])}

    for path, body, status, param in [
        ("/tokenize", {"model": "org/none", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": SMALL, "prompt": "x", "add_special_tokens": False}, 400, "add_special_tokens"),
        ("/tokenize", {"model": SMALL, "prompt": ["a", "b"]}, 400, "prompt"),
        ("/tokenize", {"model": SMALL, "messages": messages, "chat_template_kwargs": {"tokenize": 1}}, 400,
         "chat_template_kwargs"),
        ("/detokenize", {"model": SMALL, "tokens": [5, 10**6]}, 400, None),
        ("/detokenize", {"model": SMALL, "tokens": [-1]}, 400, "tokens"),
    ]:
        code, error = _post(shoal.base_url + path, json.dumps(body).encode())
        assert code == status and error["error"]["param"] == param, (body, error)


def test_min_tokens_and_stop_token_ids(client: openai.OpenAI, demo_models_root: Path) -> None:
    """vLLM's fields: a stop token ends the answer (its text kept, as vLLM keeps a non-special
    one), end-of-sequence included; min_tokens masks them until that many tokens are out."""
    eos = AutoTokenizer.from_pretrained(demo_models_root / SMALL).eos_token_id
    stop_token = 300

    def ending(bias_token: int, **extra: Any) -> tuple[int, str]:
        answer = client.completions.create(model=SMALL, prompt="The sea", max_tokens=12, temperature=0,
                                           logit_bias={str(bias_token): 100}, extra_body=extra)
        assert answer.usage is not None
        return answer.usage.completion_tokens, answer.choices[0].finish_reason

    assert ending(stop_token, ignore_eos=True) == (12, "length")
    assert ending(stop_token, ignore_eos=True, stop_token_ids=[stop_token]) == (1, "stop")
    assert ending(stop_token, ignore_eos=True, stop_token_ids=[stop_token], min_tokens=4) == (5, "stop")
    assert ending(eos) == (1, "stop")
    assert ending(eos, min_tokens=6) == (7, "stop")
    streamed = client.chat.completions.create(
        model=SMALL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    chunks = list(streamed)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]

    messages = [{"role": "user", "content": "Hi"}]
    for extra, param in [({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
                         ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens"),
                         ({"stop_token_ids": [4096]}, "stop_token_ids"),
                         ({"stop_token_ids": [-1]}, "stop_token_ids")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=SMALL, messages=messages, extra_body=extra)
        assert caught.value.body["param"] == param, (extra, caught.value.body)


def test_continue_final_message_goes_on_with_the_assistants_words(client: openai.OpenAI, shoal: ShoalUp,
                                                                  demo_models_root: Path) -> None:
    """vLLM's continue_final_message (an answer's start given) and add_generation_prompt: the
    prompt is the template's for them, and the answer what a completion of it writes."""
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / SMALL)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                         continue_final_message=True)
    assert text.endswith("My favourite is")
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    greedy: dict[str, Any] = dict(model=SMALL, max_tokens=6, temperature=0)
    chat = client.chat.completions.create(messages=messages, **greedy,
                                          extra_body={"ignore_eos": True, "continue_final_message": True})
    completion = client.completions.create(prompt=prompt_ids, **greedy, extra_body={"ignore_eos": True})
    assert chat.usage is not None and chat.usage.prompt_tokens == len(prompt_ids)
    assert chat.choices[0].message.content == completion.choices[0].text

    unopened = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=False)
    code, counted = _post(shoal.base_url + "/tokenize", json.dumps(
        {"model": SMALL, "messages": messages[:1], "add_generation_prompt": False}).encode())
    assert code == 200 and counted["tokens"] == tokenizer.encode(unopened, add_special_tokens=False), counted

    for extra, sent in [({"continue_final_message": True}, messages[:1]),
                        ({"continue_final_message": True, "add_generation_prompt": True}, messages)]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(messages=sent, **greedy, extra_body=extra)
        assert caught.value.body["param"] == "continue_final_message", caught.value.body


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client: openai.OpenAI, demo_models_root: Path) -> None:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens are all the model reads
    (the answer is the one those tokens alone get); -1 fits a prompt longer than the context,
    leaving room for the max_tokens the client gave (for one token without it)."""
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / SMALL)
    text = "The sea is calm tonight and the tide is full"
    greedy: dict[str, Any] = dict(model=SMALL, max_tokens=6, temperature=0)
    cut = client.completions.create(prompt=text, **greedy, extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True})
    alone = client.completions.create(prompt=tokenizer.encode(text)[-5:], **greedy, extra_body={"ignore_eos": True})
    assert cut.usage is not None and cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == alone.choices[0].text

    too_long = "sea " * 3000
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt=too_long, **greedy)
    context = context_length(client, SMALL)
    fitted = client.completions.create(prompt=too_long, **greedy, extra_body={"truncate_prompt_tokens": -1,
                                                                              "ignore_eos": True})
    assert fitted.usage is not None and (fitted.usage.prompt_tokens, fitted.usage.completion_tokens) == (context - 6, 6)
    unasked = {k: v for k, v in greedy.items() if k != "max_tokens"}
    chat = client.chat.completions.create(messages=[{"role": "user", "content": too_long}], **unasked,
                                          extra_body={"truncate_prompt_tokens": -1})
    assert chat.usage is not None and chat.usage.prompt_tokens == context - 1
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(prompt=text, **greedy, echo=True, extra_body={"truncate_prompt_tokens": 5})
    assert refused.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def test_embeddings_are_the_models_normalized_last_hidden_states(client: openai.OpenAI,
                                                                 demo_models_root: Path) -> None:
    """``client.embeddings.create``: each input's last token's final hidden state, L2-normalized
    (vLLM's default for a decoder model), as a local forward of the same model computes it."""
    model = AutoModelForCausalLM.from_pretrained(demo_models_root / SMALL).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / SMALL)

    def expected(ids: list[int]) -> list[float]:
        with torch.inference_mode():
            hidden = model.get_decoder()(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=-1).tolist()

    texts = ["The sea is calm.", "A storm comes in from the west."]
    answer = client.embeddings.create(model=SMALL, input=texts)
    assert [item.index for item in answer.data] == [0, 1] and answer.model == SMALL
    token_ids = [tokenizer.encode(text) for text in texts]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(len(ids) for ids in token_ids)
    for item, ids in zip(answer.data, token_ids, strict=True):
        assert len(item.embedding) == model.config.hidden_size
        assert item.embedding == pytest.approx(expected(ids), abs=2e-4)
    # base64 (float32 little-endian, as OpenAI sends it) and token ids
    packed = client.embeddings.create(model=SMALL, input=[token_ids[1]], encoding_format="base64")
    assert isinstance(packed.data[0].embedding, str)
    unpacked = array.array("f", base64.b64decode(packed.data[0].embedding)).tolist()
    assert unpacked == pytest.approx(answer.data[1].embedding, abs=1e-6)

    for extra, param in [({"input": ""}, "input"), ({"input": [[5, 10**6]]}, "input"), ({"dimensions": 8}, "dimensions"),
                         ({"input": ["x"] * 8193}, "input"), ({"encoding_format": "hex"}, "encoding_format")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=SMALL, **{"input": "x", **extra})
        assert caught.value.body["param"] == param, (extra, caught.value.body)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="org/none", input="x")


def _expected_embeddings(models_root: Path, model_key: str, texts: list[str], *, keep_first: int | None = None
                         ) -> tuple[list[torch.Tensor], int]:
    """Each text's normalized last hidden state by a local forward (its first `keep_first`
    tokens only, if given), and the tokens read."""
    model = AutoModelForCausalLM.from_pretrained(models_root / model_key).eval()
    tokenizer = AutoTokenizer.from_pretrained(models_root / model_key)
    vectors, num_tokens = [], 0
    for text in texts:
        ids = tokenizer.encode(text)[:keep_first]
        num_tokens += len(ids)
        with torch.inference_mode():
            hidden = model.get_decoder()(torch.tensor([ids])).last_hidden_state[0, -1]
        vectors.append(torch.nn.functional.normalize(hidden, dim=-1))
    return vectors, num_tokens


def test_cohere_clients_rerank_documents_by_their_embeddings_cosine(shoal: ShoalUp, demo_models_root: Path) -> None:
    """Cohere's own client (v2 and v1) ranks documents as the cosine of their embeddings and the
    query's, best first, as vLLM reranks with an embedding model."""
    query = "Where do the boats go at night?"
    documents = ["The harbour keeps the boats.", "Cats sleep all day long.", "At night the fleet returns to port."]
    vectors, num_tokens = _expected_embeddings(demo_models_root, SMALL, [query, *documents])
    scores = [float(vectors[0] @ vector) for vector in vectors[1:]]
    best_first = sorted(range(len(documents)), key=lambda index: -scores[index])

    v2 = cohere.ClientV2(base_url=shoal.base_url, api_key="unused")
    answer = v2.rerank(model=SMALL, query=query, documents=documents, top_n=2)
    assert [result.index for result in answer.results] == best_first[:2]
    assert [result.relevance_score for result in answer.results] == pytest.approx(
        [scores[index] for index in best_first[:2]], abs=1e-4)
    assert answer.usage == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    # Cohere's max_tokens_per_doc reads each document's first tokens, the query whole
    cut_vectors, _ = _expected_embeddings(demo_models_root, SMALL, documents, keep_first=3)
    cut = v2.rerank(model=SMALL, query=query, documents=documents, max_tokens_per_doc=3)
    assert {result.index: result.relevance_score for result in cut.results} == pytest.approx(
        {index: float(vectors[0] @ vector) for index, vector in enumerate(cut_vectors)}, abs=1e-4)

    v1 = cohere.Client(base_url=shoal.base_url, api_key="unused")
    with_documents = v1.rerank(model=SMALL, query=query, documents=documents, return_documents=True)
    assert [result.index for result in with_documents.results] == best_first
    assert [result.document.text for result in with_documents.results] == [documents[i] for i in best_first]
    with pytest.raises(cohere.NotFoundError):
        v2.rerank(model="org/none", query=query, documents=documents)


def test_score_pairs_texts_as_vllm_does(shoal: ShoalUp, demo_models_root: Path) -> None:
    """``/v1/score``: one text_1 against each text_2, or two lists pair by pair; a score is the
    cosine of the two embeddings. Jina's ``/v1/rerank`` form takes documents as objects."""
    texts = ["The sea is calm.", "A storm comes in.", "The sea is calm."]
    vectors, _ = _expected_embeddings(demo_models_root, SMALL, texts)
    status, one_to_many = http_json(shoal.base_url, "POST", "/v1/score",
                                    {"model": SMALL, "text_1": texts[0], "text_2": texts[1:]})
    assert status == 200, one_to_many
    assert [item["index"] for item in one_to_many["data"]] == [0, 1]
    assert [item["score"] for item in one_to_many["data"]] == pytest.approx(
        [float(vectors[0] @ vectors[1]), 1.0], abs=1e-4)
    status, pairwise = http_json(shoal.base_url, "POST", "/score",
                                 {"model": SMALL, "text_1": texts[:2], "text_2": texts[1:]})
    assert status == 200 and [item["score"] for item in pairwise["data"]] == pytest.approx(
        [float(vectors[0] @ vectors[1]), float(vectors[1] @ vectors[2])], abs=1e-4)
    status, error = http_json(shoal.base_url, "POST", "/v1/score", {"model": SMALL, "text_1": texts[:2],
                                                                    "text_2": texts})
    assert status == 400 and error["error"]["param"] == "text_1"

    status, jina = http_json(shoal.base_url, "POST", "/rerank", {
        "model": SMALL, "query": texts[0], "documents": [{"text": texts[1]}, {"text": texts[2]}], "top_n": 1})
    assert status == 200, jina
    assert jina["results"] == [{"index": 1, "relevance_score": pytest.approx(1.0, abs=1e-4),
                                "document": {"text": texts[2]}}]


def _run_batch(shoal: ShoalUp, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shoal.cli.main", "run-batch", "--url", shoal.base_url, *args],
                          capture_output=True, text=True, timeout=300, check=False)


def test_run_batch_answers_a_batch_file_in_order_and_resumes(shoal: ShoalUp, tmp_path: Path) -> None:
    """``shoal run-batch`` (vLLM's run-batch, OpenAI's batch format): each line answered by the
    gateway, in order, refusals in their own lines; ``--resume`` sends only what an
    interrupted run's output lacks."""
    chat = {"model": SMALL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    requests = [
        ("chat", "/v1/chat/completions", chat),
        ("embed", "/v1/embeddings", {"model": SMALL, "input": ["a", "b"]}),
        ("missing", "/v1/chat/completions", {**chat, "model": "org/none"}),
        ("rerank", "/v1/rerank", {"model": SMALL, "query": "q", "documents": ["d", "e"]}),
        ("message", "/v1/messages", {"model": SMALL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
    ]
    batch_file, output = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    batch_file.write_text("".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})
                                  + "\n" for custom_id, url, body in requests))
    done = _run_batch(shoal, "-i", str(batch_file), "-o", str(output), "--concurrency", "3")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [record["custom_id"] for record in records] == [custom_id for custom_id, _, _ in requests]
    statuses = [record["response"]["status_code"] for record in records]
    assert statuses == [200, 200, 404, 200, 200]
    by_id = {record["custom_id"]: record["response"]["body"] for record in records}
    assert by_id["chat"]["usage"]["completion_tokens"] == 3
    assert by_id["chat"] == {**by_id["chat"], "object": "chat.completion", "model": SMALL}
    assert len(by_id["embed"]["data"]) == 2 and by_id["missing"]["error"]["code"] == "model_not_found"
    assert len(by_id["rerank"]["results"]) == 2 and by_id["message"]["type"] == "message"
    assert all(record["response"]["request_id"] for record in records)
    assert "5 done (4 × 200, 1 × 404)" in done.stderr

    # an interrupted run: its first two lines written, the third torn
    lines = output.read_text().splitlines(keepends=True)
    output.write_text(lines[0] + lines[1] + lines[2][:25])
    resumed = _run_batch(shoal, "-i", str(batch_file), "-o", str(output), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "2 answered before, 3 to send" in resumed.stderr
    again = [json.loads(line) for line in output.read_text().splitlines()]
    assert [record["custom_id"] for record in again] == [custom_id for custom_id, _, _ in requests]
    assert again[:2] == records[:2]

    batch_file.write_text(json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                                      "body": {**chat, "stream": True}}) + "\n")
    refused = _run_batch(shoal, "-i", str(batch_file), "-o", str(tmp_path / "none.jsonl"))
    assert refused.returncode == 2 and "line 1: stream is not supported" in refused.stderr
    assert not (tmp_path / "none.jsonl").exists()


def test_openais_batch_api_answers_an_uploaded_file(client: openai.OpenAI) -> None:
    """The Files and Batch APIs as OpenAI's client uses them: upload, make a batch, wait for
    it, download its output (the answers a direct request gets) and its error file."""
    chat = {"model": SMALL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat} for i in range(3)]
    lines.insert(1, {"custom_id": "missing", "method": "POST", "url": "/v1/chat/completions",
                     "body": {**chat, "model": "org/none"}})
    source = client.files.create(file=("jobs.jsonl", "\n".join(json.dumps(line) for line in lines).encode()),
                                 purpose="batch")
    assert source.purpose == "batch" and source.filename == "jobs.jsonl"
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "e2e"})
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and (batch.request_counts.total, batch.request_counts.completed,
                                                 batch.request_counts.failed) == (4, 3, 1)
    assert batch.output_file_id and batch.error_file_id and batch.metadata == {"job": "e2e"}
    direct = client.chat.completions.create(model=SMALL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=0, extra_body={"ignore_eos": True}).choices[0].message.content
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [record["custom_id"] for record in output] == ["r0", "r1", "r2"]
    assert [record["response"]["body"]["choices"][0]["message"]["content"] for record in output] == [direct] * 3
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert [(record["custom_id"], record["response"]["status_code"]) for record in errors] == [("missing", 404)]
    assert batch.id in [listed.id for listed in client.batches.list()]
    assert client.batches.cancel(batch.id).status == "completed", "an ended batch stays as it ended"
    assert client.files.delete(source.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(source.id)
