"""The Responses API at the gateway (services/gateway/responses_api.py): a body rewritten as
the chat request it means, what Shoal does not serve refused naming the field, and an answer
written as a ``response``."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import (
    Answer,
    FunctionCall,
    InMessage,
    InToolCall,
    ToolCallOut,
    decode_body,
    sampling_params,
    template_kwargs,
    usage,
)
from shoal.services.gateway.responses_api import (
    FunctionCallItem,
    MessageItem,
    ResponseShell,
    ResponsesRequest,
    answer_turn,
    chat_request,
    response_object,
    responses_turn,
)
from shoal.services.gateway.responses_items import (
    ContentPart,
    FunctionCallOutputItem,
    InputMessageItem,
    ItemList,
    ItemReference,
    page,
    read_input,
    turns_of,
)
from shoal.services.gateway.tools import tool_plan, tool_specs
from shoal.shared.messages import TokenLogprob

TOOL = {"type": "function", "name": "get_time", "description": "The time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}


def _request(**fields: Any) -> ResponsesRequest:
    body = {"model": "m", "input": "hi"} | fields
    request = decode_body(msgspec.json.encode(body), ResponsesRequest)
    assert isinstance(request, ResponsesRequest)
    return request


def _messages(**fields: Any) -> list[dict[str, Any]]:
    """The chat messages, their unset fields left out."""
    return [{k: v for k, v in msgspec.to_builtins(m).items() if v is not None}
            for m in chat_request(_request(**fields)).messages]


def test_a_string_input_is_one_user_turn_after_the_instructions() -> None:
    assert _messages(input="Say hi", instructions="Be brief.") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]


def test_items_become_turns_with_calls_joined_to_the_assistant_turn_before_them() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Time "},
                                                        {"type": "input_text", "text": "in Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_time", "arguments": '{"zone":"CET"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "11:00"}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_time", "arguments": "{}"},
    ]
    assert _messages(input=items) == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Time in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "function": {"name": "get_time", "arguments": '{"zone":"CET"}'}, "type": "function"},
            {"id": "call_2", "function": {"name": "get_time", "arguments": "{}"}, "type": "function"}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
        {"role": "tool", "content": "11:00", "tool_call_id": "call_2"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_3", "function": {"name": "get_time", "arguments": "{}"}, "type": "function"}]},
    ]


def test_an_assistants_replayed_refusal_is_its_text_and_a_users_is_a_400() -> None:
    refused = {"type": "message", "role": "assistant",
               "content": [{"type": "refusal", "refusal": "I can't help with that."}]}
    assert _messages(input=[{"role": "user", "content": "Help?"}, refused, {"role": "user", "content": "Why?"}])[1] == {
        "role": "assistant", "content": "I can't help with that."}
    with pytest.raises(BadRequest) as caught:
        read_input([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])
    assert caught.value.param == "input" and "refusal" in caught.value.message


def test_tools_tool_choice_and_text_format_mean_what_chat_means() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    chat = chat_request(_request(tools=[TOOL], tool_choice={"type": "function", "name": "get_time"},
                                 parallel_tool_calls=False, max_output_tokens=40, temperature=0.5))
    plan = tool_plan(chat)
    assert plan is not None and (plan.choice, plan.function, plan.parallel) == ("named", "get_time", False)
    (spec,) = tool_specs(chat) or []
    assert (spec.name, spec.description, spec.parameters) == ("get_time", "The time", TOOL["parameters"])
    assert (chat.max_completion_tokens, chat.temperature) == (40, 0.5)

    formatted = chat_request(_request(text={"format": {"type": "json_schema", "name": "x", "schema": schema}}))
    assert json.loads(sampling_params(formatted, None, 16).json_schema or "") == schema
    as_object = chat_request(_request(text={"format": {"type": "json_object"}}))
    assert sampling_params(as_object, None, 16).json_schema == '{"type": "object"}'
    assert sampling_params(chat_request(_request(text={"format": {"type": "text"}})), None, 16).json_schema is None


def test_vllm_and_shoal_fields_ride_along() -> None:
    params = sampling_params(chat_request(_request(ignore_eos=True, seed=5, top_k=4, min_p=0.1,
                                                   repetition_penalty=1.2)), None, 16)
    assert (params.ignore_eos, params.seed, params.top_k, params.min_p, params.repetition_penalty) == (
        True, 5, 4, 0.1, 1.2)
    assert chat_request(_request(session_id="s1")).session_id == "s1"


def test_logprobs_come_with_include() -> None:
    wanted = chat_request(_request(include=["message.output_text.logprobs"], top_logprobs=3))
    assert sampling_params(wanted, None, 16).logprobs == 3
    assert sampling_params(chat_request(_request(top_logprobs=3)), None, 16).logprobs is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"reasoning": {"summary": "long"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),  # only the store resolves one
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "no spaces", "arguments": "{}"}]}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ],
)
def test_what_shoal_does_not_serve_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        chat_request(_request(**fields))
    assert caught.value.param == param and caught.value.message


def test_a_turn_goes_on_from_the_previous_conversation_as_one_session() -> None:
    history = [InMessage(role="user", content="Time?"), InMessage(role="assistant", content=None, tool_calls=[
        InToolCall("call_1", FunctionCall("get_time", "{}"))])]
    follow_up = _request(input=[{"type": "function_call_output", "call_id": "call_1", "output": "12:00"}],
                         instructions="Be brief.", previous_response_id="resp_first")
    turn = responses_turn(follow_up, "resp_second", history, "resp_first")
    assert [m.role for m in turn.chat.messages] == ["system", "user", "assistant", "tool"]
    assert [m.role for m in turn.conversation] == ["user", "assistant", "tool"]  # instructions are not kept
    assert turn.stores and turn.chat.session_id == "resp_first"

    first = responses_turn(_request(), "resp_first")
    assert first.chat.session_id == "resp_first" and [m.content for m in first.conversation] == ["hi"]
    unstored = responses_turn(_request(store=False), "resp_x")
    assert not unstored.stores and unstored.chat.session_id is None
    assert responses_turn(_request(session_id="mine"), "resp_y").chat.session_id == "mine"


def test_an_answer_becomes_the_assistant_turn_a_later_request_goes_on_from() -> None:
    call = ToolCallOut("call_9", FunctionCall("get_time", '{"zone": "UTC"}'))
    answered = response_object(_shell(tools=[TOOL]), Answer("Let me see.", "tool_calls", tool_calls=[call],
                                                            reasoning="thinking"), usage(3, 12))
    turn = answer_turn(answered)
    assert (turn.role, turn.content) == ("assistant", "Let me see.")
    assert [(c.id, c.function.name, c.function.arguments) for c in turn.tool_calls or ()] == [
        ("call_9", "get_time", '{"zone": "UTC"}')]
    only_call = answer_turn(response_object(_shell(tools=[TOOL]), Answer("", "tool_calls", tool_calls=[call]),
                                            usage(3, 9)))
    assert only_call.content is None


def _shell(**fields: Any) -> ResponseShell:
    return ResponseShell("resp_1", 1_700_000_000, _request(**fields))


def test_a_text_answer_is_one_message() -> None:
    scored = [TokenLogprob(b"Hi", -0.5, [(b"Hi", -0.5), (b"Yo", -1.5)])]
    response = response_object(_shell(metadata={"k": "v"}, include=["message.output_text.logprobs"]),
                               Answer("Hi", "stop", scored), usage(7, 1))
    (item,) = response.output
    assert isinstance(item, MessageItem) and item.status == "completed" and item.id.startswith("msg_")
    (part,) = item.content
    assert part.text == "Hi" and [(lp.token, lp.logprob, len(lp.top_logprobs)) for lp in part.logprobs] == [
        ("Hi", -0.5, 2)]
    assert (response.status, response.incomplete_details, response.metadata) == ("completed", None, {"k": "v"})
    assert response.usage is not None and (response.usage.input_tokens, response.usage.output_tokens,
                                           response.usage.total_tokens) == (7, 1, 8)


def test_an_answer_cut_at_max_output_tokens_is_incomplete() -> None:
    response = response_object(_shell(max_output_tokens=2), Answer("ab", "length"), usage(3, 2))
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.output[0].status == "incomplete"


def test_calls_are_function_call_items_after_any_text() -> None:
    call = ToolCallOut("call_9", FunctionCall("get_time", '{"zone": "UTC"}'))
    only_calls = response_object(_shell(tools=[TOOL]), Answer("", "tool_calls", tool_calls=[call]), usage(3, 9))
    (item,) = only_calls.output
    assert isinstance(item, FunctionCallItem) and item.id.startswith("fc_")
    assert (item.call_id, item.name, item.arguments, item.status) == ("call_9", "get_time", '{"zone": "UTC"}',
                                                                      "completed")
    assert only_calls.status == "completed" and only_calls.tool_choice == "auto"

    with_text = response_object(_shell(tools=[TOOL]), Answer("Let me see.", "tool_calls", tool_calls=[call]),
                                usage(3, 12))
    assert [type(item) for item in with_text.output] == [MessageItem, FunctionCallItem]
    assert [item["type"] for item in msgspec.to_builtins(with_text)["output"]] == ["message", "function_call"]


@pytest.mark.parametrize(("fields", "echoed"), [
    ({}, "auto"),                                       # OpenAI's default, with tools or without
    ({"tools": [TOOL]}, "auto"),
    ({"tool_choice": "none"}, "none"),
    ({"tools": [TOOL], "tool_choice": "required"}, "required"),
])
def test_tool_choice_is_echoed_as_sent_and_auto_when_unsent(fields: dict[str, Any], echoed: str) -> None:
    assert response_object(_shell(**fields), Answer("Hi", "stop"), usage(1, 1)).tool_choice == echoed


def test_input_items_keep_the_clients_ids_and_get_new_ones_otherwise() -> None:
    items = read_input([{"role": "user", "content": "hi", "id": "msg_mine"},
                        {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "c1", "output": "noon", "id": "bad id!"},
                        {"type": "reasoning", "summary": []},
                        {"type": "item_reference", "id": "fc_x"}])
    message, call, output, reference = items
    assert isinstance(message, InputMessageItem) and message.id == "msg_mine"
    assert message.content == [ContentPart("input_text", "hi")]
    assert isinstance(call, FunctionCallItem) and call.id.startswith("fc_")
    assert isinstance(output, FunctionCallOutputItem) and output.id.startswith("fco_") and output.id != "bad id!"
    assert reference == ItemReference(id="fc_x", index=4)
    assert [m.role for m in turns_of([message, call, output])] == ["user", "assistant", "tool"]


def test_input_items_are_listed_a_page_at_a_time_in_either_order() -> None:
    items = read_input([{"role": "user", "content": str(i), "id": f"msg_{i}"} for i in range(5)])
    typed = [item for item in items if isinstance(item, InputMessageItem)]
    newest = page(typed, limit=2, order="desc", after=None)
    assert [i.id for i in newest.data] == ["msg_4", "msg_3"] and newest.has_more
    assert (newest.first_id, newest.last_id) == ("msg_4", "msg_3")
    rest = page(typed, limit=20, order="desc", after="msg_3")
    assert [i.id for i in rest.data] == ["msg_2", "msg_1", "msg_0"] and not rest.has_more
    assert [i.id for i in page(typed, limit=3, order="asc", after="msg_0").data] == ["msg_1", "msg_2", "msg_3"]
    assert page(typed, limit=5, order="asc", after="msg_4") == ItemList(data=[], first_id=None, last_id=None,
                                                                        has_more=False)
    with pytest.raises(BadRequest) as caught:
        page(typed, limit=1, order="asc", after="msg_9")
    assert caught.value.param == "after"


def test_reasoning_effort_reaches_the_chat_template_and_encrypted_reasoning_is_a_no_op() -> None:
    chat = chat_request(_request(reasoning={"effort": "low", "summary": "auto"},
                                 include=["reasoning.encrypted_content"]))
    assert chat.reasoning_effort == "low" and chat.logprobs is None
    assert template_kwargs(chat) == {"reasoning_effort": "low"}
    shell = ResponseShell("resp_1", 0, _request(reasoning={"effort": "low", "summary": "auto"}))
    echoed = msgspec.to_builtins(shell.make("completed", []))["reasoning"]
    assert echoed == {"effort": "low", "summary": "auto"}
    both = chat_request(_request(reasoning={"effort": "high"}, chat_template_kwargs={"reasoning_effort": "low"}))
    with pytest.raises(BadRequest) as caught:
        template_kwargs(both)
    assert caught.value.param == "reasoning_effort"
