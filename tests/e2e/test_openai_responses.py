"""The `openai` client's Responses API (``client.responses``) against `shoal up`: the same
answers as chat gives, streamed through the client's own event accumulator (which checks the
events' order and identities), function calls and their results, structured output."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import ShoalUp

pytestmark = pytest.mark.e2e

SMALL = "demo/llama-5m"
OTHER = "demo/qwen2-25m"
TIME_TOOL: dict[str, Any] = {
    "type": "function", "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"enum": ["UTC", "CET"]}}}}


class Shirt(BaseModel):
    name: str = Field(max_length=8)
    ok: bool


def test_a_response_is_what_chat_answers_for_the_same_turns(client: openai.OpenAI) -> None:
    response = client.responses.create(model=SMALL, instructions="Be brief.", input="Say hello.",
                                       max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(
        model=SMALL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
        max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert response.id.startswith("resp_") and response.object == "response" and response.model == SMALL
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == chat.choices[0].message.content
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 8 and response.usage.total_tokens == chat.usage.total_tokens
    assert response.instructions == "Be brief." and response.max_output_tokens == 8 and response.store is True
    # What stateless clients send by default: a reasoning effort and encrypted reasoning (the demo
    # template ignores the effort, so the answer is the same).
    effortful = client.responses.create(model=SMALL, instructions="Be brief.", input="Say hello.",
                                        max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True},
                                        reasoning={"effort": "low", "summary": "auto"},
                                        include=["reasoning.encrypted_content"])
    assert effortful.output_text == response.output_text
    assert effortful.reasoning is not None and effortful.reasoning.effort == "low"


def test_a_streamed_response_ends_as_the_collected_one(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=OTHER, input="Describe a shirt.", text_format=Shirt, temperature=0,
                                  max_output_tokens=120)
    collected = client.responses.parse(**kwargs)
    assert collected.status == "completed" and isinstance(collected.output_parsed, Shirt)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    assert streamed.output_parsed == collected.output_parsed and streamed.output_text == collected.output_text
    assert streamed.usage == collected.usage
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == collected.output_text


def test_a_response_cut_short_streams_to_response_incomplete(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=SMALL, input="Count.", max_output_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    collected = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == collected.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == collected.output_text


def test_a_forced_call_and_its_result_make_the_next_turn(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=OTHER, input="Time in Oslo?", tools=[TIME_TOOL], tool_choice="required",
                                  parallel_tool_calls=False, max_output_tokens=80, extra_body={"seed": 3})
    response = client.responses.create(**kwargs)
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_time" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["zone"] in ("UTC", "CET")
    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        (streamed,) = stream.get_final_response().output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]

    # The call and its result sent back: the prompt is the chat template's for the same turns.
    follow_up = client.responses.create(
        model=OTHER, tools=[TIME_TOOL], max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": "Time in Oslo?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    chat = client.chat.completions.create(
        model=OTHER, max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
        tools=[{"type": "function", "function": {k: v for k, v in TIME_TOOL.items() if k != "type"}}],
        messages=[{"role": "user", "content": "Time in Oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                   "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}])
    assert follow_up.usage.input_tokens == chat.usage.prompt_tokens
    assert follow_up.output_text == chat.choices[0].message.content

    # The follow-up's input items, as stored (the call kept its id), newest first by default...
    listed = client.responses.input_items.list(follow_up.id)
    assert [item.type for item in listed.data] == ["function_call_output", "function_call", "message"]
    assert listed.data[1].id == call.id and listed.data[2].content[0].text == "Time in Oslo?"
    oldest = client.responses.input_items.list(follow_up.id, order="asc", limit=1)
    assert [item.id for item in oldest.data] == [listed.data[2].id] and oldest.has_more
    # ... and the call named by reference (to the first response's output item): the same prompt.
    by_reference = client.responses.create(
        model=OTHER, tools=[TIME_TOOL], max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": "Time in Oslo?"}, {"type": "item_reference", "id": call.id},
               {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert by_reference.usage.input_tokens == follow_up.usage.input_tokens
    assert by_reference.output_text == follow_up.output_text
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=OTHER, input=[{"type": "item_reference", "id": "fc_never"}])
    assert caught.value.body["param"] == "input"


def test_output_logprobs_come_with_include(client: openai.OpenAI) -> None:
    response = client.responses.create(model=SMALL, input="Hi", max_output_tokens=6, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    (part,) = response.output[0].content
    assert len(part.logprobs) == 6 and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 3 and lp.logprob <= 0 for lp in part.logprobs)
    events = list(client.responses.create(model=SMALL, input="Hi", max_output_tokens=6, temperature=0,
                                          include=["message.output_text.logprobs"], top_logprobs=3, stream=True,
                                          extra_body={"ignore_eos": True}))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in part.logprobs]


def test_a_chain_of_responses_goes_on_from_the_stored_conversation_as_one_session(client: openai.OpenAI,
                                                                                   shoal: ShoalUp) -> None:
    greedy: dict[str, Any] = dict(model=SMALL, max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    first = client.responses.create(instructions="Be brief.", input="Say hello.", **greedy)
    assert first.store is True
    second = client.responses.create(previous_response_id=first.id, input="Again.", **greedy)
    assert second.previous_response_id == first.id
    # Its prompt: the first turn and its answer (the instructions are not carried over), then the new input.
    chat = client.chat.completions.create(
        model=SMALL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "Again."}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    events = list(client.responses.create(previous_response_id=second.id, input="Once more.", stream=True, **greedy))
    assert events[-1].type == "response.incomplete"  # at max_output_tokens, and stored all the same
    third = client.responses.retrieve(events[-1].response.id)  # stored before its last event went out
    assert third.previous_response_id == second.id and third.usage.input_tokens > second.usage.input_tokens
    # ... and its session's KV served it: the second turn's whole blocks (worker.block_size 16) were cached.
    kept = (second.usage.input_tokens + second.usage.output_tokens - 1) // 16 * 16
    assert third.usage.input_tokens_details.cached_tokens >= kept > 0, (kept, third.usage)

    # The chain is one chat session, named after its first response: a replica holds its KV.
    with urllib.request.urlopen(f"{shoal.base_url}/admin/sessions?model={SMALL}", timeout=30) as listed:
        sessions = json.load(listed)["sessions"]
    assert first.id in {session["session_id"] for session in sessions}

    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(previous_response_id=first.id, input="Gone?", **greedy)
    assert caught.value.body["param"] == "previous_response_id"


def test_a_response_made_with_store_false_is_not_kept(client: openai.OpenAI) -> None:
    response = client.responses.create(model=SMALL, input="Hi", max_output_tokens=2, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_what_shoal_does_not_serve_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=SMALL, input="Again", background=True)
    assert caught.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=SMALL, input="x", text={"format": {
            "type": "json_schema", "name": "bad", "schema": {"type": 5}}})
    assert caught.value.body["param"] == "text"
