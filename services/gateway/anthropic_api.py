"""Anthropic's Messages API bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``),
validated with msgspec, what they mean as the OpenAI chat request Shoal serves, and the
message Shoal answers.

A request becomes the chat request of the same meaning (`chat_request`), so it is validated,
sampled, placed, queued and read exactly as one sent to ``/v1/chat/completions``:

- ``system`` (text, or text blocks) is the system message; each message's blocks keep their
  order: ``text`` blocks are the turn's text, an assistant's ``tool_use`` blocks its calls, a
  user's ``tool_result`` blocks tool messages (their text, ``is_error`` said in it), and
  ``thinking`` / ``redacted_thinking`` blocks, sent back as clients keep them, are dropped
  (reasoning models' templates drop earlier thinking). ``image`` and ``document`` blocks are
  refused (Shoal serves text models). A conversation that ends with the assistant's turn is
  continued (Anthropic's prefill): the answer is what comes after it.
- ``max_tokens`` (required), ``stop_sequences`` (any number), ``metadata.user_id``;
  ``temperature`` (0 to 1), ``top_p`` and ``top_k``, which Anthropic's current SDKs no longer
  send but other clients (and ``extra_body``) do; ``output_config``: ``format`` (a JSON
  schema the answer follows, as ``response_format`` does on ``/v1``) and ``effort`` (the chat
  template's ``reasoning_effort``).
- ``tools`` (client tools: ``name``, ``description``, ``input_schema``) and ``tool_choice``
  (``auto``, ``any``, ``tool`` with a name, ``none``; ``disable_parallel_tool_use``). Server
  tools (web search, code execution...) are refused: Shoal runs no tool itself.
- ``thinking``: a reasoning model thinks, and its thinking comes as ``thinking`` blocks, only
  when ``thinking`` asks (any type but ``disabled``; ``display: "omitted"`` hides the blocks);
  ``budget_tokens`` bounds the thinking (the worker closes the think block when it is spent,
  as ``thinking_token_budget`` does on ``/v1``). A model without a ``reasoning_parser``
  answers without thinking blocks, its budget unused.
- Accepted and ignored, as a local server has no use for them: ``cache_control`` on blocks
  (Shoal's prefix cache needs no marks: ``usage.cache_read_input_tokens`` reports its hits),
  ``service_tier``, ``container``, ``context_management``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import MAX_INT32, MAX_TOOLS, ChatCompletionRequest, ToolCallOut
from shoal.services.gateway.openai_api import Usage as ChatUsage
from shoal.shared.messages import ModelSpec
from shoal.shared.model_settings import ReasoningParser


class Block(Struct, kw_only=True):
    """One content block of any type; `chat_request` reads the fields its type has."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    source: Any = None
    """A document's (an object: ``text``, ``content``, ``base64``, ``url``...) or a search result's (its URL)."""
    title: str | None = None


class Message(Struct):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Struct, kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    """``custom`` (or absent) for a client tool; anything else names a server tool."""


class ToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Struct, kw_only=True):
    type: str
    """``disabled``, or a way to think (``enabled``, ``adaptive``...: all mean think here)."""
    budget_tokens: Annotated[int, Meta(ge=0, le=MAX_INT32)] | None = None
    display: str | None = None
    """``omitted``: think, but answer no thinking blocks."""

    @property
    def on(self) -> bool:
        return self.type != "disabled"


def shows_thinking(thinking: Thinking | None) -> bool:
    """Whether the answer holds thinking blocks: only when asked for, as Anthropic answers
    (a reasoning model's thinking is left out otherwise)."""
    return thinking is not None and thinking.on and thinking.display != "omitted"


class OutputFormat(Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(Struct, kw_only=True):
    user_id: str | None = None


class CountTokensRequest(Struct, kw_only=True):
    """``/v1/messages/count_tokens``: a request's prompt, without ``max_tokens``."""

    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[Block] | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_INT32)]
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=MAX_INT32)] | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None
    """The structured-outputs beta's place for ``output_config.format`` (still sent by clients)."""


NO_TEXT_BLOCKS = ("image", "document")
"""Blocks a text model cannot read (a document unless its source is text)."""


def _document_text(block: Block) -> str | None:
    """A document's text when its source is text (``text`` data, or ``content`` text blocks)."""
    source = block.source if isinstance(block.source, dict) else {}
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif source.get("type") == "content" and isinstance(source.get("content"), str | list):
        parts = source["content"] if isinstance(source["content"], list) else [{"text": source["content"]}]
        text = "\n\n".join(part["text"] for part in parts if isinstance(part, dict) and isinstance(part.get("text"), str))
    else:
        return None
    return f"{block.title}\n\n{text}" if block.title else text


