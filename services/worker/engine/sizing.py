"""How much memory a paged engine keeps out of its KV pool, and how many threads its native
forward pass takes: the engine's sizing rules, shared by the engine, its factory and the
worker's loader."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from shoal.services.worker.engine.native_forward import ThreadPolicy, get_available_cores
from shoal.services.worker.loader import ModelLoadError
from shoal.shared.model_memory import get_activation_bytes, get_model_shape, size_kv_pool

if TYPE_CHECKING:
    from shoal.services.worker.engine.engine_config import EngineConfig


class KVPoolTooSmall(ModelLoadError):
    """The allocation leaves no room for a KV block pool after weights and reserve."""


def make_thread_policy(cpu_threads: int | Literal["auto"]) -> ThreadPolicy:
    """The native forward's threads: `cpu_threads` for every pass, or ("auto") per pass up to
    the cores this process may use and torch's intra-op thread count (the worker's
    ``torch_threads``), whichever is smaller."""
    if cpu_threads != "auto":
        return ThreadPolicy(max_threads=cpu_threads, fixed=cpu_threads)
    return ThreadPolicy(max_threads=max(1, min(get_available_cores(), torch.get_num_threads())))


def get_reserve_bytes(model_config: Any, dtype: torch.dtype, config: EngineConfig) -> int:
    """What the engine keeps out of its KV pool besides the weights: activations of one step
    at the token budget, logits of `max_num_seqs` rows, and the runtime overhead."""
    shape = get_model_shape(model_config, dtype)
    activation_bytes = get_activation_bytes(shape, config.max_num_batched_tokens, config.max_num_seqs)
    return activation_bytes + config.runtime_overhead_bytes


def get_min_engine_bytes(model_config: Any, dtype: torch.dtype, config: EngineConfig) -> int:
    """The least an allocation must hold besides the weights for the engine to start: its
    reserve and one KV block (with less, sizing the pool raises `KVPoolTooSmall`)."""
    block_bytes = get_model_shape(model_config, dtype).get_kv_bytes_per_block(config.block_size)
    return get_reserve_bytes(model_config, dtype, config) + block_bytes


def measure_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))



def size_pool(model: torch.nn.Module, allocation_bytes: int | None, *, packed_weight_bytes: int,
              reserve_bytes: int, block_size: int) -> int:
    """KV blocks an allocation holds after the model's weights (parameters and packed copies)
    and the reserve.

    Raises:
        ValueError: no allocation given.
        KVPoolTooSmall: the allocation leaves no block.
    """
    if allocation_bytes is None:
        raise ValueError("PagedEngine needs allocation_bytes or config.num_blocks")
    shape = get_model_shape(model.config, next(model.parameters()).dtype)
    weight_bytes = measure_weight_bytes(model) + packed_weight_bytes
    num_blocks = size_kv_pool(allocation_bytes, weight_bytes, reserve_bytes, shape.get_kv_bytes_per_block(block_size))
    if num_blocks == 0:
        raise KVPoolTooSmall(
            f"allocation of {allocation_bytes} bytes leaves no KV block: weights take {weight_bytes}, "
            f"activations and runtime overhead {reserve_bytes}"
        )
    return num_blocks


def get_max_model_len(model_config: Any, requested: int | None, pool_tokens: int) -> int:
    """The serving limit on prompt + completion: the model's context, the pool, the request."""
    limits = [model_config.max_position_embeddings, pool_tokens]
    if requested is not None:
        limits.append(requested)
    # Paged attention attends to the whole context: serve sliding-window models only
    # within their window, where full attention is exact.
    if getattr(model_config, "use_sliding_window", True) and getattr(model_config, "sliding_window", None):
        limits.append(model_config.sliding_window)
    return min(limits)
