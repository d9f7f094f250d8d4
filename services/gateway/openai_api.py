"""The OpenAI request bodies Shoal accepts, validated with msgspec, and the responses it sends.

Unknown fields are ignored (clients send many). Every field the OpenAI API lets
be ``null`` may be ``null``, meaning absent. Numbers are bounded where they are
declared (`msgspec.Meta`), so an out-of-range value is a 400 naming the field,
never an overflow further in. Besides OpenAI's sampling fields (with
``presence_penalty`` and ``frequency_penalty``), vLLM's ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``truncate_prompt_tokens`` and the
structured-output fields (guided.py) are honoured, and Shoal's ``session_id`` (a chat
session whose KV replicas keep between turns; also the ``X-Session-Id`` header). Fields Shoal knows but
cannot honour (``functions``, ``suffix``, ``best_of``...) are
accepted at their defaults and rejected with 400 naming the field otherwise,
never silently dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from shoal.services.gateway.choices import MAX_CHOICES
from shoal.services.gateway.errors import BadRequest, PayloadTooLarge
from shoal.services.gateway.guided import Choices, Regex, StructuredOutputs, request_grammar
from shoal.shared.messages import (
    CONTEXT_LENGTH_EXCEEDED,
    ChatMessage,
    InferenceRequest,
    PromptEcho,
    SamplingParams,
    TokenLogprob,
    ToolCall,
    encode_msgpack,
)
from shoal.shared.subjects import InvalidSessionId, validate_session_id

MAX_STOP_SEQUENCES = 4
MAX_INT32 = 2**31 - 1
UNLIMITED_MAX_TOKENS = 1 << 30
"""Chat without max_tokens: generate up to the model's context (the worker clamps)."""

MaxTokens = Annotated[int, Meta(ge=1, le=MAX_INT32)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
"""int64, as OpenAI documents it (and what msgpack carries to the worker)."""
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TopK = Annotated[int, Meta(ge=-1, le=MAX_INT32)]
"""vLLM's convention: -1 (or 0) keeps every token."""
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
NumChoices = Annotated[int, Meta(ge=1, le=MAX_CHOICES)]
MAX_TOP_LOGPROBS = 20
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
"""Alternatives per token (OpenAI: 20 for chat, 5 for completions; vLLM: 20 for both)."""
BestOf = Annotated[int, Meta(ge=0, le=20)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
MAX_LOGIT_BIAS_TOKENS = 1024
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]
MAX_STOP_TOKEN_IDS = 64
TruncatePromptTokens = Annotated[int, Meta(ge=-1, le=MAX_INT32)]
"""vLLM's: k >= 1 tokens, or -1 for the model's context; 0 is refused."""


class TextPart(Struct):
    """A part of a message's content: ``text``, or in an assistant's message ``refusal``."""

    type: str
    text: str | None = None
    refusal: str | None = None
    """A ``refusal`` part's text: a past answer that refused, replayed (OpenAI's)."""


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
StopString = Annotated[str, Meta(min_length=1)]


class FunctionCall(Struct):
    """A call's function, in a request's past turns and in responses alike."""

    name: str
    arguments: str
    """JSON text."""


class InToolCall(Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class InMessage(Struct):
    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[InToolCall] | None = None
    """An assistant turn's calls."""
    tool_call_id: str | None = None
    """A tool turn: the call it answers."""


FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,128}$")]
"""Function names: letters, digits, ``_``, ``-`` (OpenAI's rule; vLLM adds ``.``), at most 128
(Anthropic's bound; OpenAI's is 64, and MCP tools' prefixed names pass it)."""
MAX_TOOLS = 1024
"""Functions per request (OpenAI takes 128; a client with several MCP servers sends more)."""


class FunctionDefinition(Struct):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema (absent: no arguments)."""
    strict: bool | None = None
    """Accepted; a forced ``tool_choice`` always follows the schema."""


class ToolDefinition(Struct):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Struct):
    include_usage: bool | None = None


class _Sampling(Struct, kw_only=True):
    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    # vLLM's extensions (the openai client sends them through `extra_body`).
    ignore_eos: bool | None = None
    """Keep generating past end-of-sequence."""
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_INT32)] | None = None
    """Generate at least this many tokens (end-of-sequence and `stop_token_ids` cannot be
    chosen before, stop strings are not looked for)."""
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    """More tokens that end generation, as end-of-sequence does (even with `ignore_eos`)."""
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    """Keep only the prompt's last this many tokens (-1: as many as the model's context takes)."""
    session_id: str | None = None
    """Shoal's: the chat session this request is a turn of (see `session_id_of`)."""
    user: str | None = None
    n: NumChoices | None = None
    """Choices per prompt (choices.py)."""
    logit_bias: Annotated[dict[str, Bias], Meta(max_length=MAX_LOGIT_BIAS_TOKENS)] | None = None
    """Token id (as a string, OpenAI's form) -> bias added to its logit."""
    # vLLM's structured outputs (guided.py).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