def _block_text(block: Block, where: str, *, in_result: bool) -> str | None:
    """The text a content block gives a text model: a text block's, a text document's, a search
    result's; None for a block of another kind. A block with no text (an image, a PDF) is a
    400 naming it, or inside a tool result (a tool that read an image) a line saying it was left out."""
    if block.type == "text":
        return block.text or ""
    if block.type == "search_result":
        texts = [block.title or "", block.source if isinstance(block.source, str) else "",
                 _text_of(block.content, f"{where}.content", in_result=in_result)]
        return "\n".join(text for text in texts if text)
    if block.type == "document" and (text := _document_text(block)) is not None:
        return text
    if block.type in NO_TEXT_BLOCKS:
        if in_result:
            return f"[{block.type} left out: this model reads text only]"
        raise BadRequest(f"{where}: {block.type} blocks are not supported (Shoal serves text models)",
                         param=where.split("[")[0])
    return None


def _text_of(content: str | list[Block] | None, where: str, *, in_result: bool = False) -> str:
    """The text of a system prompt, a tool result or a search result: a string, or its blocks'
    texts joined (a tool search's ``tool_reference``, nothing for a model, left out)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for index, block in enumerate(content):
        text = _block_text(block, f"{where}[{index}]", in_result=in_result)
        if text is None and block.type != "tool_reference":
            raise BadRequest(f"{where}[{index}]: a {block.type!r} block cannot be here", param=where.split("[")[0])
        if text:
            texts.append(text)
    return "\n\n".join(texts)


class _Turn:
    """One chat message being written from a message's blocks: its texts, its calls."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.texts: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": "\n\n".join(self.texts)}
        if self.calls:
            out["tool_calls"] = self.calls
        return out


