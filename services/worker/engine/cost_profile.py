"""Measures what prefills and swaps of the served model cost on this device: the session
cache's cost model (`shoal.shared.kv_cache.cost_model`).

At engine start (or never, with a saved profile whose key matches), the runner times real
forward passes: chunks of `n` new tokens after `ctx` tokens already in the pool, for a few
`n` and `ctx` spread over the serving range, each the least of a few runs (taken round
robin over the shapes, after one untimed run of each); then batched copies of `k` blocks from the host pool back into the
KV pool. Least squares with non-negative coefficients turns them into the model's constants.
The K/V values the passes read are whatever the pool holds (timings do not depend on them);
the blocks written are zeroed afterwards, as after the warm-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from shoal.services.worker.engine.batch_scheduler import ScheduledChunk, StepPlan
from shoal.services.worker.engine.model_runner import ModelRunner
from shoal.services.worker.engine.sequence import Sequence
from shoal.services.worker.engine.session_kv import SessionSettings
from shoal.shared.kv_cache.block_pool import BlockPool
from shoal.shared.kv_cache.cost_model import (
    CostModel,
    CostProfile,
    PrefillSample,
    SwapSample,
    fit_prefill_costs,
    fit_swap_costs,
)
from shoal.shared.kv_cache.manager import KVCacheManager

log = structlog.get_logger(__name__)


def get_profile_key(model_config: Any, dtype: torch.dtype, device: torch.device, block_size: int) -> str:
    """What a profile's timings depend on: a saved profile is reused only for an equal key."""
    num_kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    return (
        f"{model_config.model_type}:layers={model_config.num_hidden_layers}:hidden={model_config.hidden_size}:"
        f"intermediate={getattr(model_config, 'intermediate_size', 0)}:heads={model_config.num_attention_heads}:"
        f"kv_heads={num_kv_heads}:vocab={model_config.vocab_size}:dtype={str(dtype).removeprefix('torch.')}:"
        f"device={device.type}:block_size={block_size}"
    )


def get_cost_profile(
    runner: ModelRunner,
    num_blocks: int,
    settings: SessionSettings,
    *,
    key: str,
    max_pass_tokens: int,
    max_context_tokens: int,
) -> CostProfile:
    """The session cache's cost model: the one given, the saved profile when its key
    matches, or measured now (and saved, when `settings.cost_profile_path` is set).

    A profile that cannot be read or saved is logged and measured anew: never fatal.
    """
    if settings.cost_model is not None:
        return CostProfile(key, settings.cost_model)
    path = Path(settings.cost_profile_path) if settings.cost_profile_path else None
    if path is not None and path.exists():
        try:
            profile = CostProfile.from_json(path.read_bytes())
        except (OSError, ValueError) as error:
            log.warning("engine.cost_profile_unreadable", path=str(path), error=str(error))
        else:
            if profile.key == key:
                log.info("engine.cost_profile_loaded", path=str(path), **_cost_fields(profile.cost_model))
                return profile
            log.info("engine.cost_profile_stale", path=str(path), saved_key=profile.key, key=key)
    started = time.perf_counter()
    profile = measure_cost_model(
        runner,
        num_blocks,
        key=key,
        chunk_tokens=settings.blocks_per_chunk * runner.block_size,
        max_pass_tokens=max_pass_tokens,
        max_context_tokens=max_context_tokens,
    )
    log.info(
        "engine.cost_profile_measured",
        seconds=round(time.perf_counter() - started, 3),
        num_samples=profile.num_samples,
        **_cost_fields(profile.cost_model),
    )
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(profile.to_json())
        except OSError as error:
            log.warning("engine.cost_profile_not_saved", path=str(path), error=str(error))
    return profile


PROFILE_MAX_CONTEXT_TOKENS = 1024
"""The longest context timed. The fit is linear in context (per token pair), so longer ones
add start time (minutes for a 100M model on a busy CPU at 2K) and little accuracy."""
PROFILE_REPEATS = 2
"""Timed runs of each shape (after an untimed one); the least counts."""


