"""Turn an inference request into prompt token ids with the model's own tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import msgspec
from transformers import PreTrainedTokenizerBase

from shoal.services.worker.generation import RequestRejected
from shoal.shared.messages import ChatMessage, InferenceRequest, SamplingParams, ToolCall, ToolSpec

NUM_KEPT_FIRST_TOKENS = 4
"""How many of its first tokens a prompt cut to fit the context keeps (`SamplingParams.fit_context`),
as Ollama's default ``num_keep``: the BOS token and the template's opening, which a model has
always seen first (a model without them reads the cut text worse); the rest is its latest text."""


def prompt_chars(request: InferenceRequest) -> int:
    """How many characters (or token ids) a request's prompt holds."""
    if request.messages is not None:
        return sum(len(m.content) + sum(len(call.arguments) for call in m.tool_calls or ())
                   for m in request.messages)
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    return len(request.prompt or "")


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, request: InferenceRequest,
                     vocab_size: int | None = None, max_model_len: int | None = None) -> list[int]:
    """Chat requests are rendered with the model's chat template (generation prompt added);
    completions are encoded as given; then cut as ``truncate_prompt_tokens`` asks (`truncated`,
    -1 meaning `max_model_len`), or with ``fit_context`` to `prompt_budget`, a chat first losing
    its oldest messages (`_fitting_chat_ids`). Raises RequestRejected (400) when that is impossible,
    or when an id (of the prompt, ``logit_bias`` or ``stop_token_ids``) is not below `vocab_size` (the model's
    embedding rows; None: the tokenizer's size): an id past the embedding must never reach
    the model."""
    limit = vocabulary_limit(tokenizer, vocab_size)
    if request.messages is not None:
        token_ids = _chat_ids(tokenizer, request)
        if request.params.fit_context and max_model_len is not None:
            budget = prompt_budget(request.params, max_model_len)
            if len(token_ids) > budget:
                token_ids = _fitting_chat_ids(tokenizer, request, budget)
    elif request.prompt_token_ids is not None:
        token_ids = list(request.prompt_token_ids)
    else:
        token_ids = list(tokenizer.encode(request.prompt or "", add_special_tokens=True))
    check_in_vocabulary(token_ids, limit, "prompt", param=None)
    check_in_vocabulary(request.params.logit_bias, limit, "logit_bias", param="logit_bias")
    check_in_vocabulary(request.params.stop_token_ids, limit, "stop_token_ids", param="stop_token_ids")
    return truncated(token_ids, request.params, max_model_len)


def _chat_ids(tokenizer: PreTrainedTokenizerBase, request: InferenceRequest) -> list[int]:
    return list(tokenizer.encode(chat_prompt(tokenizer, request), add_special_tokens=False))


