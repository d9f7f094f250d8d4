"""Ollama's API bodies (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``),
validated with msgspec, and what they mean as the OpenAI requests Shoal serves.

A request becomes the chat, completion or embedding request of the same meaning
(`chat_request`, `generate_request`, `embed_request`), so it is validated, sampled, placed,
queued and read exactly as one sent to ``/v1``. What Ollama's options mean here:

- sampling: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed`` (negative: none),
  ``stop``, ``num_predict`` (0 or less: up to the model's context), ``repeat_penalty``
  (vLLM's ``repetition_penalty``: over the whole context; 0 or less: off),
  ``presence_penalty``, ``frequency_penalty``. Ollama bounds none of them, so a value past
  what Shoal's sampler takes is clamped to the nearest it does (``temperature`` 2, ``top_p``
  just above 0: the likeliest token), and integers may come as floats (``top_k: 40.0``);
- ignored, as current Ollama ignores them: ``mirostat``, ``tfs_z``, ``typical_p``; and those
  the operator decides per model, not a request: the runner's (``num_ctx``, ``num_batch``,
  ``num_gpu``, ``main_gpu``, ``num_thread``, ``use_mmap``...), ``repeat_last_n``,
  ``penalize_newline``. Unknown options are ignored, as Ollama does.

Fields may be ``null`` (absent), as Go reads them. A chat whose last message is the
assistant's (without calls) goes on with it, as Ollama continues a prefilled answer.

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
    MAX_INT32,
    MAX_STOP_SEQUENCES,
    UNLIMITED_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    TopLogprobs,
)
from shoal.shared.model_settings import ReasoningParser

Number = int | float
"""An option's value: Go reads JSON numbers into the option's own type (``40.0`` for ``top_k``)."""


class Options(Struct, kw_only=True):
    """The options Shoal reads (see the module doc for the others)."""

    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Number | None = None
    min_p: Number | None = None
    seed: Number | None = None
    num_predict: Number | None = None
    stop: list[str] | None = None
    repeat_penalty: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None


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
    arguments: dict[str, Any] | None = None


class ToolCall(Struct):
    function: CallFunction
    id: str | None = None


class Message(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    """An earlier answer's thinking, as clients send it back: not shown to the model again
    (reasoning models' templates drop it)."""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    """The call a tool result answers (sent by OpenAI-minded clients such as LangChain)."""


class _Request(Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    options: Options | None = None
    keep_alive: KeepAlive | None = None


class _Generating(_Request, kw_only=True):
    stream: bool | None = None
    """Ollama streams unless told not to (None: true)."""
    format: Literal["", "json"] | dict[str, Any] | None = None
    think: Think | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    truncate: bool | None = None
    """A prompt too long for the model's context is cut to fit, leaving room to answer (a chat
    first loses its oldest messages: `SamplingParams.fit_context`; None: true, Ollama's
    default); false: a 400."""


class ChatRequest(_Generating, kw_only=True):
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generating, kw_only=True):
    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None


class EmbedRequest(_Request, kw_only=True):
    input: str | list[str] | None = None
    """Missing or empty: nothing to embed (the model is loaded, the answer has no vector)."""
    truncate: bool | None = None
    """An input longer than the model's context loses its end (None: true, Ollama's default)."""
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    """Keep each vector's first this many values, L2-normalized again (as Ollama does)."""
    normalize: bool | None = None
    """False: each vector as the model computed it (Ollama's proposed option; default true)."""

    @property
    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) and self.input else list(self.input or [])


class EmbeddingsRequest(_Request, kw_only=True):
    """The older ``/api/embeddings``: one prompt, its vector as the model computed it (not
    normalized, as Ollama answers it; ``/api/embed`` normalizes)."""

    prompt: str | None = None


def _clamped(value: Number | None, low: float, high: float) -> float | None:
    return None if value is None else float(min(max(value, low), high))  # clamped first: ints of any size