MAX_TEMPLATE_KWARGS = 32
TemplateKwargs = Annotated[dict[Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")], Any],
                           Meta(max_length=MAX_TEMPLATE_KWARGS)]
"""vLLM's ``chat_template_kwargs``: variables for the model's chat template (``enable_thinking``)."""
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
"""Names `apply_chat_template` takes itself: Shoal sets them."""


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[InMessage], Meta(min_length=1)]
    chat_template_kwargs: TemplateKwargs | None = None
    reasoning_effort: ReasoningEffort | None = None
    """OpenAI's, given to the chat template as its ``reasoning_effort`` variable (as vLLM
    does: templates that know it, gpt-oss's, use it; others ignore it)."""
    thinking_token_budget: Annotated[int, Meta(ge=-1, le=MAX_INT32)] | None = None
    """vLLM's: a reasoning model thinks at most this many tokens, then its think block is
    closed and it answers (-1: no bound)."""
    add_generation_prompt: bool | None = None
    """vLLM's: open the assistant's turn after the messages (true unless false)."""
    continue_final_message: bool | None = None
    """vLLM's: go on with the last message (the assistant's) instead of opening a turn."""
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[ToolDefinition], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[Any], Meta(min_length=1)]
    """A string or a token-id list, or a batch of them in a list (none empty: a model needs at
    least one token to go on from)."""
    logprobs: TopLogprobs | None = None
    """Each token's log probability and this many alternatives."""
    echo: bool | None = None
    suffix: str | None = None
    best_of: BestOf | None = None


def decode_body(body: bytes, schema: type[Any]) -> Any:
    """Decode a JSON body into `schema`; a 400 says what and where (e.g. ``$.max_tokens``)."""
    if not body:
        raise BadRequest("request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}", param=param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc


def decode_query(query: Mapping[str, str], schema: type[Any]) -> Any:
    """A URL query as `schema` (numbers from their text); a 400 names the parameter at fault."""
    try:
        return msgspec.convert(dict(query), schema, strict=False)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid query: {exc}", param=param_of(str(exc))) from exc


class _ModelOnly(Struct):
    model: str | None = None


def model_named_in(body: bytes) -> str | None:
    """The ``model`` of a body that failed validation, if it names one (for logs and metrics)."""
    try:
        return msgspec.json.decode(body, type=_ModelOnly).model
    except msgspec.DecodeError:
        return None


def param_of(message: str) -> str | None:
    """The top-level field a msgspec error names (``... at `$.tools[0].type` `` or, for a
    mapping's key, ``... at `key` in `$.logit_bias` ``)."""
    marker = "`$."
    if marker in message:
        return message.split(marker, 1)[1].split("`")[0].split("[")[0].split(".")[0]
    return None


_TOOL_CHOICES_WITHOUT_CALLS = (None, "none", "auto")
_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    # (field, is its value one Shoal honours?, why not)
    ("functions", lambda v: not v, "functions (deprecated by OpenAI) are not supported; send tools"),
    ("function_call", lambda v: v in _TOOL_CHOICES_WITHOUT_CALLS,
     "function_call (deprecated by OpenAI) is not supported; send tools and tool_choice"),
    ("audio", lambda v: v is None, "audio output is not supported"),
    ("modalities", lambda v: v in (None, ["text"]), "only the \"text\" modality is supported"),
    ("suffix", lambda v: not v, "suffix is not supported"),
    ("best_of", lambda v: v in (None, 1), "best_of > 1 is not supported"),
)


UNSUPPORTED_FIELDS = tuple(name for name, _, _ in _UNSUPPORTED)
"""Fields accepted only at their defaults."""


def reject_unsupported(req: _Sampling) -> None:
    """400 naming the first field set to a value Shoal cannot honour (see the module doc)."""
    for name, honoured, message in _UNSUPPORTED:
        if not honoured(getattr(req, name, None)):
            raise BadRequest(message, code="unsupported_parameter", param=name)


