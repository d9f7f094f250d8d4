"""The worker engine's KV cache policy (seed 003): which block holds whose tokens.

Pure bookkeeping over block ids: no torch tensors, no locks, no I/O. The engine
(`shoal.services.worker.engine`) owns the tensors the ids index.

    block_pool.py  fixed-size blocks: free list, reference counts, prefix-cache LRU;
                   a block is freed in `BlockPool.free`
    manager.py     per-sequence block tables over the pool: growth, prefix reuse,
                   fork and copy-on-write
"""

from shoal.shared.kv_cache.block_pool import BlockHash, BlockPool, BlockPoolStats
from shoal.shared.kv_cache.manager import KVCacheManager

__all__ = ["BlockHash", "BlockPool", "BlockPoolStats", "KVCacheManager"]