def prompt_budget(params: SamplingParams, max_model_len: int) -> int:
    """How many tokens a prompt fitted to a context of `max_model_len` keeps (``fit_context``):
    all but room for ``max_tokens``, that room at most a quarter of the context (a request
    without ``num_predict`` asks for all of it: a chat's answer rarely needs more, and the
    conversation keeps the rest) and at least one token. Ollama fills the context and shifts it
    while it answers; Shoal does not shift, so a prompt that filled the context could answer
    one token only."""
    room = max(1, min(params.max_tokens, max_model_len // 4))
    return max(1, max_model_len - room)


def _fitting_chat_ids(tokenizer: PreTrainedTokenizerBase, request: InferenceRequest, budget: int) -> list[int]:
    """The chat's tokens without as few of its oldest messages as make it at most `budget`
    tokens: system messages and the last one are never dropped, and what is kept starts with a
    user's message (templates that want turns to alternate refuse anything else). Found by
    bisection: a few renders for any length of conversation. Without every droppable one it may
    still not fit: `truncated` then cuts it."""
    messages = request.messages or []
    droppable = [i for i, message in enumerate(messages[:-1]) if message.role != "system"]
    # Counts of oldest droppable messages that may go: what is left starts at a user's turn.
    counts = [n for n in range(1, len(droppable) + 1)
              if n == len(droppable) or messages[droppable[n]].role == "user"]

    def without_oldest(count: int) -> list[int]:
        gone = set(droppable[:count])
        kept = [message for i, message in enumerate(messages) if i not in gone]
        return _chat_ids(tokenizer, msgspec.structs.replace(request, messages=kept))

    if not counts:
        return _chat_ids(tokenizer, request)
    low, high = 0, len(counts) - 1
    fitting = without_oldest(counts[high])
    while low < high:
        middle = (low + high) // 2
        candidate = without_oldest(counts[middle])
        if len(candidate) <= budget:
            high, fitting = middle, candidate
        else:
            low = middle + 1
    return fitting


def truncated(token_ids: list[int], params: SamplingParams, max_model_len: int | None) -> list[int]:
    """`token_ids` cut to ``truncate_prompt_tokens`` at its `truncation_side` (-1 keeps what a
    context of `max_model_len` takes with room for one more token, or for all of ``max_tokens``
    when that must fit: `SamplingParams.max_tokens_must_fit`), or with ``fit_context`` cut
    as Ollama cuts a prompt: to `prompt_budget`, its first `NUM_KEPT_FIRST_TOKENS` and its latest
    tokens kept (max_model_len None: all)."""
    keep = _num_kept_tokens(params, max_model_len)
    if keep is None or len(token_ids) <= keep:
        return token_ids
    if params.fit_context:
        first = min(NUM_KEPT_FIRST_TOKENS, keep - 1)
        return token_ids[:first] + token_ids[len(token_ids) - (keep - first):]
    return token_ids[-keep:] if params.truncation_side == "left" else token_ids[:keep]


def _num_kept_tokens(params: SamplingParams, max_model_len: int | None) -> int | None:
    if max_model_len is not None and params.fit_context:
        return prompt_budget(params, max_model_len)
    if params.truncate_prompt_tokens == -1:
        room = params.max_tokens if params.max_tokens_must_fit else 1
        return None if max_model_len is None else max(1, max_model_len - room)
    return params.truncate_prompt_tokens


def chat_prompt(tokenizer: PreTrainedTokenizerBase, request: InferenceRequest) -> str:
    """The conversation (and its tools) rendered by the model's chat template, the assistant's
    turn opened (or its last message left open, `continue_final_message`); a 400 when the model has no template, or tools and a template that ignores them."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestRejected(f"model {request.model!r} has no chat template; use /v1/completions with a plain prompt")
    assert request.messages is not None, "a chat request"
    tools = [_template_tool(tool) for tool in request.tools] if request.tools else None
    if tools is not None and "tools" not in tokenizer.get_chat_template(None, tools):
        raise RequestRejected(f"the chat template of {request.model!r} does not render tools; this model "
                              "cannot be told about functions", param="tools")
    conversation = [_template_message(message) for message in request.messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tools=None if tools is None else [*tools],
                                             tokenize=False, add_generation_prompt=request.add_generation_prompt,
                                             continue_final_message=request.continue_final_message,
                                             **(request.chat_template_kwargs or {}))
    except Exception as exc:  # jinja errors come in many types; all mean "bad conversation"
        raise RequestRejected(f"chat template of {request.model!r} rejected the messages: {exc}") from exc
    assert isinstance(text, str), "tokenize=False renders text"
    return text


def _template_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _template_call(call: ToolCall) -> dict[str, Any]:
    """A past call as chat templates take it: arguments as a mapping where they are a JSON
    object (templates write ``arguments | tojson``; a string would be quoted twice), else as sent."""
    try:
        arguments: Any = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    if not isinstance(arguments, dict):
        arguments = call.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _template_tool(tool: ToolSpec) -> dict[Any, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def vocabulary_limit(tokenizer: PreTrainedTokenizerBase, vocab_size: int | None) -> int:
    """One past the highest token id the model takes: its embedding rows (`vocab_size`; None:
    unknown) and its tokenizer's size, the smaller."""
    return len(tokenizer) if vocab_size is None else min(vocab_size, len(tokenizer))


def check_in_vocabulary(token_ids: Iterable[int], limit: int, what: str, param: str | None) -> None:
    bad = [t for t in token_ids if not 0 <= t < limit]
    if bad:
        raise RequestRejected(f"{what} token ids out of the vocabulary (size {limit}): {bad[:5]}", param=param)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: object) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's EOS, the model config's and its
    generation config's (each an int or a list)."""
    sources = [
        tokenizer.eos_token_id,
        getattr(getattr(model, "config", None), "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ]
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return frozenset(ids)
