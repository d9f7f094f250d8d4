"""OpenAI's Responses API (``POST /v1/responses``), as a chat request underneath.

A Responses body is validated here and rewritten as the `ChatCompletionRequest` it means, so
it is placed, queued, templated, sampled and read for calls exactly as a chat request is:

* ``input``: a string (one user turn) or a list of items (responses_items.py): messages,
  ``function_call`` and ``function_call_output`` items, ``item_reference`` to a stored item.
* ``instructions``: a system turn before the input.
* ``max_output_tokens``, ``temperature``, ``top_p``; ``tools`` (``function`` tools),
  ``tool_choice``, ``parallel_tool_calls``; ``text.format`` (``text``, ``json_object``,
  ``json_schema``); ``include: ["message.output_text.logprobs"]`` with ``top_logprobs``.
  Shoal's ``session_id`` and vLLM's ``chat_template_kwargs``, ``ignore_eos``, ``seed``,
  ``top_k``, ``min_p``, ``repetition_penalty`` ride along as in chat.

A response is stored unless ``store: false`` (response_store.py): ``previous_response_id``
goes on from it (`responses_turn`; the chain runs as one chat session, so replicas keep its
KV between turns), ``GET`` / ``DELETE /v1/responses/{id}`` read and forget it, and ``GET
/v1/responses/{id}/input_items`` lists its input. ``conversation`` objects and ``background``
are a 400 naming the field, as are images, files and hosted tools.

The answer (`response_object`) is a ``response`` with a ``reasoning`` item for a reasoning
model's thinking, a ``message`` item for the text and a ``function_call`` item per call, in
that order; ``status`` is ``incomplete`` with
``incomplete_details.reason: "max_output_tokens"`` when the answer was cut at the limit.
The streamed form is responses_stream.py.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import (
    MAX_TOOLS,
    Answer,
    ChatCompletionRequest,
    ChatTokenLogprob,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    InMessage,
    InToolCall,
    MaxTokens,
    MinP,
    NamedFunction,
    NamedToolChoice,
    ReasoningEffort,
    RepetitionPenalty,
    Seed,
    Temperature,
    TemplateKwargs,
    ToolDefinition,
    TopK,
    TopLogprobs,
    TopP,
    Usage,
    chat_logprobs,
)
from shoal.services.gateway.responses_items import (
    FunctionCallItem,
    InputItem,
    read_input,
    resolved,
    turns_of,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` value that asks for the output text's log probabilities."""
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
"""Accepted, and nothing to add: past reasoning is never carried into a prompt (chat templates
leave it out), so there is no state to hand back."""
MAX_METADATA_KEYS = 16


class ResponsesTool(Struct, kw_only=True):
    """A tool as the Responses API declares it (flat: no ``function`` wrapper)."""

    type: str
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(Struct, kw_only=True):
    type: str
    name: str | None = None


