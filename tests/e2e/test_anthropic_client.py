"""Anthropic's own Python client (`anthropic`) against `shoal up`'s ``/v1/messages``: what a
user of an Anthropic-minded tool pointed at a local server does. Every answer is checked
against what the OpenAI API answers to the same request, so the two APIs cannot drift apart."""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import openai
import pytest

from tests.e2e.conftest import ShoalUp, http_json

pytestmark = pytest.mark.e2e

SMALL = "demo/llama-5m"
OTHER = "demo/qwen2-25m"
GREEDY = {"temperature": 0}
"""Sent as `extra_body`: Anthropic's current SDK no longer takes sampling arguments."""
QUESTION = [{"role": "user", "content": "Which sea is the saltiest?"}]
TIME_TOOL = {"name": "get_time", "description": "The time in a zone",
             "input_schema": {"type": "object", "additionalProperties": False, "required": ["zone"],
                              "properties": {"zone": {"enum": ["UTC", "CET"]}}}}


@pytest.fixture(scope="module")
def api(shoal: ShoalUp) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=shoal.base_url, api_key="unused", max_retries=0, timeout=240)


def _post(shoal: ShoalUp, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return http_json(shoal.base_url, "POST", path, body, timeout_s=120)


def _greedy_chat(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int = 8, **extra: Any) -> Any:
    return client.chat.completions.create(model=SMALL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          **extra)


def test_a_message_is_the_chat_completions_answer(api: anthropic.Anthropic, client: openai.OpenAI) -> None:
    message = api.messages.create(model=SMALL, max_tokens=8, extra_body=GREEDY, messages=QUESTION)  # type: ignore[arg-type]
    expected = _greedy_chat(client, QUESTION)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == SMALL
    assert message._request_id == message.id.removeprefix("msg_")  # the `request-id` header the SDK reads
    (block,) = message.content
    assert block.type == "text" and block.text == expected.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = expected.usage
    assert message.usage.output_tokens == usage.completion_tokens == 8
    # Anthropic counts the prompt's tokens read from a cache apart from those computed
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == usage.prompt_tokens

    with api.messages.stream(model=SMALL, max_tokens=8, extra_body=GREEDY, messages=QUESTION) as stream:  # type: ignore[arg-type]
        events = list(stream)
        streamed = stream.get_final_message()
    assert [events[0].type, events[-1].type] == ["message_start", "message_stop"]
    assert events[0].message.usage.input_tokens == usage.prompt_tokens  # older clients read it only there
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"
                   ) == block.text
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    assert streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == 8
    assert streamed.usage.input_tokens + (streamed.usage.cache_read_input_tokens or 0) == usage.prompt_tokens


def test_the_system_prompt_and_a_prefilled_answer(api: anthropic.Anthropic, client: openai.OpenAI) -> None:
    system = "Answer in one word."
    message = api.messages.create(model=SMALL, max_tokens=8, extra_body=GREEDY, system=system,  # type: ignore[arg-type]
                                  messages=QUESTION)
    expected = _greedy_chat(client, [{"role": "system", "content": system}, *QUESTION])
    assert message.content[0].text == expected.choices[0].message.content  # type: ignore[union-attr]

    blocks = api.messages.create(model=SMALL, max_tokens=8, extra_body=GREEDY,
                                 system=[{"type": "text", "text": system}],
                                 messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}])
    assert blocks.content[0].text == message.content[0].text  # type: ignore[union-attr]

    prefilled = [*QUESTION, {"role": "assistant", "content": "The Dead"}]  # the answer goes on from it
    continued = api.messages.create(model=SMALL, max_tokens=8, extra_body=GREEDY, messages=prefilled)  # type: ignore[arg-type]
    expected_continued = _greedy_chat(client, prefilled, extra_body={"continue_final_message": True})
    assert continued.content[0].text == expected_continued.choices[0].message.content  # type: ignore[union-attr]