def get_prefill_points(chunk_tokens: int, max_pass_tokens: int, max_context_tokens: int) -> list[tuple[int, int]]:
    """(new tokens, context tokens) of the timed passes: one and four chunks, at three contexts
    up to `PROFILE_MAX_CONTEXT_TOKENS`."""
    points: list[tuple[int, int]] = []
    max_context_tokens = min(max_context_tokens, PROFILE_MAX_CONTEXT_TOKENS)
    for num_tokens in sorted({max(1, min(chunk_tokens, max_pass_tokens)), max(1, min(4 * chunk_tokens, max_pass_tokens))}):
        top = max(0, max_context_tokens - num_tokens)
        for context in sorted({0, top // 2, top}):
            points.append((num_tokens, context))
    if len(points) < 3:
        # A pool of a block or two (the least an allocation may leave) has room for one pass
        # shape only: time shorter passes too, so the three constants can still be fitted.
        for num_tokens in sorted({1, max(1, max_pass_tokens // 2)}):
            top = max(0, max_context_tokens - num_tokens)
            points.extend(point for point in ((num_tokens, 0), (num_tokens, top)) if point not in points)
    return points


def measure_cost_model(
    runner: ModelRunner,
    num_blocks: int,
    *,
    key: str,
    chunk_tokens: int,
    max_pass_tokens: int,
    max_context_tokens: int,
    num_repeats: int = PROFILE_REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> CostProfile:
    """Time prefills (and, with a host pool, swaps) of the runner's model; fit a cost model.

    Args:
        num_blocks: blocks of the runner's KV pool (the passes use a throwaway block table).
        chunk_tokens: tokens of one session chunk (the unit a rebuild is priced in).
        max_pass_tokens: the most tokens one pass may compute (the engine's token budget).
        max_context_tokens: the longest context to time (at most the pool and the model).
    """
    block_size = runner.block_size
    pool_tokens = num_blocks * block_size
    max_context_tokens = max(1, min(max_context_tokens, pool_tokens))
    max_pass_tokens = max(1, min(max_pass_tokens, max_context_tokens))
    num_used_blocks = 0
    steps = []
    for index, (num_tokens, context) in enumerate(get_prefill_points(chunk_tokens, max_pass_tokens, max_context_tokens)):
        manager = KVCacheManager(BlockPool(num_blocks, block_size), enable_prefix_caching=False)
        seq_id = f"cost-profile-{index}"
        seq = Sequence(seq_id, [1] * (context + num_tokens), context + num_tokens, context + num_tokens + 1, 0)
        manager.start_sequence(seq_id, [])
        allocated = manager.try_allocate_slots(seq_id, 0, context + num_tokens)
        assert allocated, "a timed pass fits the pool"
        num_used_blocks = max(num_used_blocks, len(manager.get_block_ids(seq_id)))
        plan = StepPlan([ScheduledChunk(seq, context, num_tokens, samples=True)], [], [], num_tokens)
        steps.append((num_tokens, context, runner.prepare(plan, manager)))
    # Round robin over the shapes, the least of each shape's runs: other work on the machine
    # only ever adds time, and comes in bursts that round robin spreads over the shapes.
    timings: list[list[float]] = [[] for _ in steps]
    for repeat in range(num_repeats + 1):
        for index, (_, _, step) in enumerate(steps):
            started = clock()
            runner.execute(step)
            _synchronize(runner.device)
            if repeat:  # the first run of a shape builds kernels and caches
                timings[index].append(clock() - started)
    samples = [
        PrefillSample(num_tokens, context, min(times))
        for (num_tokens, context, _), times in zip(steps, timings, strict=True)
    ]
    per_pass, per_token, per_pair = fit_prefill_costs(samples)
    per_call = per_block = 0.0
    num_samples = len(samples)
    written = torch.arange(num_used_blocks)
    if runner.host_cache is not None:
        swap_samples, swapped = _time_swaps(runner, num_blocks, max(1, chunk_tokens // block_size), num_repeats, clock)
        per_call, per_block = fit_swap_costs(swap_samples)
        num_samples += len(swap_samples)
        written = torch.cat([written, swapped])
    with torch.inference_mode():  # a fresh pool holds nothing: leave it as it was, zeros
        runner.pools.zero_blocks(written)
    _synchronize(runner.device)
    cost_model = CostModel(
        seconds_per_token=per_token,
        seconds_per_token_pair=per_pair,
        seconds_per_pass=per_pass,
        swap_seconds_per_block=per_block,
        swap_seconds_per_call=per_call,
    )
    return CostProfile(key, cost_model, num_samples)


def _time_swaps(
    runner: ModelRunner, num_blocks: int, blocks_per_chunk: int, num_repeats: int, clock: Callable[[], float]
) -> tuple[list[SwapSample], torch.Tensor]:
    """Batched copies host -> KV pool of 1, 4 and 16 chunks' blocks (scattered, as in use).

    Returns:
        The timed copies, and the pool blocks they wrote.
    """
    assert runner.host_cache is not None
    num_host_blocks = runner.host_cache.shape[2]
    generator = torch.Generator().manual_seed(0)
    samples = []
    written = []
    for num_chunks in (1, 4, 16):
        count = min(num_chunks * blocks_per_chunk, num_blocks, num_host_blocks)
        pairs = torch.stack(
            [
                torch.randperm(num_host_blocks, generator=generator)[:count],
                torch.randperm(num_blocks, generator=generator)[:count],
            ],
            dim=1,
        )
        timings = []
        for repeat in range(num_repeats + 1):
            started = clock()
            runner.pools.swap_in(runner.host_cache, pairs)
            _synchronize(runner.device)
            if repeat:
                timings.append(clock() - started)
        samples.append(SwapSample(count, min(timings)))
        written.append(pairs[:, 1])
    return samples, torch.cat(written)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cost_fields(cost_model: CostModel) -> dict[str, float]:
    return {
        "seconds_per_token": cost_model.seconds_per_token,
        "seconds_per_token_pair": cost_model.seconds_per_token_pair,
        "seconds_per_pass": cost_model.seconds_per_pass,
        "swap_seconds_per_block": cost_model.swap_seconds_per_block,
    }
