"""What the session cache policy (`session_cache.py`) takes and gives: its settings, the
actions it asks of the caller, restore plans, and its figures. Pure data."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Tier(enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    DROPPED = "dropped"


@dataclass(frozen=True)
class SessionCacheConfig:
    block_size: int
    """Tokens per KV block."""
    blocks_per_chunk: int = 4
    """Blocks per (session, chunk) entry: the unit of demotion and dropping."""
    gpu_budget_blocks: int = 0
    """Most KV pool blocks cached sessions may hold (the engine also reclaims them when
    running requests need the blocks)."""
    cpu_budget_blocks: int = 0
    """Blocks of the host pool (the CPU tier); 0: no CPU tier."""
    idle_timeout_s: float = 600.0
    """A session not active for this long is forgotten."""
    min_idle_s: float = 1.0
    """Added to every idle time in retention values: a session active now is worth its
    cost / min_idle_s (see `RetentionIndex`)."""
    copy_ahead_free_blocks: int = 0
    """While fewer KV pool blocks than this are free, GPU chunks next in eviction order are
    copied to free host blocks ahead of time; 0: never."""
    bucket_ratio: float = 2 ** (1 / 16)
    """The eviction index's cost buckets (see `RetentionIndex`)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.blocks_per_chunk <= 0:
            raise ValueError(
                f"block_size and blocks_per_chunk must be positive, got {self.block_size}, {self.blocks_per_chunk}"
            )
        if self.gpu_budget_blocks < 0 or self.cpu_budget_blocks < 0 or self.copy_ahead_free_blocks < 0:
            raise ValueError("block budgets and copy_ahead_free_blocks must be >= 0")
        if not self.idle_timeout_s > 0 or not self.min_idle_s > 0:
            raise ValueError(
                f"idle_timeout_s and min_idle_s must be positive, got {self.idle_timeout_s}, {self.min_idle_s}"
            )


@dataclass
class SessionActions:
    """What the caller must do after a policy call, in this order."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(GPU block, host block) pairs to copy before any GPU block of `freed_gpu_block_ids`
    is written again (i.e. before the next forward pass)."""
    freed_gpu_block_ids: list[int] = field(default_factory=list)
    """KV pool block references the cache gave up: free them in the block pool."""
    removed_session_ids: list[str] = field(default_factory=list)
    """Sessions that left the cache (expired, dropped, or every chunk dropped)."""

    def extend(self, other: SessionActions) -> None:
        self.swap_out += other.swap_out
        self.freed_gpu_block_ids += other.freed_gpu_block_ids
        self.removed_session_ids += other.removed_session_ids


@dataclass(frozen=True)
class RestorePlan:
    """How a returning session's first `num_blocks` blocks come back (in block order)."""

    num_blocks: int
    num_dropped_blocks: int
    """Leading blocks to recompute (dropped, or cheaper to recompute than to copy back)."""
    num_host_blocks: int
    """Next, blocks copied back from the host pool."""
    num_gpu_blocks: int
    """Last, blocks still in the KV pool, reused in place."""


@dataclass(frozen=True)
class SessionRestore:
    """A checked-out session's blocks (see `SessionCache.check_out`)."""

    plan: RestorePlan
    host_block_ids: list[int]
    """Host blocks of blocks [num_dropped_blocks, + num_host_blocks): copy them into new KV
    pool blocks in this step (they are freed after it)."""
    gpu_block_ids: list[int]
    """KV pool blocks of the last num_gpu_blocks blocks: the cache's references pass to the
    caller."""
    freed_gpu_block_ids: list[int]
    """References to blocks past `num_blocks` the cache gave up: free them."""


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    num_blocks: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_dropped_blocks: int
    last_active: float


@dataclass(frozen=True)
class SessionCacheStats:
    num_sessions: int
    num_gpu_blocks: int
    """KV pool blocks held by cached sessions."""
    num_cpu_blocks: int
    """Host blocks holding CPU-tier chunks."""
    num_copied_ahead_blocks: int
    """Host blocks holding copies of GPU chunks (copied ahead)."""
    num_dropped_blocks: int
    """Blocks of cached sessions that are dropped (hold no memory)."""
    num_host_blocks: int
    """Size of the host pool."""
    num_demoted_chunks: int
    num_dropped_chunks: int
    num_swapped_out_blocks: int
    """Blocks copied GPU -> CPU, copies ahead included."""
    num_expired_sessions: int