def _messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages (see the module doc); a 400 when nothing in it
    is a turn to answer."""
    out: list[dict[str, Any]] = []
    system = _text_of(req.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    for index, message in enumerate(req.messages):
        blocks = [Block(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        turn: _Turn | None = None
        for number, block in enumerate(blocks):
            where = f"messages[{index}].content[{number}]"
            if block.type == "tool_result" and message.role == "user":
                if not block.tool_use_id:
                    raise BadRequest(f"{where}: a tool_result block needs its tool_use_id", param="messages")
                if turn is not None:
                    out.append(turn.message())
                    turn = None
                result = _text_of(block.content, f"{where}.content", in_result=True)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {result}" if block.is_error else result})
                continue
            if block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # earlier thinking: reasoning templates drop it
            turn = turn or _Turn(message.role)
            if block.type == "tool_use" and message.role == "assistant":
                if not block.id or not block.name:
                    raise BadRequest(f"{where}: a tool_use block needs its id and name", param="messages")
                arguments = block.input if block.input is not None else {}
                turn.calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
            elif (text := _block_text(block, where, in_result=False)) is not None:
                turn.texts.append(text)
            else:
                raise BadRequest(f"{where}: {'an' if message.role == 'assistant' else 'a'} {message.role} message "
                                 f"cannot hold a {block.type!r} block", param="messages")
        if turn is not None or not blocks:
            out.append((turn or _Turn(message.role)).message())
    merged = _merged(out)
    if not any(message["role"] != "system" for message in merged):
        raise BadRequest("messages hold nothing to answer (only thinking blocks?)", param="messages")
    return merged


def _merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with neighbouring turns of one role (user, assistant) made one, as Anthropic
    combines them (templates that want turns to alternate refuse anything else); an earlier
    turn's calls end it (what comes after them answers them)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        previous = out[-1] if out else None
        if (previous is not None and previous["role"] == message["role"] in ("user", "assistant")
                and "tool_calls" not in previous):
            previous["content"] = "\n\n".join(text for text in (previous["content"], message["content"]) if text)
            if "tool_calls" in message:
                previous["tool_calls"] = message["tool_calls"]
        else:
            out.append(dict(message))
    return out


def _tools(req: CountTokensRequest) -> dict[str, Any]:
    """The chat fields `req`'s tools and tool choice make."""
    fields: dict[str, Any] = {}
    for tool in req.tools or ():
        if tool.type not in (None, "custom"):
            raise BadRequest(f"tool {tool.name!r} is one of Anthropic's own ({tool.type}), which only Claude "
                             f"knows or Anthropic runs: declare it with an input_schema (and run it in the client)",
                             param="tools")
    if req.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description,
            "parameters": tool.input_schema or {"type": "object", "properties": {}}}} for tool in req.tools]
    choice = req.tool_choice
    if choice is None:
        return fields
    if choice.type == "tool":
        if not choice.name:
            raise BadRequest("tool_choice of type 'tool' names the tool: add its name", param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _thinking(thinking: Thinking | None, reasoning: ReasoningParser | None) -> dict[str, Any]:
    """A reasoning model thinks when asked to (the template's ``enable_thinking``), not
    otherwise, as Anthropic's models do. A ``deepseek_r1`` model always thinks (its reader
    takes all before ``</think>`` as thinking, so its template must open the block): it is
    never told not to, its thinking is left out of the answer instead."""
    asked = thinking is not None and thinking.on
    if reasoning is None or (reasoning == "deepseek_r1" and not asked):
        return {}
    budget = thinking.budget_tokens if thinking is not None and asked else None
    if budget is not None:
        return {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": budget}
    return {"chat_template_kwargs": {"enable_thinking": asked}}


def _output(config: OutputConfig | None, beta_format: OutputFormat | None) -> dict[str, Any]:
    """The chat fields ``output_config`` (or the beta's ``output_format``) sets: the answer's
    JSON schema, the reasoning effort (the chat template's ``reasoning_effort``; ``xhigh`` and
    ``max`` are ``high``)."""
    fields: dict[str, Any] = {}
    output_format = config.format if config is not None and config.format is not None else beta_format
    if output_format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                            "schema": output_format.schema}}
    if config is not None and config.effort is not None:
        fields["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(config.effort, config.effort)
    return fields


def chat_request(req: CountTokensRequest, reasoning: ReasoningParser | None) -> ChatCompletionRequest:
    """The chat completion `req` asks for; `reasoning` is the model's reasoning parser, if any."""
    fields: dict[str, Any] = {"model": req.model, "messages": _messages(req), **_tools(req),
                              **_thinking(req.thinking, reasoning)}
    if fields["messages"][-1]["role"] == "assistant" and not fields["messages"][-1].get("tool_calls"):
        fields["continue_final_message"] = True
    if isinstance(req, MessagesRequest):
        fields.update(stream=bool(req.stream), max_tokens=req.max_tokens, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k,
                      user=req.metadata.user_id if req.metadata is not None else None,
                      **_output(req.output_config, req.output_format))
    try:
        return msgspec.convert(fields, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}") from exc


def stop_sequences(req: MessagesRequest) -> list[str]:
    """Every stop sequence (an empty one stops nothing: left out)."""
    return [stop for stop in req.stop_sequences or () if stop]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason(finish_reason: str, stop_sequence: str | None) -> StopReason:
    """Anthropic's ``stop_reason`` for a choice's finish reason and the stop string (if any) that ended it."""
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def tool_use_id(call: ToolCallOut) -> str:
    """A call's id as Anthropic writes them (``toolu_...``)."""
    return "toolu_" + call.id.removeprefix("call_")


class TextOut(Struct, tag="text", tag_field="type"):
    text: str


class ThinkingOut(Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""
    """Anthropic signs its own thinking; Shoal's is not signed (clients send it back as is)."""


class ToolUseOut(Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


BlockOut = TextOut | ThinkingOut | ToolUseOut


class Usage(Struct):
    input_tokens: int
    """Prompt tokens computed: those the prefix cache held are `cache_read_input_tokens`."""
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageOut(Struct, tag="message", tag_field="type"):
    id: str
    model: str
    content: list[BlockOut]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


def usage_of(token_usage: ChatUsage) -> Usage:
    """An answer's usage as Anthropic reports it: the prompt's tokens the prefix cache held apart."""
    cached = token_usage.prompt_tokens_details.cached_tokens
    return Usage(token_usage.prompt_tokens - cached, token_usage.completion_tokens, cached)


class TokenCount(Struct):
    input_tokens: int


ANTHROPIC_VERSION_HEADER = "anthropic-version"
"""Sent by Anthropic's clients on every request: ``/v1/models`` answers them in Anthropic's form."""


class ModelInfo(Struct, tag="model", tag_field="type"):
    id: str
    display_name: str
    created_at: str
    """RFC 3339: when the model was registered."""
    max_input_tokens: int | None = None
    """The model's context (known once a node agent has inspected it)."""
    max_tokens: int | None = None
    lifecycle: Literal["active"] = "active"


def model_info(spec: ModelSpec) -> ModelInfo:
    registered = datetime.fromtimestamp(spec.registered_at, UTC).isoformat().replace("+00:00", "Z")
    return ModelInfo(spec.key, spec.key, registered, spec.max_model_len, spec.max_model_len)


class ModelPage(Struct):
    data: list[ModelInfo]
    has_more: bool
    first_id: str | None
    last_id: str | None


class ModelPageQuery(Struct, kw_only=True):
    limit: Annotated[int, Meta(ge=1, le=1000)] = 20
    after_id: str | None = None
    before_id: str | None = None


def model_page(models: list[ModelInfo], query: ModelPageQuery) -> ModelPage:
    """One page of `models` (in their order): after ``after_id`` or before ``before_id``."""
    ids = [model.id for model in models]
    start, end = 0, len(models)
    if query.after_id is not None:
        start = ids.index(query.after_id) + 1 if query.after_id in ids else len(ids)
    if query.before_id is not None:
        end = ids.index(query.before_id) if query.before_id in ids else 0
        start = max(start, end - query.limit)
    page = models[start:min(end, start + query.limit)]
    has_more = start > 0 if query.before_id is not None else start + len(page) < end
    return ModelPage(page, has_more, page[0].id if page else None, page[-1].id if page else None)
