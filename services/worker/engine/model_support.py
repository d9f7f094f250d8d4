"""Which models the paged engine's attention computes correctly, decided at load.

Shoal's attention (`attention.py`, the kernels' `paged_attention`) is plain causal softmax
attention with a scale. Models whose attention needs more compute something else with
it, silently: Gemma-2's logit soft-capping (``softcap``), gpt-oss's attention sinks
(``s_aux``), sliding-window layers (Mistral, Gemma-2/3, gpt-oss) once a context is longer
than the window. Such a model is refused when the worker loads it, with the reason, rather
than served wrong; `attention.py` refuses the same arguments at run time, for a model that
gets past this check. Reads a transformers config (and a model's modules), nothing else.
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
        max_model_len: the longest context it will serve: a sliding window at least this
            long never slides, and is accepted. None: the model's `max_position_embeddings`.
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
    window = _get_active_window(config)
    if window is not None:
        longest = max_model_len or int(getattr(config, "max_position_embeddings", 0) or 0)
        if not longest or window < longest:
            return (
                f"{model_type} has sliding-window attention ({window} positions) and contexts up to "
                f"{longest or 'unknown'} positions; Shoal's paged attention attends to the whole context: "
                f'set max_model_len <= {window} or serve it with engine = "hf"'
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


def _get_active_window(config: Any) -> int | None:
    """The sliding window some layer applies, or None when every layer attends to everything."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if "sliding_attention" not in layer_types:
            return None
        return int(window) if window else 0
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)
