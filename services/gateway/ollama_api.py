"""Ollama's API bodies (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``),
validated with msgspec, and what they mean as the OpenAI requests Shoal serves.

A request becomes the chat, completion or embedding request of the same meaning
(`chat_request`, `generate_request`, `embed_request`), so it is validated, sampled, placed,
queued and read exactly as one sent to ``/v1``. What Ollama's options mean here:

- sampling: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``,
  ``num_predict`` (-1 or -2: up to the model's context), ``repeat_penalty`` (vLLM's
  ``repetition_penalty``: over the whole context), ``presence_penalty``, ``frequency_penalty``;
- refused unless at their defaults (a 400 naming the option; Shoal's sampler has no such
  step): ``mirostat``, ``tfs_z``, ``typical_p``;
- ignored, because the operator decides them per model, not a request: the runner's
  (``num_ctx``, ``num_batch``, ``num_gpu``, ``main_gpu``, ``num_thread``, ``use_mmap``...),
  and ``repeat_last_n``, ``penalize_newline``. Unknown options are ignored, as Ollama does.

``format`` is ``"json"`` (any JSON object) or a JSON schema; ``think`` splits a reasoning
model's thinking out (``true``, or an effort ``"low"``/``"medium"``/``"high"``) or turns it
off (``false``: the template's ``enable_thinking``). ``keep_alive`` is validated but does not
change when a model sleeps: that is the model's ``sleep.idle_timeout_s`` and fair
preemption's (docs/sleep_wake.md); a request with nothing to generate and ``keep_alive: 0``
unloads the model (routes_ollama.py).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from shoal.services.gateway.embeddings_api import EmbeddingRequest
from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import (
    MAX_STOP_SEQUENCES,
    UNLIMITED_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    MinP,
    Penalty,
    RepetitionPenalty,
    Seed,
    StopString,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
)
from shoal.shared.model_settings import ReasoningParser

NumPredict = Annotated[int, Meta(ge=-2, le=2**31 - 1)]
"""Tokens to generate; -1 (Ollama's default) and -2: until the model's context is full."""


class Options(Struct, kw_only=True):
    """The options Shoal reads (see the module doc for the others)."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    num_predict: NumPredict | None = None
    stop: Annotated[list[StopString], Meta(max_length=MAX_STOP_SEQUENCES)] | None = None
    repeat_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    mirostat: int | None = None
    tfs_z: float | None = None
    typical_p: float | None = None


_REFUSED_UNLESS_DEFAULT: dict[str, float] = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}

KeepAlive = float | str
"""Seconds, or a Go duration (``"5m"``, ``"1h30m"``); negative: for ever, 0: unload now."""
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_s(value: KeepAlive | None) -> float | None:
    """`value` in seconds (None when absent); a 400 for text that is not a duration."""
    if value is None or isinstance(value, int | float):
        return value
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text[1:] if text[:1] in "+-" else text
    if _NUMBER.fullmatch(body):
        return sign * float(body)  # "300": seconds, as Ollama reads a bare number
    parts = _DURATION_PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise BadRequest(f"keep_alive {value!r} is not a duration (seconds, or e.g. \"5m\", \"1h30m\")",
                         param="keep_alive")
    return sign * sum(float(number) * _UNIT_S[unit] for number, unit in parts)


Think = bool | Literal["low", "medium", "high"]


class CallFunction(Struct):
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolCall(Struct):
    function: CallFunction


class Message(Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    """An earlier answer's thinking, as clients send it back: not shown to the model again
    (reasoning models' templates drop it)."""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class _Request(Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    options: Options | None = None
    keep_alive: KeepAlive | None = None


class _Generating(_Request, kw_only=True):
    stream: bool = True
    """Ollama streams unless told not to."""
    format: Literal["", "json"] | dict[str, Any] | None = None
    think: Think | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None


class ChatRequest(_Generating, kw_only=True):
    messages: list[Message] = msgspec.field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generating, kw_only=True):
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedRequest(_Request, kw_only=True):
    input: Annotated[str, Meta(min_length=1)] | Annotated[list[Annotated[str, Meta(min_length=1)]],
                                                            Meta(min_length=1)]
    truncate: bool = True
    dimensions: int | None = None


class EmbeddingsRequest(_Request, kw_only=True):
    """The older ``/api/embeddings``: one prompt."""

    prompt: str = ""


def _sampling(options: Options | None) -> dict[str, Any]:
    """`options` as the OpenAI (and vLLM) request fields they set."""
    if options is None:
        return {"max_tokens": UNLIMITED_MAX_TOKENS}
    for name, default in _REFUSED_UNLESS_DEFAULT.items():
        value = getattr(options, name)
        if value is not None and value != default:
            raise BadRequest(f"options.{name} is not supported (Shoal samples with temperature, top_p, top_k, "
                             f"min_p and penalties); leave it at {default:g}", param="options")
    fields = {"temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k,
              "min_p": options.min_p, "seed": options.seed, "stop": options.stop,
              "repetition_penalty": options.repeat_penalty, "presence_penalty": options.presence_penalty,
              "frequency_penalty": options.frequency_penalty}
    predict = options.num_predict
    fields["max_tokens"] = UNLIMITED_MAX_TOKENS if predict is None or predict < 0 else predict
    return {name: value for name, value in fields.items() if value is not None}


def _format(value: Literal["", "json"] | dict[str, Any] | None) -> dict[str, Any] | None:
    if not value:
        return None
    if value == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}


