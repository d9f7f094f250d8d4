"""Memory math of a model replica: what it needs (placement) and how many KV blocks fit (engine).

A replica's GPU (or virtual GPU) bytes split as::

    | weights | activations + workspace reserve | runtime overhead | KV block pool ......... |
      params x    one forward pass of the          CUDA context,      2 x layers x kv_heads x
      dtype       batch token budget               allocator slack    head_dim x dtype bytes
                                                                      per token

Weights are parameters x dtype bytes (a 7B model in fp16 is ~13.5 GB, not 28); KV bytes per
token use the real KV head count and head size (hidden size is not kv_heads x head_dim
under GQA or with an explicit `head_dim`); activations use the real hidden and MLP sizes.
Activations and KV take the dtype the replica computes in: the weights' own, except for a
bfloat16 Llama-style model on the CPU, whose native forward keeps bfloat16 only in its
products' panels and computes, caches K/V and holds the embedding and norms in float32
(`get_model_shape(..., on_cpu=True)`; docs/engine.md, "Bfloat16 weights (CPU)").

Pure: no torch at import. `get_model_shape` reads a transformers config; for architectures
whose parameter layout is not written out here it counts parameters on the meta device
(no memory, no weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_RUNTIME_OVERHEAD_BYTES = 512 * MIB
"""CUDA context, cuBLAS workspaces and caching-allocator slack of one worker process."""

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}
LLAMA_LIKE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
"""Decoder layouts whose parameter count is written out here (`_count_decoder_parameters`),
and the model types the CPU's native forward runs (`engine.native_forward`)."""
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class ModelShape:
    """What memory math needs from a model config."""

    num_parameters: int
    dtype_bytes: int
    """Of the weights."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    compute_dtype_bytes: int = 0
    """Of activations and the KV cache; 0: the weights' (`dtype_bytes`)."""
    num_float32_parameters: int = 0
    """Parameters held in float32 whatever the weights' dtype (the CPU's bfloat16 path:
    embedding, norms, biases)."""

    @property
    def weight_bytes(self) -> int:
        other = self.num_parameters - self.num_float32_parameters
        return other * self.dtype_bytes + self.num_float32_parameters * FLOAT32_BYTES

    @property
    def activation_dtype_bytes(self) -> int:
        return self.compute_dtype_bytes or self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.activation_dtype_bytes

    def get_kv_bytes_per_block(self, block_size: int) -> int:
        return block_size * self.kv_bytes_per_token


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a replica needs, by part."""

    num_parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    """KV budget: `kv_cache_tokens` x `kv_bytes_per_token`."""
    activation_bytes: int
    """Peak of one forward pass over the batch token budget."""
    runtime_overhead_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.activation_bytes + self.runtime_overhead_bytes


def get_dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype given as a string ("bfloat16", "torch.float16") or torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def get_model_shape(config: Any, dtype: Any = None, *, on_cpu: bool = False) -> ModelShape:
    """The shape of a transformers `PretrainedConfig`'s model, without loading weights.

    Args:
        config: a decoder-only causal LM config (Llama, Mistral, Qwen2 and alike).
        dtype: the dtype the weights are served in; None or "auto" means the config's own
            (`dtype`, else float32, as transformers loads it).
        on_cpu: served by a CPU worker, whose native forward runs a bfloat16 Llama-style
            model in float32 (activations, KV cache, embedding and norms; bfloat16 panels).
    """
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    num_heads = config.num_attention_heads
    widened = on_cpu and str(dtype).removeprefix("torch.") == "bfloat16" and (
        getattr(config, "model_type", None) in LLAMA_LIKE_MODEL_TYPES
    )
    return ModelShape(
        num_parameters=count_parameters(config),
        dtype_bytes=get_dtype_bytes(dtype),
        compute_dtype_bytes=FLOAT32_BYTES if widened else 0,
        num_float32_parameters=_count_unpacked_parameters(config) if widened else 0,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=_get_head_dim(config),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_model_len=config.max_position_embeddings,
    )


def count_parameters(config: Any) -> int:
    """Parameters of the causal LM `config` describes (tied embeddings counted once)."""
    if getattr(config, "model_type", None) in LLAMA_LIKE_MODEL_TYPES:
        return _count_decoder_parameters(config)
    return _count_parameters_on_meta_device(config)


def get_activation_bytes(shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Peak transient bytes of one forward pass over `max_num_batched_tokens` flattened tokens.

    Layers run one after another and inference keeps no activations for backward, so the
    peak is one layer's tensors: residual, normed input, attention output and projection
    (4 x hidden), q/k/v and the attention result ((2 x heads + 2 x kv_heads) x head_dim),
    MLP gate, up and their product (3 x intermediate); plus the logits of each sequence's
    last token (in the model's dtype, then fp32 for sampling). Paged attention reads K/V
    from the blocks and materializes no [tokens x context] score matrix.
    """
    per_token = (
        4 * shape.hidden_size
        + (2 * shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
        + 3 * shape.intermediate_size
    )
    hidden_bytes = max_num_batched_tokens * per_token * shape.activation_dtype_bytes
    logit_bytes = max_num_seqs * shape.vocab_size * (4 + shape.activation_dtype_bytes)
    return hidden_bytes + logit_bytes


def estimate_memory_requirements(
    shape: ModelShape,
    kv_cache_tokens: int,
    *,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    runtime_overhead_bytes: int = DEFAULT_RUNTIME_OVERHEAD_BYTES,
) -> MemoryEstimate:
    """What one replica of the model needs on its GPU.

    Args:
        shape: from `get_model_shape`.
        kv_cache_tokens: tokens of KV cache to budget for (all sequences together).
        max_num_batched_tokens: the engine's per-step token budget (sizes activations).
        max_num_seqs: most sequences in one step (sizes the logits).
        runtime_overhead_bytes: CUDA context and allocator slack.
    """
    return MemoryEstimate(
        num_parameters=shape.num_parameters,
        weight_bytes=shape.weight_bytes,
        kv_bytes_per_token=shape.kv_bytes_per_token,
        kv_cache_bytes=kv_cache_tokens * shape.kv_bytes_per_token,
        activation_bytes=get_activation_bytes(shape, max_num_batched_tokens, max_num_seqs),
        runtime_overhead_bytes=runtime_overhead_bytes,
    )


def estimate_from_config(
    config: Any, kv_cache_tokens: int, dtype: Any = None, *, on_cpu: bool = False, **kwargs: int
) -> MemoryEstimate:
    """`estimate_memory_requirements` for a transformers config (`on_cpu` as `get_model_shape`;
    other keyword arguments pass through)."""
    return estimate_memory_requirements(get_model_shape(config, dtype, on_cpu=on_cpu), kv_cache_tokens, **kwargs)


def size_kv_pool(
    allocation_bytes: int, weight_bytes: int, reserve_bytes: int, kv_bytes_per_block: int
) -> int:
    """Blocks of KV cache that fit in a replica's allocation.

    Args:
        allocation_bytes: the replica's GPU (or virtual GPU) bytes.
        weight_bytes: the loaded weights' measured bytes.
        reserve_bytes: activations, workspace and runtime overhead kept out of the pool.
        kv_bytes_per_block: K and V of one block across all layers.

    Returns:
        The number of blocks (0 when nothing is left).
    """
    assert kv_bytes_per_block > 0, f"kv_bytes_per_block must be positive, got {kv_bytes_per_block}"
    return max(0, (allocation_bytes - weight_bytes - reserve_bytes) // kv_bytes_per_block)


def _get_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _get_projection_dims(config: Any) -> tuple[int, int, int]:
    """(hidden, q, kv) widths of a Llama-style layer's attention projections."""
    head_dim = _get_head_dim(config)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.hidden_size, config.num_attention_heads * head_dim, num_kv_heads * head_dim


def _count_lm_head_parameters(config: Any) -> int:
    return 0 if getattr(config, "tie_word_embeddings", False) else config.vocab_size * config.hidden_size


def _count_decoder_parameters(config: Any) -> int:
    """Llama / Mistral / Qwen2 layout: embeddings, per-layer attention + gated MLP + 2 RMSNorms,
    a final norm, and an lm_head unless tied to the embeddings."""
    hidden, q_dim, kv_dim = _get_projection_dims(config)
    attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    if config.model_type == "qwen2":
        attention += q_dim + 2 * kv_dim  # q/k/v biases, none on o_proj
    elif getattr(config, "attention_bias", False):
        attention += q_dim + 2 * kv_dim + hidden
    mlp = 3 * hidden * config.intermediate_size
    if getattr(config, "mlp_bias", False):
        mlp += 2 * config.intermediate_size + hidden
    per_layer = attention + mlp + 2 * hidden
    embeddings = config.vocab_size * hidden
    return embeddings + config.num_hidden_layers * per_layer + hidden + _count_lm_head_parameters(config)


def _count_unpacked_parameters(config: Any) -> int:
    """Of a Llama-style model, the parameters outside the products' weight matrices (the
    embedding, the norms, biases): what the CPU's packed load keeps as float32 tensors."""
    hidden, q_dim, kv_dim = _get_projection_dims(config)
    products = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden + 3 * hidden * config.intermediate_size
    return _count_decoder_parameters(config) - config.num_hidden_layers * products - _count_lm_head_parameters(config)


def _count_parameters_on_meta_device(config: Any) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return int(model.num_parameters())