def _sampling(options: Options | None) -> dict[str, Any]:
    """`options` as the OpenAI (and vLLM) request fields they set, clamped to what those take;
    the stop strings all come back from `stop_strings` (``/v1`` takes 4)."""
    if options is None:
        return {"max_tokens": UNLIMITED_MAX_TOKENS}
    predict = None if options.num_predict is None else int(min(options.num_predict, UNLIMITED_MAX_TOKENS))
    top_k = None if options.top_k is None else int(min(options.top_k, MAX_INT32))
    seed = None if options.seed is None or options.seed < 0 else int(min(options.seed, 2**63 - 1))
    repeat = options.repeat_penalty
    fields = {
        "temperature": _clamped(options.temperature, 0.0, 2.0),
        "top_p": _clamped(options.top_p, 1e-9, 1.0),
        "top_k": top_k if top_k is not None and top_k > 0 else None,
        "min_p": _clamped(options.min_p, 0.0, 1.0),
        "seed": seed,
        "stop": stop_strings(options)[:MAX_STOP_SEQUENCES] or None,
        "repetition_penalty": _clamped(repeat, 1e-9, 10.0) if repeat is not None and repeat > 0 else None,
        "presence_penalty": _clamped(options.presence_penalty, -2.0, 2.0),
        "frequency_penalty": _clamped(options.frequency_penalty, -2.0, 2.0),
        "max_tokens": predict if predict is not None and predict > 0 else UNLIMITED_MAX_TOKENS,
    }
    return {name: value for name, value in fields.items() if value is not None}


def stop_strings(options: Options | None) -> list[str]:
    """Every stop string of `options` (empty ones stop nothing: left out)."""
    return [stop for stop in (options.stop if options is not None else None) or () if stop]


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
    out: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    if message.tool_calls:
        if message.role != "assistant":
            raise BadRequest(f"messages[{index}]: only assistant messages hold tool_calls", param="messages")
        out["tool_calls"] = [{"id": call.id or f"call_{index}_{n}", "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": json.dumps(call.function.arguments or {})}}
                             for n, call in enumerate(message.tool_calls)]
    if message.tool_name is not None:
        out["name"] = message.tool_name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
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
    messages = req.messages or []
    last = messages[-1] if messages else None
    continued = last is not None and last.role == "assistant" and not last.tool_calls
    return _convert({
        "model": req.model, "stream": req.stream is not False,
        "messages": [_openai_message(i, m) for i, m in enumerate(messages)],
        "tools": req.tools, "response_format": _format(req.format),
        **({"continue_final_message": True} if continued else {}),
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
    shared = {"model": req.model, "stream": req.stream is not False, "response_format": _format(req.format),
              **_sampling(req.options), **_logprobs(req)}
    if req.raw:
        if req.system:
            raise BadRequest("raw prompts go as they are: send the system prompt inside the prompt", param="system")
        if req.think:
            raise BadRequest("think needs the model's chat template; raw prompts go as they are", param="think")
        if req.logprobs:
            shared["logprobs"] = req.top_logprobs or 0
            shared.pop("top_logprobs")
        if req.format:
            raise BadRequest("format needs the model's chat template; raw prompts go as they are", param="format")
        shared.pop("response_format")
        return _convert({**shared, "prompt": req.prompt or ""}, CompletionRequest)
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt or ""}]
    return _convert({**shared, "messages": messages, **_thinking(req.think, reasoning, req.model)},
                    ChatCompletionRequest)


def embed_request(req: EmbedRequest | EmbeddingsRequest) -> EmbeddingRequest:
    """The embeddings request of `req`'s inputs (at least one; ``/api/embeddings``: a prompt, not
    empty). An input longer than the model's context loses its end (Ollama's ``truncate``, on
    unless false: then it is a 400). Any number of inputs: computed in batches (plans.py)."""
    cut = {"truncate_prompt_tokens": -1, "truncation_side": "right"}
    if isinstance(req, EmbeddingsRequest):
        return _convert({"model": req.model, "input": req.prompt, "normalize": False, **cut}, EmbeddingRequest)
    return _convert({"model": req.model, "input": req.inputs, "normalize": req.normalize,
                     **(cut if req.truncate is not False else {})}, EmbeddingRequest)


# ---------------------------------------------------------------------------- responses


class OutFunction(Struct):
    name: str
    arguments: dict[str, Any]
    index: int
    """The call's place among its answer's calls."""


class OutToolCall(Struct):
    function: OutFunction
    id: str


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
