"""Builds the paged engine for a model the worker has loaded (`loader.LoadedModel`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.model_support import check_attention
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.engine.session_kv import SessionSettings
from shoal.services.worker.engine.sizing import get_min_engine_bytes
from shoal.services.worker.loader import LoadedModel, join_restored_weights
from shoal.shared.config import WorkerConfig
from shoal.shared.model_settings import DEFAULT_KV_CACHE_TOKENS

DEFAULT_WORKER = WorkerConfig()
"""The ``[worker]`` defaults: what an engine built by hand (tests, benchmarks) runs with."""


def make_engine_config(
    device: torch.device,
    worker: WorkerConfig = DEFAULT_WORKER,
    *,
    num_blocks: int | None = None,
    kv_cache_tokens: int | None = None,
    sessions: SessionSettings | None = None,
    warm_up: bool = True,
) -> EngineConfig:
    """The `EngineConfig` a worker's engine runs with on `device`, from its ``[worker]``
    settings (see `build_paged_engine`)."""
    return EngineConfig(
        block_size=worker.block_size,
        max_num_seqs=worker.max_num_seqs,
        max_num_batched_tokens=max(worker.max_num_batched_tokens, worker.max_num_seqs),
        enable_prefix_caching=worker.prefix_caching,
        num_blocks=num_blocks,
        max_kv_cache_tokens=kv_cache_tokens,
        # A CUDA context and allocator slack exist only on real GPUs.
        runtime_overhead_bytes=worker.runtime_overhead_bytes if device.type == "cuda" else 0,
        # Before the worker reports ready (and its memory is measured): see warm_up.py. A
        # restore skips it: the process has run the model before, and a restore's reading
        # only ever raises the memory figure (placement/memory_figure.py).
        warm_up=warm_up,
        sessions=sessions,
        cpu_threads=worker.cpu_threads,
    )


def get_min_engine_bytes_for(
    device: torch.device, worker: WorkerConfig = DEFAULT_WORKER
) -> Callable[[Any, torch.dtype], int]:
    """The least bytes besides the weights an engine built with these settings needs, as a
    function of the model's config and dtype (what `loader.load_model` checks before the
    engine is built): the activation reserve and one KV block."""
    config = make_engine_config(device, worker)
    return lambda model_config, dtype: get_min_engine_bytes(model_config, dtype, config)


def build_paged_engine(
    loaded: LoadedModel,
    worker: WorkerConfig = DEFAULT_WORKER,
    *,
    kv_cache_tokens: int | None = None,
    sessions: SessionSettings | None = None,
    warm_up: bool = True,
) -> PagedEngine:
    """A `PagedEngine` whose KV pool fills what the replica's allocation leaves.

    The pool gets `allocation_bytes` minus the measured weights, the activation reserve
    and the runtime overhead (`shoal.shared.model_memory`), capped at the model's KV
    budget `kv_cache_tokens`; a replica with no allocation gets `kv_cache_tokens` (default
    `DEFAULT_KV_CACHE_TOKENS`, 32 requests of 2,048 tokens). The pool's size is logged
    (``engine.started``) and reported with the worker's ready event (``shoal status``).
    The engine runs its warm-up pass before it is returned. Weights a restore is still
    copying to the GPU are joined (`join_restored_weights`): after the build without a
    warm-up, so the build runs while they arrive. `sessions` turns the session
    cache on (docs/sessions.md); its host pool is CPU memory on top of the allocation.

    Raises:
        UnsupportedAttention: the model's attention needs what Shoal's does not compute
            (`model_support`).
        KVPoolTooSmall: the allocation leaves no room for a single block.
        KernelBuildError: on CUDA, Shoal's kernels cannot be built.
    """
    if not loaded.attention_checked:  # a walk over every module: once, not on every wake
        check_attention(loaded.model.config, loaded.max_model_len, loaded.model)
        loaded.attention_checked = True
    config = make_engine_config(
        loaded.device,
        worker,
        num_blocks=None
        if loaded.allocation_bytes
        else -(-(kv_cache_tokens or DEFAULT_KV_CACHE_TOKENS) // worker.block_size),
        kv_cache_tokens=kv_cache_tokens,
        sessions=sessions,
        warm_up=warm_up,
    )
    if warm_up:
        join_restored_weights(loaded)
    engine = PagedEngine(
        loaded.model,
        loaded.tokenizer,
        allocation_bytes=loaded.allocation_bytes or None,
        config=config,
        max_model_len=loaded.max_model_len,
    )
    join_restored_weights(loaded)
    return engine
