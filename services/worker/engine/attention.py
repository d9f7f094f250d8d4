"""Shoal's paged attention as a transformers attention function.

Registered under `ATTN_IMPLEMENTATION` with transformers' `AttentionInterface`, it replaces
the model's attention while its weights, projections, rotary embeddings, MLPs and norms
stay Hugging Face's. Every forward pass carries one `PagedBatch` (a keyword argument of
the model call that transformers passes down to each layer's attention): the batch is all
scheduled tokens of all sequences flattened into one row, and each layer

1. writes the new tokens' K/V into the paged cache (`ops.write_kv`, by slot mapping),
2. attends each query row to its sequence's context: decode rows straight from the blocks
   (`ops.paged_attention`, by block table), prefill rows through SDPA
   (`device_batch.run_device_attention`), each layer on its own device's copy of the indexes.

On the CPU the batch instead carries an `AttentionPlan`, the same metadata built once
per pass by the runner, and each layer runs `reference.write_kv` and `reference.run_attention` with
it: the CPU implementation of the same two ops, without rebuilding the plan per layer.

Attention that is more than scaled causal softmax (soft-capped logits, attention sinks, an
explicit mask) is refused with `UnsupportedAttention` rather than silently computed
without it; models that need it are refused at load already (`model_support`).

No attention mask is registered for the name on purpose: transformers then skips building
a mask entirely (`masking_utils` returns None for implementations it has no mask function
for), where a registered mask function would still run its packed-sequence detection,
with a host sync, on every forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

from shoal.kernels import reference
from shoal.kernels.attention_plan import AttentionPlan
from shoal.services.worker.engine.device_batch import DeviceBatch, run_device_attention
from shoal.services.worker.engine.model_support import UnsupportedAttention

ATTN_IMPLEMENTATION = "shoal_paged"
BATCH_KWARG = "shoal_batch"


@dataclass(frozen=True)
class PagedBatch:
    """Attention metadata of one forward pass (layouts: `shoal.kernels.ops`)."""

    layer_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """(key_cache, value_cache) of each layer, views into its device's KV pool."""
    slot_mapping: torch.Tensor | None = None
    """int64 [num_tokens]: where each new token's K/V goes (the CPU plan's path)."""
    cpu_plan: AttentionPlan | None = None
    """When the cache is on the CPU: the batch as host-side metadata, built once per pass,
    with which every layer runs `reference.run_attention` (no per-layer `tolist`, masks or
    block counts)."""
    device_batch: DeviceBatch | None = None
    """Otherwise (CUDA): the kernels' path, with index tensors per device."""
    before_attention: Callable[[int], None] | None = None
    """Called with a layer's index before the layer's attention reads its cache: the step's
    copies back from the host pool, layer by layer (`layered_swap_in`)."""


def paged_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, H, T, D], key/value [1, Hkv, T, D].

    Args:
        module: the model's attention module (its `layer_idx` picks the layer's cache).

    Returns:
        (attention output [1, T, H, D], None): no attention weights are materialized.
    """
    batch: PagedBatch | None = kwargs.get(BATCH_KWARG)
    assert batch is not None, f"{ATTN_IMPLEMENTATION} attention runs only inside Shoal's engine"
    assert query.shape[0] == 1, "the engine flattens every batch into one row"
    _refuse_unsupported(module, attention_mask, kwargs)
    key_cache, value_cache = batch.layer_caches[module.layer_idx]
    if batch.before_attention is not None:
        batch.before_attention(module.layer_idx)
    # [1, H, T, D] -> [T, H, D] views; the ops accept any token stride.
    query_rows, key_rows, value_rows = (
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
    )
    out = torch.empty(query_rows.shape, dtype=query.dtype, device=query.device)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if batch.cpu_plan is not None:
        assert batch.slot_mapping is not None, "a CPU plan comes with its slot mapping"
        # The runner's own tensors, the kernels' layouts by construction: the CPU functions
        # directly, without the public ops' argument checks and padding scan.
        reference.write_kv(key_rows, value_rows, key_cache, value_cache, batch.slot_mapping, may_pad=False)
        reference.run_attention(
            out, query_rows, key_cache, value_cache, batch.cpu_plan, scale, key_rows, value_rows
        )
    else:
        assert batch.device_batch is not None, "a batch carries a CPU plan or the kernels' path"
        run_device_attention(
            out, query_rows, key_rows, value_rows, key_cache, value_cache, batch.device_batch, scale, module.layer_idx
        )
    return out.unsqueeze(0), None


def _refuse_unsupported(module: Any, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    """Raises UnsupportedAttention for what this attention would otherwise drop silently."""
    if kwargs.get("softcap"):
        raise UnsupportedAttention(f"layer {module.layer_idx}: soft-capped attention logits are not supported")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise UnsupportedAttention(f"layer {module.layer_idx}: attention sinks are not supported")
    if attention_mask is not None:
        raise UnsupportedAttention(
            f"layer {module.layer_idx}: an explicit attention mask is not supported (Shoal's attention is causal "
            "over each sequence's own context)"
        )


def register_attention() -> None:
    """Make `ATTN_IMPLEMENTATION` a valid `attn_implementation` for every transformers model."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