def test_a_stop_sequence_ends_the_answer_and_is_named(api: anthropic.Anthropic, client: openai.OpenAI) -> None:
    free = _greedy_chat(client, QUESTION, max_tokens=24).choices[0].message.content
    words = free.split()
    stop = next(word for word in words[2:] if len(word) > 2 and free.index(word) > 0)
    message = api.messages.create(model=SMALL, max_tokens=24, extra_body=GREEDY, messages=QUESTION,  # type: ignore[arg-type]
                                  stop_sequences=["never-written-\u2603", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == free[:free.index(stop)]  # type: ignore[union-attr]
    with api.messages.stream(model=SMALL, max_tokens=24, extra_body=GREEDY, messages=QUESTION,  # type: ignore[arg-type]
                             stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    # vLLM's `stop_reason` on /v1 names it too
    chat = client.chat.completions.create(model=SMALL, messages=QUESTION, max_tokens=24, temperature=0, stop=[stop])  # type: ignore[arg-type]
    assert (chat.choices[0].finish_reason, chat.choices[0].model_extra["stop_reason"]) == ("stop", stop)


def test_a_forced_tool_is_a_tool_use_block_and_its_result_goes_back(shoal: ShoalUp, api: anthropic.Anthropic
                                                                     ) -> None:
    kwargs: dict[str, Any] = dict(model=OTHER, max_tokens=60, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Time?"}], tools=[TIME_TOOL])
    message = api.messages.create(**kwargs, tool_choice={"type": "tool", "name": "get_time"})
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_time" and call.id.startswith("toolu_")
    assert call.input["zone"] in ("UTC", "CET") and message.stop_reason == "tool_use"  # type: ignore[index]
    with api.messages.stream(**kwargs, tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        streamed = stream.get_final_message()
    (streamed_call,) = streamed.content
    assert streamed_call.type == "tool_use" and streamed_call.name == "get_time"
    assert streamed_call.input["zone"] in ("UTC", "CET") and streamed.stop_reason == "tool_use"  # type: ignore[index]

    # The call and its result go back as the model's template renders an OpenAI chat's.
    history = [{"role": "user", "content": "Time?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": "get_time",
                                                  "input": call.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12:00"}]}]
    counted = api.messages.count_tokens(model=OTHER, messages=history, tools=[TIME_TOOL])  # type: ignore[arg-type]
    status, tokenized = _post(shoal, "/tokenize", {"model": OTHER, "messages": [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "get_time", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"}],
        "tools": [{"type": "function", "function": {"name": "get_time", "description": TIME_TOOL["description"],
                                                    "parameters": TIME_TOOL["input_schema"]}}]})
    assert status == 200 and counted.input_tokens == tokenized["count"] > 0
    answer = api.messages.create(model=OTHER, max_tokens=4, extra_body=GREEDY, messages=history,  # type: ignore[arg-type]
                                 tools=[TIME_TOOL])
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == counted.input_tokens


def test_a_reasoning_models_thinking_is_a_thinking_block(shoal: ShoalUp, api: anthropic.Anthropic,
                                                          client: openai.OpenAI) -> None:
    status, body = _post(shoal, "/admin/models", {"key": "org/anthropic-thinker", "path": SMALL,
                                                  "reasoning_parser": "deepseek_r1"})
    assert status == 200, body
    kwargs: dict[str, Any] = dict(model="org/anthropic-thinker", max_tokens=8, extra_body=GREEDY, messages=QUESTION)
    thinks = {"type": "enabled", "budget_tokens": 1024}
    message = api.messages.create(**kwargs, thinking=thinks)
    expected = client.chat.completions.create(model="org/anthropic-thinker", messages=QUESTION, max_tokens=8,
                                              temperature=0)
    reasoning = expected.choices[0].message.model_extra["reasoning_content"]  # random weights never close it
    assert reasoning and [(b.type, getattr(b, "thinking", None)) for b in message.content] == [("thinking", reasoning)]
    with api.messages.stream(**kwargs, thinking=thinks) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == reasoning
    assert [b.type for b in streamed.content] == ["thinking"]
    # Without `thinking`, an answer has no thinking blocks, as Anthropic's models answer (this
    # model, of random weights, thinks to the end: its answer is empty)
    unasked = api.messages.create(**kwargs)
    assert [b.model_dump(include={"type", "text"}) for b in unasked.content] == [{"type": "text", "text": ""}]
    assert unasked.usage.output_tokens == 8


def test_budget_tokens_bounds_the_thinking(shoal: ShoalUp, api: anthropic.Anthropic, client: openai.OpenAI) -> None:
    """``thinking.budget_tokens``: the think block is closed when it is spent and the model
    answers in a text block, as ``thinking_token_budget`` answers on /v1."""
    status, body = _post(shoal, "/admin/models", {"key": "org/anthropic-budget", "path": SMALL,
                                                  "reasoning_parser": "deepseek_r1"})
    assert status == 200, body
    message = api.messages.create(model="org/anthropic-budget", max_tokens=16, extra_body=GREEDY, messages=QUESTION,
                                  thinking={"type": "enabled", "budget_tokens": 3})
    expected = client.chat.completions.create(model="org/anthropic-budget", messages=QUESTION, max_tokens=16,
                                              temperature=0, extra_body={"thinking_token_budget": 3}).choices[0]
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == expected.message.model_extra["reasoning_content"]
    assert message.content[1].text == expected.message.content and expected.message.content
    assert message.usage.output_tokens == 16


def test_output_config_format_shapes_the_answer(api: anthropic.Anthropic) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["sea"],
              "properties": {"sea": {"enum": ["Baltic", "North"]}}}
    message = api.messages.create(model=SMALL, max_tokens=40, messages=QUESTION, extra_body=GREEDY,  # type: ignore[arg-type]
                                  output_config={"format": {"type": "json_schema", "schema": schema},
                                                 "effort": "max"})
    assert json.loads(message.content[0].text)["sea"] in ("Baltic", "North")  # type: ignore[union-attr]


def test_models_are_listed_in_anthropics_form(api: anthropic.Anthropic, client: openai.OpenAI) -> None:
    served = sorted(model.id for model in client.models.list())
    assert [model.id for model in api.models.list()] == served  # the SDK pages through them all
    first = api.models.list(limit=1)
    assert [model.id for model in first.data] == served[:1] and first.has_more == (len(served) > 1)
    model = api.models.retrieve(SMALL)
    assert (model.id, model.type) == (SMALL, "model") and model.created_at.year >= 2026


def test_errors_come_in_anthropics_form(shoal: ShoalUp, api: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        api.messages.create(model="no/such-model", max_tokens=8, messages=QUESTION)  # type: ignore[arg-type]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    status, body = _post(shoal, "/v1/messages", {"model": SMALL, "messages": QUESTION})
    assert status == 400 and body["type"] == "error" and "max_tokens" in body["error"]["message"]
    status, body = _post(shoal, "/v1/messages", {"model": SMALL, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    assert status == 400 and "image blocks are not supported" in body["error"]["message"]
    status, body = _post(shoal, "/v1/messages", {"model": SMALL, "max_tokens": 8, "messages": QUESTION,
                                                 "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert status == 400 and "one of Anthropic's own" in body["error"]["message"]
    long_prompt = [{"role": "user", "content": "The tide comes in. " * 2000}]  # past the model's context
    with pytest.raises(anthropic.BadRequestError) as too_long:  # Anthropic's 400, which clients compact on
        api.messages.create(model=SMALL, max_tokens=8, messages=long_prompt)  # type: ignore[arg-type]
    assert too_long.value.body["error"]["message"].startswith("prompt is too long: ")  # type: ignore[index]
    assert too_long.value.body["request_id"] == too_long.value.response.headers["request-id"]  # type: ignore[index]
    status, body = _post(shoal, "/v1/messages", {"model": SMALL, "max_tokens": 8, "messages": QUESTION,
                                                 "temperature": 1.5})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert api.messages.create(model=SMALL, max_tokens=2, messages=QUESTION).usage.output_tokens == 2  # type: ignore[arg-type]


def test_message_batches_answer_through_anthropics_client(api: anthropic.Anthropic) -> None:
    """Anthropic's Message Batches API as its client uses it: make a batch, wait for it to
    end, read its results (the messages a direct request gets; a refusal as an error); a
    cancelled batch's unsent requests are ``canceled``; an ended batch is deleted."""
    params = {"model": SMALL, "max_tokens": 6, "messages": QUESTION, **GREEDY}
    batch = api.messages.batches.create(requests=[  # type: ignore[list-item]
        {"custom_id": "a", "params": params},
        {"custom_id": "missing", "params": {**params, "model": "org/none"}},
        {"custom_id": "b", "params": params}])
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 3
    deadline = time.monotonic() + 120
    while batch.processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = api.messages.batches.retrieve(batch.id)
    counts = batch.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 2, 1, 0, 0)
    assert batch.ended_at is not None and batch.results_url and batch.results_url.endswith(f"{batch.id}/results")
    direct = api.messages.create(model=SMALL, max_tokens=6, messages=QUESTION, extra_body=GREEDY)  # type: ignore[arg-type]
    results = list(api.messages.batches.results(batch.id))
    assert [result.custom_id for result in results] == ["a", "missing", "b"]
    assert [result.result.type for result in results] == ["succeeded", "errored", "succeeded"]
    assert results[0].result.message.content == direct.content  # type: ignore[union-attr]
    assert results[1].result.error.error.type == "not_found_error"  # type: ignore[union-attr]
    assert batch.id in [listed.id for listed in api.messages.batches.list()]
    assert api.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        api.messages.batches.retrieve(batch.id)

    with pytest.raises(anthropic.BadRequestError) as refused:
        api.messages.batches.create(requests=[{"custom_id": "x", "params": params},  # type: ignore[list-item]
                                               {"custom_id": "x", "params": params}])
    assert "requests[1]" in str(refused.value)