SESSION_HEADER = "X-Session-Id"


def session_id_of(req: _Sampling, header: str | None) -> str | None:
    """The request's session id: the body's ``session_id`` or the ``X-Session-Id`` header (both
    may be given if equal); 1-128 characters of ``[A-Za-z0-9_-]``. A 400 names the field at fault."""
    body = req.session_id
    if body is not None and header is not None and body != header:
        raise BadRequest(f"the {SESSION_HEADER} header and session_id differ; send one, or both equal",
                         param="session_id")
    session_id, field_name = (body, "session_id") if body is not None else (header, SESSION_HEADER)
    if session_id is None:
        return None
    try:
        return validate_session_id(session_id)
    except InvalidSessionId as exc:
        raise BadRequest(f"invalid {field_name}: {exc}", param=field_name) from exc


def stream_mode(req: _Sampling) -> tuple[bool, bool]:
    """(stream, include_usage); ``stream_options`` without ``stream: true`` is a 400, as OpenAI has it."""
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
    return stream, bool(req.stream_options and req.stream_options.include_usage)


def sampling_params(req: _Sampling, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
    """Validate the sampling fields shared by chat and completions (ranges are checked at decoding)."""
    if not req.model:
        raise BadRequest("model is required", param="model")
    reject_unsupported(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])  # bounds: `StopString`
    echo = isinstance(req, CompletionRequest) and bool(req.echo)
    logprobs = requested_logprobs(req)
    min_tokens = req.min_tokens or 0
    grammar = request_grammar(
        response_format=json_schema_of(req), guided_json=req.guided_json, guided_regex=req.guided_regex,
        guided_choice=req.guided_choice, guided_grammar=req.guided_grammar, structured=req.structured_outputs)
    if max_tokens is not None and min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens")
    check_truncation(req.truncate_prompt_tokens)
    if echo and req.truncate_prompt_tokens is not None:
        raise BadRequest("echo sends the prompt back as it was sent; truncate_prompt_tokens would cut it: send one",
                         param="truncate_prompt_tokens")
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=stop,
        ignore_eos=bool(req.ignore_eos),
        min_tokens=min_tokens,
        stop_token_ids=sorted(set(req.stop_token_ids or ())),
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias_of(req),
        logprobs=logprobs,
        json_schema=grammar.json_schema if grammar is not None else None,
        regex=grammar.regex if grammar is not None else None,
        grammar_param=grammar.param if grammar is not None else "response_format",
        echo=echo,
        prompt_logprobs=logprobs if echo else None,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
    )


def check_truncation(truncate_prompt_tokens: int | None) -> None:
    if truncate_prompt_tokens == 0:
        raise BadRequest("truncate_prompt_tokens keeps at least one token (or -1: the model's context)",
                         param="truncate_prompt_tokens")


def json_schema_of(req: _Sampling) -> str | None:
    """The JSON schema a chat's ``response_format`` asks the text to follow, as JSON text:
    ``json_object`` is any object, ``json_schema`` its ``json_schema.schema``; None for text."""
    if not isinstance(req, ChatCompletionRequest) or not req.response_format:
        return None
    response_format = req.response_format
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest('response_format: json_schema needs {"name": ..., "schema": {...}}',
                             param="response_format")
        return msgspec.json.encode(schema).decode()
    raise BadRequest(f"response_format type {kind!r}: use \"text\", \"json_object\" or \"json_schema\"",
                     param="response_format")


