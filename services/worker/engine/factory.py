"""Builds the paged engine for a model the worker has loaded (`loader.LoadedModel`)."""

from __future__ import annotations

from shoal.services.worker.engine.paged_engine import EngineConfig, PagedEngine
from shoal.services.worker.loader import LoadedModel
from shoal.shared.policy.memory import DEFAULT_RUNTIME_OVERHEAD_BYTES

DEFAULT_KV_CACHE_TOKENS = 4096
"""Pool size, in tokens, for a replica run without an allocation (by hand)."""


def build_paged_engine(
    loaded: LoadedModel,
    *,
    block_size: int = 16,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    kv_cache_tokens: int | None = None,
) -> PagedEngine:
    """A `PagedEngine` whose KV pool fills what the replica's allocation leaves.

    The pool gets `allocation_bytes` minus the measured weights, the activation reserve
    and the runtime overhead (`shoal.shared.policy.memory`), capped at the model's KV
    budget `kv_cache_tokens`; a replica with no allocation gets `DEFAULT_KV_CACHE_TOKENS`.

    Raises:
        KVPoolTooSmall: the allocation leaves no room for a single block.
    """
    num_blocks = None if loaded.allocation_bytes else -(-DEFAULT_KV_CACHE_TOKENS // block_size)
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
        num_blocks=num_blocks,
        max_kv_cache_tokens=kv_cache_tokens,
        # A CUDA context and allocator slack exist only on real GPUs.
        runtime_overhead_bytes=DEFAULT_RUNTIME_OVERHEAD_BYTES if loaded.device.type == "cuda" else 0,
    )
    return PagedEngine(
        loaded.model,
        loaded.tokenizer,
        allocation_bytes=loaded.allocation_bytes or None,
        config=config,
        max_model_len=loaded.max_model_len,
    )