class TextConfig(Struct, kw_only=True, omit_defaults=True):
    format: dict[str, Any] | None = None
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "name", "schema"}``."""
    verbosity: str | None = None


class ResponsesReasoning(Struct, kw_only=True, omit_defaults=True):
    """``reasoning``: ``effort`` reaches the chat template as ``reasoning_effort``; ``summary``
    is accepted (a reasoning item carries the thinking whole, not summarized)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Struct, kw_only=True):
    model: str
    input: Annotated[str, Meta(min_length=1)] | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    tools: Annotated[list[ResponsesTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: TopLogprobs | None = None
    store: bool | None = None
    """Keep the response (response_store.py); true unless false, as OpenAI has it."""
    metadata: Annotated[dict[str, str], Meta(max_length=MAX_METADATA_KEYS)] | None = None
    """Returned as sent."""
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    reasoning: ResponsesReasoning | None = None
    # Shoal's and vLLM's, as in chat (the openai client sends them through `extra_body`).
    session_id: str | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    ignore_eos: bool | None = None
    seed: Seed | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None


_UNSERVED = (
    ("conversation", "Shoal keeps no conversation objects: go on from a response with previous_response_id"),
    ("background", "background responses are not supported"),
)
UNSERVED_FIELDS = tuple(name for name, _ in _UNSERVED)
"""Fields accepted only when absent (``null``, ``false``)."""


@dataclass(frozen=True)
class Turn:
    """What one Responses request makes: the chat request, and the conversation it stores."""

    chat: ChatCompletionRequest
    conversation: list[InMessage]
    """The turns so far (the previous response's, then this input), without ``instructions``
    and without the answer."""
    items: list[InputItem]
    """This request's input items (references resolved), as stored with its answer."""
    stores: bool
    """Keep the answer (``store``, true unless false)."""


def responses_turn(req: ResponsesRequest, response_id: str, history: list[InMessage] | None = None,
                   chain_session_id: str | None = None, items: list[InputItem] | None = None) -> Turn:
    """The turn `req` makes from its input `items` (read from `req` when None), going on from
    `history` (the conversation a previous response ended, whose chain is chat session
    `chain_session_id`). A stored response's chain runs as one chat session, named after its
    first response (unless the request names its own)."""
    items = resolved(read_input(req.input)) if items is None else items
    conversation = [*(history or ()), *turns_of(items)]
    stores = req.store is not False
    session_id = req.session_id or chain_session_id or (response_id if stores else None)
    return Turn(chat_request(req, conversation, session_id), conversation, items, stores)


def chat_request(req: ResponsesRequest, conversation: list[InMessage] | None = None,
                 session_id: str | None = None) -> ChatCompletionRequest:
    """The chat request `req` means (its input after `conversation` when given, as the chat
    session `session_id`); a 400 naming the field for what Shoal does not serve."""
    for name, why in _UNSERVED:
        if getattr(req, name):
            raise BadRequest(why, code="unsupported_parameter", param=name)
    wants_logprobs = _wants_logprobs(req.include)
    turns = conversation if conversation is not None else turns_of(resolved(read_input(req.input)))
    messages = ([InMessage(role="system", content=req.instructions)] if req.instructions else []) + turns
    return ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=req.stream,
        tools=_chat_tools(req.tools),
        tool_choice=_chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text),
        logprobs=wants_logprobs or None,
        top_logprobs=req.top_logprobs if wants_logprobs else None,
        user=req.user,
        session_id=session_id or req.session_id,
        chat_template_kwargs=req.chat_template_kwargs,
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
    )


def _wants_logprobs(include: list[str] | None) -> bool:
    others = sorted(set(include or ()) - {LOGPROBS_INCLUDE, ENCRYPTED_REASONING_INCLUDE})
    if others:
        raise BadRequest(f"include: Shoal serves only {LOGPROBS_INCLUDE!r} and {ENCRYPTED_REASONING_INCLUDE!r}, "
                         f"not {others}", param="include")
    return LOGPROBS_INCLUDE in (include or ())


def _chat_tools(tools: list[ResponsesTool] | None) -> list[ToolDefinition] | None:
    if not tools:
        return None
    chat_tools = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise BadRequest(f"tools[{i}]: only function tools are supported, got {tool.type!r}", param="tools")
        if tool.name is None:
            raise BadRequest(f"tools[{i}]: a function tool needs a name", param="tools")
        chat_tools.append(ToolDefinition("function", FunctionDefinition(
            tool.name, tool.description, tool.parameters, tool.strict)))
    return chat_tools


