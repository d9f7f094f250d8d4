"""Which models the paged engine's attention computes correctly, decided at load.

Shoal's attention (`attention.py`, the kernels' `paged_attention`) is plain causal softmax
attention with a scale. Models whose attention needs more would compute something else
with it, silently: Gemma-2's logit soft-capping (``softcap``), gpt-oss's attention sinks
(``s_aux``). Such a model is refused when the worker loads it, with the reason, rather than
served wrong; `attention.py` refuses the same arguments at run time, for a model that gets
past this check. Sliding-window layers (Mistral, Gemma-2/3) are not refused: the engine
serves such a model only up to its window (`sizing.get_max_model_len`), where attending to
the whole context is exact. Reads a transformers config (and a model's modules).
"""

from __future__ import annotations

from typing import Any

from shoal.services.worker.loader import ModelLoadError


class UnsupportedAttention(ModelLoadError):
    """The paged engine cannot compute this model's attention (the message says why)."""


def get_unsupported_attention(config: Any, max_model_len: int | None = None) -> str | None:
    """Why the paged engine cannot serve a model of `config`, or None when it can.

    Args:
        config: the model's transformers config (`AutoConfig`).
        max_model_len: the longest context it will serve (None: the model's); part of the
            signature the loader calls, for checks that depend on it.
    """
    model_type = getattr(config, "model_type", "?")
    text_config = getattr(config, "text_config", None)
    if text_config is not None and text_config is not config:
        config = text_config
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        return (
            f"{model_type} soft-caps attention logits (attn_logit_softcapping={softcap}), which Shoal's "
            "paged attention does not: serve it with engine = \"hf\""
        )
    if model_type in ("gpt_oss",) or getattr(config, "sinks", None) is not None:
        return (
            f"{model_type} uses attention sinks, which Shoal's paged attention does not: "
            'serve it with engine = "hf"'
        )
    return None


def get_unsupported_modules(model: Any) -> str | None:
    """Why the paged engine cannot serve `model` from what its modules hold (attention sink
    parameters, whatever its config says), or None."""
    for name, module in model.named_modules():
        if getattr(module, "sinks", None) is not None:
            return f"{name} has attention sinks, which Shoal's paged attention does not support"
    return None


def check_attention(config: Any, max_model_len: int | None = None, model: Any = None) -> None:
    """Raises UnsupportedAttention with the reason when the paged engine cannot serve the model."""
    reason = get_unsupported_attention(config, max_model_len)
    if reason is None and model is not None:
        reason = get_unsupported_modules(model)
    if reason is not None:
        raise UnsupportedAttention(reason)

