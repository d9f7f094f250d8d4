"""What a paged engine is told (`EngineConfig`) and what it reports (`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shoal.services.worker.engine.session_kv import SessionSettings, SessionStats
from shoal.shared.config import WorkerConfig
from shoal.shared.kv_cache.block_pool import BlockPoolStats

_WORKER = WorkerConfig()


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. The defaults are the ``[worker]`` settings' (declared once, in
    `shoal.shared.config.WorkerConfig`); `factory.make_engine_config` builds one from them."""

    block_size: int = _WORKER.block_size
    """Tokens per KV block."""
    max_num_seqs: int = _WORKER.max_num_seqs
    """Most requests in the engine (running and waiting); also bounds `num_free_slots`."""
    max_num_batched_tokens: int = _WORKER.max_num_batched_tokens
    """Token budget of one forward pass (chunked prefill splits longer prompts); at least
    `max_num_seqs`, so every running sequence decodes in every step."""
    enable_prefix_caching: bool = _WORKER.prefix_caching
    num_blocks: int | None = None
    """Pool size in blocks; None sizes it from the allocation (`size_kv_pool`)."""
    max_kv_cache_tokens: int | None = None
    """The model's KV budget: a pool sized from a generous allocation stops here, so the
    memory a replica is measured to hold is what it needs, not all it was given."""
    runtime_overhead_bytes: int = _WORKER.runtime_overhead_bytes
    """Kept out of the pool besides weights and activations (CUDA context, allocator slack)."""
    pack_cpu_linear_weights: bool = True
    """On the CPU, run float32 linear layers on oneDNN-packed weights (`packed_linear`),
    1.1-2.5x faster than MKL's; the packed tensors replace the weights (same bytes). For
    models the native forward does not run (with it, its own packed products serve)."""
    native_forward: bool = True
    """On the CPU, run a float32 Llama, Mistral or Qwen2 model's forward passes in Shoal's C
    code (`native_forward`): every layer in one call, no transformers modules. Other models,
    or False, run through transformers."""
    cpu_threads: int | Literal["auto"] = _WORKER.cpu_threads
    """Threads of the native forward: a number for every pass, or "auto": each pass takes
    one thread or all it may (the cores available, at most torch's thread count), by its
    size (`native_forward.ThreadPolicy`)."""
    warm_up: bool = False
    """Run one forward pass at the token budget (a small one on the CPU) while the engine is
    built (`warm_up.py`), so a server's memory is measured after its peak and its first
    request pays no first-pass costs. The worker's factory turns it on."""
    sessions: SessionSettings | None = None
    """The session cache (docs/sessions.md): a finished turn of a request with a
    `session_id` keeps its KV for the session's next turn. None: no session cache."""
    kernels_path: bool = False
    """Run attention the way CUDA does (`device_batch`: decode rows on the paged op, prefill
    rows on SDPA, per-device index tensors) on the CPU too, instead of the CPU plan and the
    native forward: how the CPU tests exercise the GPU path. Always on for CUDA."""
    kv_layer_devices: tuple[str, ...] | None = None
    """Each layer's KV device; None: where the layer's weights are (`kv_placement`). Tests
    give CPU labels (``"cpu:0"``, ``"cpu:1"``) to run a replica's pools split by device."""

    def __post_init__(self) -> None:
        assert self.block_size > 0, f"block_size must be positive, got {self.block_size}"
        assert self.num_blocks is None or self.num_blocks > 0, (
            f"num_blocks must be positive, got {self.num_blocks}"
        )


@dataclass(frozen=True)
class EngineStats:
    pool: BlockPoolStats
    num_running: int
    num_waiting: int
    num_preemptions: int
    """Sequences preempted (K/V dropped, recomputed later) since the engine started."""
    sessions: SessionStats | None = None
    """The session cache's figures (None without one)."""
    num_steps: int = 0
    """Forward passes run since the engine started."""
    num_step_seqs: int = 0
    """Sequences summed over those passes (mean batch size: num_step_seqs / num_steps)."""
    step_seconds: float = 0.0
    """Time those passes took (forward and sampling)."""