def requested_logprobs(req: _Sampling) -> int | None:
    """How many alternatives per token to report with its log probability; None: no log
    probabilities. Chat: ``logprobs: true`` and ``top_logprobs``; completions: ``logprobs``."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    assert isinstance(req, ChatCompletionRequest), "chat or completion"
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def logit_bias_of(req: _Sampling) -> dict[int, float]:
    """``logit_bias`` with its keys as token ids (0..2147483647; the worker checks the model's
    vocabulary); zero biases dropped."""
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        token_id = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if not 0 <= token_id <= MAX_INT32:
            raise BadRequest(f"logit_bias keys are token ids (integers in 0..2147483647 as strings), got {key!r}",
                             param="logit_bias")
        if value:
            bias[token_id] = value
    return bias


def chat_messages(req: ChatCompletionRequest, max_chars: int) -> list[ChatMessage]:
    """The conversation to template (at least one message, known roles: checked at decoding)."""
    messages: list[ChatMessage] = []
    total_chars = 0
    for i, message in enumerate(req.messages):
        content = _content_text(i, message)
        if message.tool_calls and message.role != "assistant":
            raise BadRequest(f"messages[{i}]: only assistant messages hold tool_calls", param="messages")
        calls = [ToolCall(call.id, call.function.name, call.function.arguments) for call in message.tool_calls or ()]
        total_chars += len(content) + sum(len(call.arguments) for call in calls)
        role = "system" if message.role == "developer" else message.role
        messages.append(ChatMessage(role=role, content=content, name=message.name, tool_calls=calls or None,
                                    tool_call_id=message.tool_call_id))
    if total_chars > max_chars:
        raise_prompt_too_large(total_chars, max_chars, param="messages")
    return messages


def _content_text(index: int, message: InMessage) -> str:
    """`message`'s text: its text parts joined, an assistant's ``refusal`` parts read as text
    (OpenAI takes them there only, its answers' refusals replayed); any other part is a 400."""
    if not isinstance(message.content, list):
        return message.content or ""
    kinds = {part.type for part in message.content}
    if "refusal" in kinds and message.role != "assistant":
        raise BadRequest(f"messages[{index}].content: refusal parts belong to assistant messages, "
                         f"not to the {message.role}'s", param="messages")
    if kinds - {"text", "refusal"}:
        raise BadRequest(f"messages[{index}].content: only text parts are supported (and refusal parts in an "
                         f"assistant's), got {sorted(kinds)}", param="messages")
    return "".join((part.text if part.type == "text" else part.refusal) or "" for part in message.content)


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """``chat_template_kwargs``, none of them a name Shoal passes itself (a 400 naming it),
    with ``reasoning_effort`` (a 400 when the two disagree)."""
    kwargs = dict(req.chat_template_kwargs or {})
    taken = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise BadRequest(f"chat_template_kwargs: {taken} are set by Shoal, not by requests",
                         param="chat_template_kwargs")
    effort = req.reasoning_effort
    if effort is not None and kwargs.setdefault("reasoning_effort", effort) != effort:
        raise BadRequest("reasoning_effort and chat_template_kwargs.reasoning_effort differ; send one",
                         param="reasoning_effort")
    return kwargs or None


def template_mode(req: ChatCompletionRequest) -> dict[str, bool]:
    """vLLM's ``add_generation_prompt`` and ``continue_final_message`` as the request fields
    that carry them (those not at their defaults). Continuing implies no generation prompt; a
    400 when both are asked for, or the last message is not the assistant's."""
    if not req.continue_final_message:
        return {"add_generation_prompt": False} if req.add_generation_prompt is False else {}
    if req.add_generation_prompt:
        raise BadRequest("continue_final_message goes on with the last message and add_generation_prompt opens a "
                         "new turn: send one", param="continue_final_message")
    if req.messages[-1].role != "assistant":
        raise BadRequest("continue_final_message goes on with the last message, which must be the assistant's "
                         f"(it is the {req.messages[-1].role}'s)", param="continue_final_message")
    return {"add_generation_prompt": False, "continue_final_message": True}


def completion_prompts(req: CompletionRequest, max_chars: int) -> list[dict[str, Any]]:
    """A completion request's prompts (one, or a batch), each as the request fields it sets:
    ``prompt`` (text) or ``prompt_token_ids``. The character bound is on them all together."""
    prompt: Any = req.prompt
    batch = prompt if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt) else [prompt]
    prompts = [_one_prompt(p) for p in batch]
    total_chars = sum(len(p["prompt"] or p["prompt_token_ids"] or ()) for p in prompts)
    if total_chars > max_chars:
        raise_prompt_too_large(total_chars, max_chars)
    return prompts


def _one_prompt(prompt: Any) -> dict[str, Any]:
    if not prompt:
        raise BadRequest("prompt is empty: send at least one character or token id", param="prompt")
    if isinstance(prompt, str):
        return {"prompt": prompt, "prompt_token_ids": None}
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t <= MAX_INT32 for t in prompt):
            raise BadRequest("prompt token ids must be integers in 0..2147483647", param="prompt")
        return {"prompt": None, "prompt_token_ids": list(prompt)}
    raise BadRequest("prompt must be a string, a list of token ids, or a list of either (a batch)",
                     param="prompt")


