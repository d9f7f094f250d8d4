"""The OpenAI request bodies Shoal accepts, validated with msgspec, and the responses it sends.

Unknown fields are ignored (clients send many); fields Shoal knows but cannot
honour (``n > 1``, ``logprobs``, tools, ``echo``...) are rejected with 400 naming
the field, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

from shoal.services.gateway.errors import BadRequest, PayloadTooLarge
from shoal.shared.messages import ChatMessage, SamplingParams

MAX_STOP_SEQUENCES = 4
UNLIMITED_MAX_TOKENS = 1 << 30
"""Chat without max_tokens: generate up to the model's context (the worker clamps)."""


class TextPart(Struct):
    type: str
    text: str | None = None


class InMessage(Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(Struct):
    include_usage: bool = False


class _Sampling(Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool | int | None = None
    user: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[InMessage]
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]
    """A string, or one string / one token-id list in a list, or a token-id list."""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def decode_body(body: bytes, schema: type[Any]) -> Any:
    """Decode a JSON body into `schema`; a 400 says what and where (e.g. ``$.max_tokens``)."""
    if not body:
        raise BadRequest("request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}", param=_param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc


def _param_of(message: str) -> str | None:
    marker = "at `$."
    if marker in message:
        return message.split(marker, 1)[1].rstrip("`").split("[")[0].split(".")[0]
    return None


def _check_range(name: str, value: float | None, low: float, high: float, *, low_open: bool = False) -> None:
    if value is None:
        return
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise BadRequest(f"{name} must be in {bracket}{low}, {high}], got {value}", param=name)


def sampling_params(req: _Sampling, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
    """Validate the sampling fields shared by chat and completions."""
    if req.n != 1:
        raise BadRequest("n > 1 is not supported; send separate requests", param="n")
    if req.logprobs:
        raise BadRequest("logprobs are not supported", param="logprobs")
    _check_range("temperature", req.temperature, 0.0, 2.0)
    _check_range("top_p", req.top_p, 0.0, 1.0, low_open=True)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_SEQUENCES or any(not s for s in stop):
        raise BadRequest(f"stop takes up to {MAX_STOP_SEQUENCES} non-empty strings", param="stop")
    if not req.model:
        raise BadRequest("model is required", param="model")
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=stop,
        ignore_eos=req.ignore_eos,
    )


def chat_messages(req: ChatCompletionRequest, max_chars: int) -> list[ChatMessage]:
    if not req.messages:
        raise BadRequest("messages must hold at least one message", param="messages")
    if req.tools:
        raise BadRequest("tools are not supported", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise BadRequest("only response_format {\"type\": \"text\"} is supported", param="response_format")
    messages: list[ChatMessage] = []
    total_chars = 0
    for i, message in enumerate(req.messages):
        if message.role not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}].role {message.role!r} is not a chat role", param="messages")
        if isinstance(message.content, list):
            kinds = {part.type for part in message.content}
            if kinds - {"text"}:
                raise BadRequest(f"messages[{i}].content: only text parts are supported, got {sorted(kinds)}",
                                 param="messages")
            content = "".join(part.text or "" for part in message.content)
        else:
            content = message.content or ""
        total_chars += len(content)
        role = "system" if message.role == "developer" else message.role
        messages.append(ChatMessage(role=role, content=content, name=message.name))
    if total_chars > max_chars:
        raise_prompt_too_large(total_chars, max_chars)
    return messages


def completion_prompt(req: CompletionRequest, max_chars: int) -> tuple[str | None, list[int] | None]:
    """A completion request's single prompt, as text or token ids."""
    if req.echo:
        raise BadRequest("echo is not supported", param="echo")
    if req.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise BadRequest("best_of > 1 is not supported", param="best_of")
    prompt: Any = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if len(prompt) > max_chars:
            raise_prompt_too_large(len(prompt), max_chars)
        return prompt, None
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if len(prompt) > max_chars:
            raise_prompt_too_large(len(prompt), max_chars)
        return None, list(prompt)
    raise BadRequest("prompt must be one string or one list of token ids (batches are not supported)",
                     param="prompt")


def raise_prompt_too_large(num_chars: int, max_chars: int) -> None:
    raise PayloadTooLarge(f"prompt has {num_chars} characters; this gateway takes at most {max_chars}",
                          param="prompt")


# --------------------------------------------------------------------------- responses


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(Struct):
    role: str
    content: str


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "shoal"
    object: str = "model"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


Kind = Literal["chat", "completion"]
encoder = msgspec.json.Encoder()


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def full_response(kind: Kind, response_id: str, created: int, model: str, text: str, finish_reason: str,
                  token_usage: Usage) -> ChatCompletion | Completion:
    if kind == "chat":
        choice = ChatChoice(0, AssistantMessage("assistant", text), finish_reason)
        return ChatCompletion(response_id, created, model, [choice], token_usage)
    return Completion(response_id, created, model, [CompletionChoice(0, text, finish_reason)], usage=token_usage)


def stream_chunk(kind: Kind, response_id: str, created: int, model: str, *, text: str | None = None,
                 finish_reason: str | None = None, role: bool = False,
                 token_usage: Usage | None = None, usage_only: bool = False) -> bytes:
    """One SSE ``data:`` payload of a streamed response."""
    if kind == "chat":
        choices = [] if usage_only else [
            ChatChunkChoice(0, Delta(role="assistant" if role else None, content=text), finish_reason)
        ]
        chunk: Struct = ChatCompletionChunk(response_id, created, model, choices, usage=token_usage)
    else:
        choices_c = [] if usage_only else [CompletionChoice(0, text or "", finish_reason)]
        chunk = Completion(response_id, created, model, choices_c, usage=token_usage)
    return encoder.encode(chunk)

