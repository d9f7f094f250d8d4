"""Shoal's paged attention as a transformers attention function.

Registered under `ATTN_IMPLEMENTATION` with transformers' `AttentionInterface`, it replaces
the model's attention while its weights, projections, rotary embeddings, MLPs and norms
stay Hugging Face's. Every forward pass carries one `PagedBatch` (a keyword argument of
the model call that transformers passes down to each layer's attention): the batch is all
scheduled tokens of all sequences flattened into one row, and each layer

1. writes the new tokens' K/V into the paged cache (`ops.write_kv`, by slot mapping),
2. attends each query row to its sequence's context straight from the blocks
   (`ops.paged_attention`, by block table), which covers decode, prefill and prefill over
   a cached prefix in one call.

On the CPU the batch instead carries an `AttentionPlan`, the same metadata built once
per pass by the runner, and each layer runs `reference.write_kv` and `reference.run_attention` with
it: the CPU implementation of the same two ops, without rebuilding the plan per layer.

No attention mask is registered for the name on purpose: transformers then skips building
a mask entirely (`masking_utils` returns None for implementations it has no mask function
for), where a registered mask function would still run its packed-sequence detection,
with a host sync, on every forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

from shoal.kernels import ops, reference
from shoal.kernels.attention_plan import AttentionPlan

ATTN_IMPLEMENTATION = "shoal_paged"
BATCH_KWARG = "shoal_batch"


@dataclass(frozen=True)
class PagedBatch:
    """Attention metadata of one forward pass (layouts: `shoal.kernels.ops`)."""

    layer_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """(key_cache, value_cache) of each layer, views into the engine's one KV tensor."""
    slot_mapping: torch.Tensor
    """int64 [num_tokens]: where each new token's K/V goes."""
    block_tables: torch.Tensor | None = None
    """int32 [num_seqs, max_blocks] (for `ops.paged_attention`)."""
    seq_lens: torch.Tensor | None = None
    """int32 [num_seqs]: context length including this pass's tokens."""
    query_start_loc: torch.Tensor | None = None
    """int32 [num_seqs + 1]: each sequence's first row in the flattened batch."""
    cpu_plan: AttentionPlan | None = None
    """Instead of the three tensors above when the cache is on the CPU: the batch as
    host-side metadata, built once per pass, with which every layer runs
    `reference.run_attention` (no per-layer `tolist`, masks or block counts)."""


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
    key_cache, value_cache = batch.layer_caches[module.layer_idx]
    # [1, H, T, D] -> [T, H, D] views; the ops accept any token stride.
    query_rows, key_rows, value_rows = (
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
    )
    out = torch.empty(query_rows.shape, dtype=query.dtype, device=query.device)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if batch.cpu_plan is not None:
        # The runner's own tensors, the kernels' layouts by construction: the CPU functions
        # directly, without the public ops' argument checks and padding scan.
        reference.write_kv(key_rows, value_rows, key_cache, value_cache, batch.slot_mapping, may_pad=False)
        reference.run_attention(
            out, query_rows, key_cache, value_cache, batch.cpu_plan, scale, key_rows, value_rows
        )
    else:
        ops.write_kv(key_rows, value_rows, key_cache, value_cache, batch.slot_mapping)
        assert (
            batch.block_tables is not None
            and batch.seq_lens is not None
            and batch.query_start_loc is not None
        ), "a batch without a CPU plan carries the kernels' index tensors"
        ops.paged_attention(
            out,
            query_rows,
            key_cache,
            value_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            scale,
        )
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Make `ATTN_IMPLEMENTATION` a valid `attn_implementation` for every transformers model."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