def check_num_choices(n: int, num_prompts: int) -> None:
    """400 when a request asks for more generations (prompts x n) than `MAX_CHOICES`."""
    if num_prompts * n > MAX_CHOICES:
        raise BadRequest(f"{num_prompts} prompts x n = {n} is {num_prompts * n} generations; one request "
                         f"makes at most {MAX_CHOICES}", param="n" if n > 1 else "prompt")


HEADER_ALLOWANCE_BYTES = 1024
"""Room left in a NATS message for the request's headers (reply subject, ids, deadline)."""


def check_fits_in_message(request: InferenceRequest, max_payload_bytes: int) -> None:
    """413 when `request` would not fit in one NATS message (the server's ``max_payload``):
    a publish would fail at any retry, so the client is told at once, not given a 503."""
    num_bytes = len(encode_msgpack(request)) + HEADER_ALLOWANCE_BYTES
    if num_bytes > max_payload_bytes:
        raise PayloadTooLarge(
            f"the request takes {num_bytes} bytes as a queue message; the NATS server takes at most "
            f"{max_payload_bytes} (its max_payload): shorten the prompt",
            param="prompt" if request.messages is None else "messages")


def raise_prompt_too_large(num_chars: int, max_chars: int, param: str = "prompt") -> None:
    """A 400 for a prompt surely longer than any context (before it is tokenized): what the
    worker answers for one longer than the model's (``context_length_exceeded``)."""
    raise BadRequest(f"prompt is too long: {num_chars} characters > {max_chars} maximum "
                          "(gateway.max_prompt_chars)", param=param, code=CONTEXT_LENGTH_EXCEEDED)


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(Struct):
    cached_tokens: int = 0
    """Prompt tokens whose K/V a replica had cached (prefix cache, the chat session)."""


class CompletionTokensDetails(Struct):
    reasoning_tokens: int = 0
    """Tokens a reasoning model thought in (its ``reasoning_parser``; counted chunk by chunk)."""


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = msgspec.field(default_factory=CompletionTokensDetails)


class ToolCallOut(Struct):
    id: str
    function: FunctionCall
    type: str = "function"

    def arguments_object(self) -> dict[str, Any]:
        """The arguments as a JSON object, as Ollama's and Anthropic's clients want them: what
        a model wrote that is not one is kept whole, as ``{"arguments": <its text>}``."""
        try:
            arguments = json.loads(self.function.arguments or "{}")
        except json.JSONDecodeError:
            arguments = None
        return arguments if isinstance(arguments, dict) else {"arguments": self.function.arguments}


class AssistantMessage(Struct, omit_defaults=True):
    role: str
    content: str | None
    """None when the answer is only calls."""
    tool_calls: list[ToolCallOut] | None = None
    reasoning: str | None = None
    """A reasoning model's thinking (its ``reasoning_parser``), as vLLM names it."""
    reasoning_content: str | None = None
    """The same, by the name vLLM and DeepSeek's API used first."""


class ToolCallDelta(Struct):
    """A streamed call, whole in one delta (the `openai` client joins deltas by `index`)."""

    index: int
    id: str
    function: FunctionCall
    type: str = "function"


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class TextLogprobs(Struct):
    """A completion's ``logprobs``: per token its text, log probability, alternatives (with
    the chosen token among them, as vLLM reports) and character offset in the text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    """None for an echoed prompt's first token (nothing precedes it), as OpenAI reports."""
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def __add__(self, later: TextLogprobs) -> TextLogprobs:
        return TextLogprobs(self.tokens + later.tokens, self.token_logprobs + later.token_logprobs,
                            self.top_logprobs + later.top_logprobs, self.text_offset + later.text_offset)


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    stop_reason: str | None = None
    """vLLM's: the stop string that ended the answer (null: it ended otherwise)."""


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
    tool_calls: list[ToolCallDelta] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    stop_reason: str | None = None


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
    logprobs: TextLogprobs | None = None
    stop_reason: str | None = None


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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                 PromptTokensDetails(cached_tokens), CompletionTokensDetails(reasoning_tokens))


def _token_text(token: bytes) -> str:
    return token.decode("utf-8", "replace")


def chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs([
        ChatTokenLogprob(_token_text(entry.token), entry.logprob, list(entry.token),
                         [TopLogprob(_token_text(token), logprob, list(token)) for token, logprob in entry.top])
        for entry in entries
    ])


