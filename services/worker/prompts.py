"""Turn an inference request into prompt token ids with the model's own tokenizer."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from shoal.services.worker.generation import RequestRejected
from shoal.shared.messages import InferenceRequest


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, request: InferenceRequest) -> list[int]:
    """Chat requests are rendered with the model's chat template (generation prompt added);
    completions are encoded as given. Raises RequestRejected (400) when that is impossible."""
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
        return list(tokenizer.encode(text, add_special_tokens=False))
    if request.prompt_token_ids is not None:
        vocab_size = len(tokenizer)
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestRejected(f"prompt token ids out of the vocabulary (size {vocab_size}): {bad[:5]}")
        return list(request.prompt_token_ids)
    return list(tokenizer.encode(request.prompt or "", add_special_tokens=True))


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
