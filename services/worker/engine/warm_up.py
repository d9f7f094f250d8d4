"""The engine's warm-up: one forward pass through the real path before the worker serves.

On CUDA the first forward pass at full size allocates what no later pass gives back to
the driver: cuBLAS workspaces, the caching allocator's blocks for the activation peak,
lazily loaded kernels. A worker reports its memory (`torch.cuda.memory_reserved`) when it
becomes ready, so without a warm-up the node agent measures it low, and the first request
pays the first-pass costs. The pass runs a step the scheduler plans at the token budget:
`max_num_seqs` sequences (so the logits peak is there too) sharing `max_num_batched_tokens`
prompt tokens, through `ModelRunner.prepare` / `execute` and the sampler, i.e. the ops,
attention and layouts that serve requests.

It runs while the engine is built, before its step thread starts, on a throwaway block
pool of the same size: no request can hold a block yet, the engine's pool statistics
start at zero, and the blocks the pass wrote are zeroed again afterwards.
"""

from __future__ import annotations

import torch

from shoal.services.worker.engine.batch_scheduler import BatchScheduler, BatchSchedulerConfig
from shoal.services.worker.engine.model_runner import ModelRunner
from shoal.services.worker.engine.sampler import SamplingState, sample
from shoal.services.worker.engine.sequence import Sequence
from shoal.shared.kv_cache.block_pool import BlockPool
from shoal.shared.kv_cache.manager import KVCacheManager

CPU_WARM_UP_TOKENS = 4
"""Tokens of the warm-up pass on the CPU: two sequences of two. There the full budget would
cost seconds per start on the larger demo models and would warm nothing the memory figure
depends on: a virtual GPU's memory is computed, not measured, and the native forward has no
kernels to build (the native library is loaded before, `ops.prepare`). Two prompts of two
tokens run every piece of the path a first request runs: the step's preparation, prefill
rows whose attention spans more than one position, the products, the activation buffers
(allocated for 64 rows however few the pass has), logits and sampling for two sequences.
It was 32 tokens until COLD wakes were measured (docs/benchmarks.md, "Sleep and wake"):
llama-100m's pass took 60-90 ms of a 250 ms wake, for no more code run."""
CPU_WARM_UP_SEQS = 2


def get_warm_up_lengths(
    *, on_cuda: bool, max_num_batched_tokens: int, max_num_seqs: int, pool_tokens: int, max_model_len: int
) -> list[int]:
    """Prompt lengths of the warm-up pass's sequences (their sum is the pass's tokens).

    CUDA: the token budget over `max_num_seqs` sequences; CPU: `CPU_WARM_UP_TOKENS` over
    `CPU_WARM_UP_SEQS`. Both within the pool, and no sequence longer than `max_model_len`.
    """
    if on_cuda:
        num_tokens, num_seqs = max_num_batched_tokens, max_num_seqs
    else:
        num_tokens, num_seqs = min(max_num_batched_tokens, CPU_WARM_UP_TOKENS), CPU_WARM_UP_SEQS
    num_tokens = min(num_tokens, pool_tokens)
    num_seqs = max(min(num_seqs, num_tokens), -(-num_tokens // max_model_len))
    base, extra = divmod(num_tokens, num_seqs)
    return [base + (index < extra) for index in range(num_seqs)]


def warm_up(runner: ModelRunner, num_blocks: int, lengths: list[int]) -> int:
    """Run one pass of fresh prompts of `lengths` tokens on a throwaway pool.

    Returns:
        The number of tokens the pass computed.
    """
    block_size = runner.block_size
    kv_cache = KVCacheManager(BlockPool(num_blocks, block_size), enable_prefix_caching=False)
    scheduler = BatchScheduler(BatchSchedulerConfig(len(lengths), sum(lengths)), kv_cache)
    for index, length in enumerate(lengths):
        scheduler.add(Sequence(f"warm-up-{index}", [1] * length, length, length + 1, index))
    plan = scheduler.schedule()
    step = runner.prepare(plan, kv_cache)
    logits = runner.execute(step)
    sample(logits, [SamplingState(0.0, 1.0, None) for chunk in plan.chunks if chunk.samples])
    num_used_blocks = kv_cache.pool.get_stats().num_used_blocks
    with torch.inference_mode():
        runner.pools.zero_blocks(torch.arange(num_used_blocks))  # a fresh pool hands out 0, 1, 2, ...
    for device in runner.pools.devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return plan.num_batched_tokens