def text_logprobs(entries: list[TokenLogprob], text_offset: int = 0) -> TextLogprobs:
    """`entries` as a completion reports them, offsets counted from `text_offset` (where the
    tokens' text starts in the choice's text)."""
    tokens = [_token_text(entry.token) for entry in entries]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    top: list[dict[str, float] | None] = [{_token_text(t): logprob for t, logprob in entry.top} | {token: entry.logprob}
                                          for token, entry in zip(tokens, entries, strict=True)]
    return TextLogprobs(tokens, [entry.logprob for entry in entries], top, offsets)


def echoed_text(prompt: PromptEcho, own_prompt: str | None) -> str:
    """An echoed prompt's text: the client's own, or the worker's decoding of its token ids."""
    return own_prompt if own_prompt is not None else prompt.text


def echoed_logprobs(prompt: PromptEcho) -> TextLogprobs:
    """An echoed prompt's log probabilities, its first token's null, offsets from 0."""
    first = _token_text(prompt.first_token)
    return TextLogprobs([first], [None], [None], [0]) + text_logprobs(prompt.logprobs or [], len(first))


def logprobs_end(logprobs: TextLogprobs) -> int:
    """The text offset just after `logprobs`' tokens (where the next tokens' offsets start)."""
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1]) if logprobs.tokens else 0


@dataclass
class Answer:
    """One choice's answer, as the non-streamed response reports it."""

    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    """None: not asked for."""
    tool_calls: list[ToolCallOut] | None = None
    """The calls read out of the text (then `text` is what remains, "" for none)."""
    prompt: PromptEcho | None = None
    """An echoed prompt (completions' ``echo``; `text` starts with it), for its log probabilities."""
    reasoning: str | None = None
    """A reasoning model's thinking, read out of the text (None: none, or not read for)."""
    stop_reason: str | None = None
    """The stop string that ended it (`FinalReply.stop_reason`)."""


def full_response(kind: Kind, response_id: str, created: int, model: str, answers: list[Answer],
                  token_usage: Usage) -> ChatCompletion | Completion:
    """The non-streamed response; `answers` holds each choice's, in order."""
    if kind == "chat":
        choices = [ChatChoice(i, AssistantMessage("assistant", (a.text or None) if a.tool_calls else a.text,
                                                  a.tool_calls, a.reasoning, a.reasoning), a.finish_reason,
                              None if a.logprobs is None else chat_logprobs(a.logprobs), a.stop_reason)
                   for i, a in enumerate(answers)]
        return ChatCompletion(response_id, created, model, choices, token_usage)
    completions = [CompletionChoice(i, a.text, a.finish_reason, _answer_logprobs(a), a.stop_reason)
                   for i, a in enumerate(answers)]
    return Completion(response_id, created, model, completions, usage=token_usage)


def _answer_logprobs(answer: Answer) -> TextLogprobs | None:
    if answer.logprobs is None:
        return None
    if answer.prompt is None:
        return text_logprobs(answer.logprobs)
    echoed = echoed_logprobs(answer.prompt)
    return echoed + text_logprobs(answer.logprobs, logprobs_end(echoed))


def stream_chunk(kind: Kind, response_id: str, created: int, model: str, *, index: int = 0,
                 text: str | None = None, finish_reason: str | None = None, role: bool = False,
                 token_usage: Usage | None = None, usage_only: bool = False,
                 logprobs: ChatLogprobs | TextLogprobs | None = None,
                 tool_calls: list[ToolCallDelta] | None = None, reasoning: str | None = None,
                 stop_reason: str | None = None) -> bytes:
    """One SSE ``data:`` payload of a streamed response: choice `index`'s delta, or the usage."""
    if kind == "chat":
        assert logprobs is None or isinstance(logprobs, ChatLogprobs), "a chat chunk's logprobs"
        delta = Delta(role="assistant" if role else None, content=text, tool_calls=tool_calls, reasoning=reasoning,
                      reasoning_content=reasoning)
        choices = [] if usage_only else [ChatChunkChoice(index, delta, finish_reason, logprobs, stop_reason)]
        chunk: Struct = ChatCompletionChunk(response_id, created, model, choices, usage=token_usage)
    else:
        assert logprobs is None or isinstance(logprobs, TextLogprobs), "a completion chunk's logprobs"
        choices_c = [] if usage_only else [CompletionChoice(index, text or "", finish_reason, logprobs, stop_reason)]
        chunk = Completion(response_id, created, model, choices_c, usage=token_usage)
    return encoder.encode(chunk)