def _chat_tool_choice(choice: str | ResponsesToolChoice | None) -> Any:
    if not isinstance(choice, ResponsesToolChoice):
        return choice
    if choice.type != "function" or choice.name is None:
        raise BadRequest('tool_choice: name a function as {"type": "function", "name": ...}, or send '
                         '"none", "auto" or "required"', param="tool_choice")
    return NamedToolChoice("function", NamedFunction(choice.name))


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (the schema nests under ``json_schema``)."""
    fmt = (text.format if text is not None else None) or {}
    kind = fmt.get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise BadRequest(f"text.format type {kind!r}: use \"text\", \"json_object\" or \"json_schema\"",
                         param="text")
    if kind != "json_schema":
        return fmt or None
    if not isinstance(fmt.get("schema"), dict):
        raise BadRequest('text.format: json_schema needs {"type": "json_schema", "name": ..., "schema": {...}}',
                         param="text")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}


# --------------------------------------------------------------------------- the response


class OutputText(Struct, kw_only=True):
    type: str = "output_text"
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = msgspec.field(default_factory=list)
    """Filled when ``include`` asks for them."""


class MessageItem(Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText]


class ReasoningText(Struct, kw_only=True):
    type: str = "reasoning_text"
    text: str


class ReasoningItem(Struct, kw_only=True, tag_field="type", tag="reasoning"):
    """A reasoning model's thinking (its ``reasoning_parser``), before the answer's message."""

    id: str
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText]
    status: str


OutputItem = ReasoningItem | MessageItem | FunctionCallItem


class InputTokensDetails(Struct):
    cached_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(Struct):
    code: str
    message: str


class IncompleteDetails(Struct):
    reason: str


Status = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponseObject(Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: Status
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    tool_choice: str | ResponsesToolChoice
    tools: list[ResponsesTool]
    text: TextConfig
    top_logprobs: int | None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str]
    store: bool = False
    previous_response_id: str | None = None
    reasoning: ResponsesReasoning | None = None
    background: bool = False
    user: str | None
    completed_at: int | None = None


@dataclass(frozen=True)
class ResponseShell:
    """What every form of one response repeats: the request's settings, echoed."""

    response_id: str
    created_at: int
    request: ResponsesRequest

    def make(self, status: Status, output: list[OutputItem], token_usage: Usage | None = None,
             error: ResponseError | None = None) -> ResponseObject:
        req = self.request
        incomplete = status == "incomplete"
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, error=error,
            incomplete_details=IncompleteDetails("max_output_tokens") if incomplete else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, model=req.model,
            output=output, parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            tool_choice=req.tool_choice or "auto", tools=req.tools or [],
            text=req.text or TextConfig(format={"type": "text"}), top_logprobs=req.top_logprobs,
            usage=None if token_usage is None else response_usage(token_usage),
            metadata=req.metadata or {}, user=req.user, store=req.store is not False,
            previous_response_id=req.previous_response_id, reasoning=req.reasoning,
            completed_at=int(time.time()) if status in ("completed", "incomplete") else None,
        )


class DeletedResponse(Struct):
    id: str
    object: str = "response"
    deleted: bool = True


def final_status(finish_reason: str) -> Status:
    """A finished response's status: ``incomplete`` when it stopped at ``max_output_tokens``."""
    return "incomplete" if finish_reason == "length" else "completed"


def response_usage(token_usage: Usage) -> ResponseUsage:
    return ResponseUsage(input_tokens=token_usage.prompt_tokens, output_tokens=token_usage.completion_tokens,
                         total_tokens=token_usage.total_tokens,
                         input_tokens_details=InputTokensDetails(token_usage.prompt_tokens_details.cached_tokens),
                         output_tokens_details=OutputTokensDetails(
                             token_usage.completion_tokens_details.reasoning_tokens))


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def function_call_id() -> str:
    return f"fc_{uuid.uuid4().hex}"


def reasoning_id() -> str:
    return f"rs_{uuid.uuid4().hex}"


def answer_turn(response: ResponseObject) -> InMessage:
    """A response's answer as the assistant turn a later request goes on from (its thinking
    left out, as chat templates leave it out of past turns)."""
    text = "".join(part.text for item in response.output if isinstance(item, MessageItem) for part in item.content)
    calls = [InToolCall(item.call_id, FunctionCall(item.name, item.arguments))
             for item in response.output if isinstance(item, FunctionCallItem)]
    return InMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)


def response_object(shell: ResponseShell, answer: Answer, token_usage: Usage) -> ResponseObject:
    """The non-streamed response: any reasoning, the text as a message (unless the answer is
    only calls), then each call."""
    output: list[OutputItem] = []
    status = final_status(answer.finish_reason)
    if answer.reasoning:
        output.append(ReasoningItem(id=reasoning_id(), content=[ReasoningText(text=answer.reasoning)], status=status))
    if answer.text or not answer.tool_calls:
        logprobs = chat_logprobs(answer.logprobs).content if answer.logprobs is not None else []
        output.append(MessageItem(id=message_id(), status=status,
                                  content=[OutputText(text=answer.text, logprobs=logprobs)]))
    output += [FunctionCallItem(id=function_call_id(), call_id=call.id, name=call.function.name,
                                arguments=call.function.arguments) for call in answer.tool_calls or ()]
    return shell.make(status, output, token_usage)
