"""The worker engine's KV cache policies (seeds 003 and 004): which block holds whose tokens.

Pure bookkeeping over block ids: no torch tensors, no locks, no I/O. The engine
(`shoal.services.worker.engine`) owns the tensors the ids index.

    block_pool.py       fixed-size blocks: free list, reference counts, prefix-cache LRU;
                        a block is freed in `BlockPool.free`
    manager.py          per-sequence block tables over the pool: growth, prefix reuse,
                        fork and copy-on-write
    session_cache.py    chat sessions' KV between turns across GPU, CPU and dropped tiers
                        (Pensieve): budgets, eviction by retention value, copy-ahead
    session_types.py    its settings, actions, restore plans and figures
    retention_index.py  sessions ordered by the retention value of their next victim
    host_pool.py        block ids of the CPU tier
    cost_model.py       what rebuilding or copying back KV costs, fitted by measurement
"""

from shoal.shared.kv_cache.block_pool import BlockHash, BlockPool, BlockPoolStats
from shoal.shared.kv_cache.cost_model import CostModel, CostProfile
from shoal.shared.kv_cache.manager import KVCacheManager
from shoal.shared.kv_cache.session_cache import (
    SessionActions,
    SessionCache,
    SessionCacheConfig,
    SessionCacheStats,
    SessionInfo,
    Tier,
)

__all__ = [
    "BlockHash",
    "BlockPool",
    "BlockPoolStats",
    "CostModel",
    "CostProfile",
    "KVCacheManager",
    "SessionActions",
    "SessionCache",
    "SessionCacheConfig",
    "SessionCacheStats",
    "SessionInfo",
    "Tier",
]
