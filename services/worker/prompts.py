"""Turn an inference request into prompt token ids with the model's own tokenizer."""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from shoal.services.worker.generation import RequestRejected
from shoal.shared.messages import InferenceRequest


def prompt_chars(request: InferenceRequest) -> int:
    """How many characters (or token ids) a request's prompt holds."""
    if request.messages is not None:
        return sum(len(m.content) for m in request.messages)
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    return len(request.prompt or "")


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, request: InferenceRequest,
                     vocab_size: int | None = None) -> list[int]:
    """Chat requests are rendered with the model's chat template (generation prompt added);
    completions are encoded as given. Raises RequestRejected (400) when that is impossible,
    or when an id (of the prompt or of ``logit_bias``) is not below `vocab_size` (the model's
    embedding rows; None: the tokenizer's size): an id past the embedding must never reach
    the model."""
    limit = len(tokenizer) if vocab_size is None else min(vocab_size, len(tokenizer))
    if request.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestRejected(
                f"model {request.model!r} has no chat template; use /v1/completions with a plain prompt"
            )
        conversation = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja errors come in many types; all mean "bad conversation"
            raise RequestRejected(f"chat template of {request.model!r} rejected the messages: {exc}") from exc
        token_ids = list(tokenizer.encode(text, add_special_tokens=False))
    elif request.prompt_token_ids is not None:
        token_ids = list(request.prompt_token_ids)
    else:
        token_ids = list(tokenizer.encode(request.prompt or "", add_special_tokens=True))
    _check_in_vocabulary(token_ids, limit, "prompt", param=None)
    _check_in_vocabulary(request.params.logit_bias, limit, "logit_bias", param="logit_bias")
    return token_ids


def _check_in_vocabulary(token_ids: Iterable[int], limit: int, what: str, param: str | None) -> None:
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