def _thinking(think: Think | None, reasoning: ReasoningParser | None, model: str) -> dict[str, Any]:
    """The chat fields `think` sets for a model that reasons (`reasoning`) or not."""
    if think is None:
        return {}
    if reasoning is None:
        if think is False:
            return {}
        raise BadRequest(f"{model!r} does not support thinking (it has no reasoning_parser)", param="think")
    if think is False:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    return {"reasoning_effort": think} if isinstance(think, str) else {}


def _refuse_images(images: list[str] | None, where: str) -> None:
    if images:
        raise BadRequest(f"{where}: images are not supported (Shoal serves text models)", param="images")


def _openai_message(index: int, message: Message) -> dict[str, Any]:
    _refuse_images(message.images, f"messages[{index}]")
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        if message.role != "assistant":
            raise BadRequest(f"messages[{index}]: only assistant messages hold tool_calls", param="messages")
        out["tool_calls"] = [{"id": f"call_{index}_{n}", "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": json.dumps(call.function.arguments)}}
                             for n, call in enumerate(message.tool_calls)]
    if message.tool_name is not None:
        out["name"] = message.tool_name
    return out


def _logprobs(req: _Generating) -> dict[str, Any]:
    if not req.logprobs:
        return {}
    return {"logprobs": True, "top_logprobs": req.top_logprobs or 0}


def _convert(fields: dict[str, Any], schema: type[Any]) -> Any:
    try:
        return msgspec.convert(fields, schema)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}") from exc


def chat_request(req: ChatRequest, reasoning: ReasoningParser | None) -> ChatCompletionRequest:
    """The chat completion `req` asks for (`req.messages` not empty: an empty one only loads the
    model). `reasoning`: the model's reasoning parser, if it has one."""
    return _convert({
        "model": req.model, "stream": req.stream,
        "messages": [_openai_message(i, m) for i, m in enumerate(req.messages)],
        "tools": req.tools, "response_format": _format(req.format),
        **_sampling(req.options), **_thinking(req.think, reasoning, req.model), **_logprobs(req),
    }, ChatCompletionRequest)


def generate_request(req: GenerateRequest, reasoning: ReasoningParser | None
                     ) -> ChatCompletionRequest | CompletionRequest:
    """What `req` (a prompt, not empty) asks for: a chat turn of its system and prompt under the
    model's chat template, or with ``raw`` the prompt as it is (a completion)."""
    _refuse_images(req.images, "images")
    for name, value, instead in (("suffix", req.suffix, "fill-in-the-middle is not supported"),
                                 ("template", req.template, "the model's own chat template is used"),
                                 ("context", req.context, "send the conversation to /api/chat instead")):
        if value:
            raise BadRequest(f"{name} is not supported: {instead}", param=name)
    shared = {"model": req.model, "stream": req.stream, "response_format": _format(req.format),
              **_sampling(req.options), **_logprobs(req)}
    if req.raw:
        if req.think:
            raise BadRequest("think needs the model's chat template; raw prompts go as they are", param="think")
        if req.logprobs:
            shared["logprobs"] = req.top_logprobs or 0
            shared.pop("top_logprobs")
        if req.format:
            raise BadRequest("format needs the model's chat template; raw prompts go as they are", param="format")
        shared.pop("response_format")
        return _convert({**shared, "prompt": req.prompt}, CompletionRequest)
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt}]
    return _convert({**shared, "messages": messages, **_thinking(req.think, reasoning, req.model)},
                    ChatCompletionRequest)


def embed_request(req: EmbedRequest | EmbeddingsRequest) -> EmbeddingRequest:
    """The embeddings request of `req`'s inputs (``/api/embeddings``: a prompt, not empty). An
    input longer than the model's context loses its end (Ollama's ``truncate``, on unless
    false: then it is a 400)."""
    cut = {"truncate_prompt_tokens": -1, "truncation_side": "right"}
    if isinstance(req, EmbeddingsRequest):
        return _convert({"model": req.model, "input": req.prompt, **cut}, EmbeddingRequest)
    if req.dimensions is not None:
        raise BadRequest("dimensions is not supported: an embedding has the model's hidden size",
                         param="dimensions")
    return _convert({"model": req.model, "input": req.input, **(cut if req.truncate else {})}, EmbeddingRequest)


# ---------------------------------------------------------------------------- responses


class OutFunction(Struct):
    name: str
    arguments: Any


class OutToolCall(Struct):
    function: OutFunction


class OutMessage(Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[OutToolCall] | None = None


class _Reply(Struct, kw_only=True, omit_defaults=True):
    """A line of a streamed answer, or the whole answer. The last (``done``) has the answer's
    counts and durations (nanoseconds), as Ollama reports them: `load_duration` is the wait for a
    replica (a placement, a wake), `prompt_eval_duration` from then to the first token
    (queueing included), `eval_duration` the rest."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    logprobs: list[Any] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatReply(_Reply, kw_only=True, omit_defaults=True):
    message: OutMessage


class GenerateReply(_Reply, kw_only=True, omit_defaults=True):
    response: str
    thinking: str | None = None


class EmbedReply(Struct, kw_only=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class EmbeddingReply(Struct):
    embedding: list[float]
