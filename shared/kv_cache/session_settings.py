"""The session cache's settings, declared once: the engine takes them (`EngineConfig.sessions`)
and the worker's configuration nests them (``[worker.sessions]``, `shoal.shared.config.SessionConfig`).

A msgspec Struct, so shoal.toml, environment overrides and the worker's launch message
decode into it and validate it like every other setting. Pure: no torch.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shoal.shared.kv_cache.cost_model import CostModel

SwapInByLayer = Literal["auto", "off", "inline", "thread"]


class SessionSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's session cache (`EngineConfig.sessions`; None there: no session cache)."""

    host_pool_bytes: int = 0
    """Bytes of the CPU tier (the host pool; pinned memory on CUDA); 0: GPU tier only."""
    blocks_per_chunk: int = 4
    """KV blocks per (session, chunk): the unit moved to the CPU tier or dropped."""
    gpu_fraction: float = 1.0
    """Most of the KV pool cached sessions may hold; running requests reclaim it anyway."""
    idle_timeout_s: float = 600.0
    """A session idle this long is forgotten."""
    min_idle_s: float = 1.0
    """Retention values divide by idle time + this (docs/sessions.md)."""
    copy_ahead_free_fraction: float = 0.05
    """Copy GPU chunks to the CPU tier ahead of eviction while less than this fraction of
    the KV pool is free (0: never)."""
    swap_in_by_layer: SwapInByLayer = "auto"
    """How a returning turn's CPU chunks come back (docs/sessions.md, "Layer by layer"):
    "off": every layer in one copy before the pass; "inline": each layer's copy just before
    its attention, on the pass's thread (the split, no overlap); "thread": each layer's
    copy started at once, on a side stream (CUDA) or a helper thread (CPU), and waited for
    just before the layer's attention; "auto": "thread" on CUDA, "off" on the CPU (where
    the other two measured no better, docs/benchmarks.md)."""
    cost_profile_path: str | None = None
    """A saved cost profile (JSON): used when its key matches the served model and device,
    else the cost model is measured at start and saved there."""
    cost_model: CostModel | None = None
    """A cost model to use as is (tests, simulations); None: the profile, or measure."""

    def __post_init__(self) -> None:
        if self.host_pool_bytes < 0:
            raise ValueError(f"sessions.host_pool_bytes must be >= 0, got {self.host_pool_bytes}")
        if self.blocks_per_chunk <= 0:
            raise ValueError(f"sessions.blocks_per_chunk must be positive, got {self.blocks_per_chunk}")
        if not 0.0 <= self.gpu_fraction <= 1.0 or not 0.0 <= self.copy_ahead_free_fraction <= 1.0:
            raise ValueError("sessions.gpu_fraction and copy_ahead_free_fraction must be within [0, 1]")
        if not self.idle_timeout_s > 0 or not self.min_idle_s > 0:
            raise ValueError("sessions.idle_timeout_s and min_idle_s must be positive")
