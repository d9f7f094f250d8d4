"""The paged engine's session cache on real models: every turn of a conversation, served from
KV cached on the GPU, copied back from the CPU tier, partly dropped and recomputed, or all
three at once, equals Hugging Face `generate` over the whole history, token for token.

Conversations are token ids: each turn's prompt is the previous prompt, the previous greedy
answer and a few new "user" tokens. The engine's text is its token ids (`TokenEcho`). The
session cache's counters show which path each turn took, so a test that meant to restore
from the CPU fails if the turn was served some other way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from shoal.cli.demo_models import DEMO_MODEL_KEYS
from shoal.services.worker.engine.cost_profile import measure_cost_model
from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.factory import build_paged_engine
from shoal.services.worker.engine.model_runner import ModelRunner
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.engine.session_kv import SessionSettings, SessionStats
from shoal.services.worker.generation import GenerationOutput, GenerationRequest
from shoal.services.worker.loader import LoadedModel
from shoal.shared.kv_cache.cost_model import CostModel, CostProfile
from shoal.shared.messages import SamplingParams
from shoal.shared.model_memory import get_model_shape
from tests.token_echo import TokenEcho, echo

BLOCK_SIZE = 4
CHUNK_BLOCKS = 4  # 16-token chunks
NUM_BLOCKS = 256
NUM_NEW_TOKENS = 8
# Rebuilding is dear and copying cheap: CPU chunks are copied back, never recomputed instead.
COSTS = CostModel(seconds_per_token=1e-4, seconds_per_token_pair=1e-6, swap_seconds_per_block=1e-7)


class References:
    """Greedy `generate` over whole conversations, on model instances of their own, memoized."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[str, Any] = {}
        self._completions: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def load(self, key: str) -> Any:
        return AutoModelForCausalLM.from_pretrained(self.root / key).eval()

    def greedy(self, key: str, prompt: list[int]) -> list[int]:
        memo_key = (key, tuple(prompt))
        if memo_key not in self._completions:
            if key not in self._models:
                self._models[key] = self.load(key)
            input_ids = torch.tensor([prompt])
            config = GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            with torch.inference_mode():
                output = self._models[key].generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
                )
            self._completions[memo_key] = output[0, len(prompt) :].tolist()
        return self._completions[memo_key]


@pytest.fixture(scope="module")
def references(demo_models_root: Path) -> References:
    return References(demo_models_root)


def _block_bytes(model: Any) -> int:
    return get_model_shape(model.config, next(model.parameters()).dtype).get_kv_bytes_per_block(BLOCK_SIZE)


def _engine(model: Any, settings: SessionSettings | None, **config: Any) -> PagedEngine:
    defaults: dict[str, Any] = {
        "num_blocks": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "max_num_batched_tokens": 64,
        "sessions": settings,
    }
    return PagedEngine(model, TokenEcho(), config=EngineConfig(**{**defaults, **config}))


def _settings(**overrides: Any) -> SessionSettings:
    return SessionSettings(**{"blocks_per_chunk": CHUNK_BLOCKS, "cost_model": COSTS, **overrides})


def _tokens(seed: int, length: int, vocab_size: int = 4096) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab_size, (length,), generator=generator).tolist()


async def _run(engine: PagedEngine, request_id: str, prompt: list[int], session_id: str | None) -> str:
    request = GenerationRequest(
        request_id,
        prompt,
        SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True),
        session_id=session_id,
    )
    return await _text(engine.generate(request))


async def _text(outputs: AsyncIterator[GenerationOutput]) -> str:
    text = ""
    async for output in outputs:
        text += output.text
        if output.finished:
            assert output.finish_reason == "length", output
    return text


def _sessions(engine: PagedEngine) -> SessionStats:
    stats = engine.get_stats().sessions
    assert stats is not None
    return stats


async def _converse(
    engine: PagedEngine,
    references: References,
    key: str,
    *,
    num_turns: int,
    session_id: str = "chat",
    seed: int = 0,
    first_length: int = 37,
    turn_length: int = 11,
) -> list[SessionStats]:
    """Run a conversation; every answer must equal `generate` over the whole history. Returns
    the session stats after each turn."""
    history = _tokens(seed, first_length)
    stats = []
    for turn in range(num_turns):
        expected = references.greedy(key, history)
        text = await _run(engine, f"{session_id}-{turn}", history, session_id)
        assert text == echo(expected), f"turn {turn} of {key} ({len(history)} tokens)"
        stats.append(_sessions(engine))
        history = history + expected + _tokens(seed * 100 + turn + 1, turn_length)
    return stats


def _delta(after: SessionStats, before: SessionStats, name: str) -> int:
    return int(getattr(after, name) - getattr(before, name))


# ---------------------------------------------------------------------- exactness


EVERY_TURN_CASES = [
    pytest.param(tier, key, id=f"{tier}-{key}")
    for tier in ("gpu", "cpu", "dropped", "mixed")
    for key in DEMO_MODEL_KEYS
    # The largest demo model in the case that uses all three tiers only: the two others cover
    # every tier in a fraction of its time.
    if key != "demo/llama-100m" or tier == "mixed"
]


@pytest.mark.parametrize(("tier", "key"), EVERY_TURN_CASES)
async def test_every_turn_equals_generate_from_scratch(references: References, key: str, tier: str) -> None:
    model = references.load(key)
    block_bytes = _block_bytes(model)
    settings = {
        # everything stays in the KV pool
        "gpu": _settings(),
        # nothing may stay in the pool: every chunk goes to the host pool and comes back
        "cpu": _settings(gpu_fraction=0.0, host_pool_bytes=200 * block_bytes),
        # no host pool and room for 2 chunks: the leading chunks are dropped
        "dropped": _settings(gpu_fraction=8 / NUM_BLOCKS),
        # 2 chunks on the GPU, 2 on the CPU, the rest dropped: a turn uses all three
        "mixed": _settings(gpu_fraction=8 / NUM_BLOCKS, host_pool_bytes=8 * block_bytes),
    }[tier]
    # Without the prefix cache, a demoted chunk's GPU copy cannot be found again by hash:
    # the CPU and dropped paths are what restores it.
    engine = _engine(model, settings, enable_prefix_caching=tier == "gpu")
    try:
        stats = await _converse(engine, references, key, num_turns=4)
    finally:
        await engine.close()
    first, last = stats[0], stats[-1]
    assert (first.num_hits, first.num_misses) == (0, 1)  # a first turn has nothing to reuse
    assert (last.num_hits, last.num_misses) == (3, 1)
    reused = {
        name: _delta(last, first, field)
        for name, field in (
            ("gpu", "num_gpu_reused_tokens"),
            ("cpu", "num_cpu_restored_tokens"),
            ("dropped", "num_recomputed_tokens"),
        )
    }
    if tier == "mixed":  # the last turn alone used all three tiers
        assert all(_delta(stats[-1], stats[-2], field) > 0 for field in (
            "num_gpu_reused_tokens", "num_cpu_restored_tokens", "num_recomputed_tokens"
        ))
    else:
        assert reused[tier] > 0
    expected_unused = {"gpu": ("cpu", "dropped"), "cpu": ("gpu", "dropped"), "dropped": ("cpu",), "mixed": ()}
    assert all(reused[name] == 0 for name in expected_unused[tier]), reused
    if tier == "cpu":
        assert last.swap_in_bytes == last.num_cpu_restored_tokens // BLOCK_SIZE * block_bytes
        assert last.gpu_bytes == 0 and last.cpu_bytes > 0


LAYER_BY_LAYER_CASES = [
    pytest.param(turn_length, native_forward, mode, key, id=f"{turn_id}-{forward_id}-{mode}-{key}")
    for turn_length, turn_id in ((11, "short-turn"), (90, "long-turn"))
    for native_forward, forward_id in ((True, "native"), (False, "transformers"))
    for mode in ("inline", "thread")
    for key in DEMO_MODEL_KEYS
    # The largest demo model (12 layers, 3 query heads per KV head) in the longest case only:
    # the two others cover every path in a tenth of its time.
    if key != "demo/llama-100m" or (turn_length, native_forward, mode) == (90, True, "thread")
]


@pytest.mark.parametrize(("turn_length", "native_forward", "mode", "key"), LAYER_BY_LAYER_CASES)
async def test_copies_back_layer_by_layer_equal_generate_from_scratch(
    references: References, key: str, mode: str, native_forward: bool, turn_length: int
) -> None:
    """Every chunk goes to the host pool and comes back layer by layer, each layer's copy
    waited for just before its attention. The native forward attends inside its C pass (a
    short turn with the decode kernel, a long one — 90 new tokens over a 300-token history —
    with the tiled prefill attention), so it waits for every layer first; the transformers
    forward waits layer by layer."""
    model = references.load(key)
    block_bytes = _block_bytes(model)
    settings = _settings(gpu_fraction=0.0, host_pool_bytes=400 * block_bytes, swap_in_by_layer=mode)
    engine = _engine(
        model,
        settings,
        enable_prefix_caching=False,
        native_forward=native_forward,
        max_num_batched_tokens=128,
    )
    try:
        first_length = 37 if turn_length == 11 else 300
        stats = await _converse(
            engine, references, key, num_turns=3, first_length=first_length, turn_length=turn_length
        )
    finally:
        await engine.close()
    last = stats[-1]
    assert (last.num_hits, last.num_misses) == (2, 1)
    assert last.num_cpu_restored_tokens > 0 and last.num_gpu_reused_tokens == 0
    assert last.swap_in_bytes == last.num_cpu_restored_tokens // BLOCK_SIZE * block_bytes
    assert last.exposed_swap_seconds > 0


@pytest.mark.parametrize("mode", ["inline", "thread"])
async def test_copies_back_layer_by_layer_on_the_kernels_path_over_two_pools(references: References, mode: str) -> None:
    """The CUDA engine's attention path (`device_batch`) run on the CPU, its layers' KV in
    two pools (as over two GPUs): each pool's layers come back from their slice of the host
    pool, waited for layer by layer."""
    key = DEMO_MODEL_KEYS[0]
    model = references.load(key)
    num_layers = model.config.num_hidden_layers
    labels = tuple("cpu:0" if layer < num_layers // 2 else "cpu:1" for layer in range(num_layers))
    settings = _settings(gpu_fraction=0.0, host_pool_bytes=200 * _block_bytes(model), swap_in_by_layer=mode)
    engine = _engine(model, settings, enable_prefix_caching=False, kernels_path=True, kv_layer_devices=labels)
    try:
        stats = await _converse(engine, references, key, num_turns=3)
    finally:
        await engine.close()
    assert stats[-1].num_hits == 2 and stats[-1].num_cpu_restored_tokens > 0


async def test_a_hole_longer_than_the_token_budget_is_filled_over_several_steps(references: References) -> None:
    key = "demo/llama-5m"
    engine = _engine(
        references.load(key), _settings(gpu_fraction=4 / NUM_BLOCKS), enable_prefix_caching=False, max_num_batched_tokens=12, max_num_seqs=4
    )
    try:
        stats = await _converse(engine, references, key, num_turns=4)
    finally:
        await engine.close()
    assert stats[-1].num_recomputed_tokens - stats[-2].num_recomputed_tokens > 12


async def test_an_edited_history_reuses_only_the_matching_prefix(references: References) -> None:
    key = "demo/qwen2-25m"
    engine = _engine(references.load(key), _settings())
    try:
        history = _tokens(1, 40)
        answer = references.greedy(key, history)
        assert await _run(engine, "t1", history, "s") == echo(answer)
        # The client changed token 21 of its first message: blocks 0-4 (tokens 0-19) still
        # match, nothing after.
        edited = [*history[:21], history[21] + 1, *history[22:], *answer, 9, 10, 11]
        before = _sessions(engine)
        assert await _run(engine, "t2", edited, "s") == echo(references.greedy(key, edited))
        after = _sessions(engine)
        assert _delta(after, before, "num_gpu_reused_tokens") == 20
        assert _delta(after, before, "num_new_tokens") == len(edited) - 20
        # A history whose first turn was cut off (a context cap) matches nothing at all.
        cut = edited[16:]
        assert await _run(engine, "t3", cut, "s") == echo(references.greedy(key, cut))
        assert _sessions(engine).num_misses == before.num_misses + 1
    finally:
        await engine.close()


async def test_a_copied_out_chunk_still_in_the_prefix_cache_is_taken_back_not_copied(
    references: References,
) -> None:
    key = "demo/llama-5m"
    model = references.load(key)
    engine = _engine(model, _settings(gpu_fraction=0.0, host_pool_bytes=200 * _block_bytes(model)))
    try:
        stats = await _converse(engine, references, key, num_turns=3)
    finally:
        await engine.close()
    # The demoted blocks' GPU copies sat cached-free, untouched in a roomy pool.
    assert stats[-1].num_prefix_cached_tokens > 0
    assert stats[-1].num_cpu_restored_tokens == 0 and stats[-1].swap_in_bytes == 0


async def test_cached_sessions_give_way_to_running_requests(references: References) -> None:
    key = "demo/llama-5m"
    model = references.load(key)
    # 40 blocks = 160 tokens: two sessions' KV fill most of it.
    engine = _engine(model, _settings(host_pool_bytes=40 * _block_bytes(model)), num_blocks=40)
    try:
        await _converse(engine, references, key, num_turns=2, session_id="a", seed=1)
        await _converse(engine, references, key, num_turns=2, session_id="b", seed=2)
        assert _sessions(engine).gpu_bytes > 20 * _block_bytes(model)
        prompts = [_tokens(10 + index, 70) for index in range(2)]
        texts = await asyncio.gather(*(_run(engine, f"p{index}", prompt, None) for index, prompt in enumerate(prompts)))
        assert list(texts) == [echo(references.greedy(key, prompt)) for prompt in prompts]
        stats = engine.get_stats()
        assert stats.num_preemptions == 0  # the sessions' blocks were reclaimed instead
        assert stats.sessions is not None and stats.sessions.num_demoted_chunks > 0
        assert engine.num_free_slots() > 0
        # Both sessions go on, exactly, from what is left of them.
        await _converse(engine, references, key, num_turns=3, session_id="a", seed=1)
    finally:
        await engine.close()


async def test_two_turns_of_one_session_at_once_are_both_exact(references: References) -> None:
    key = "demo/llama-5m"
    engine = _engine(references.load(key), _settings())
    try:
        first = _tokens(3, 30)
        answer = references.greedy(key, first)
        assert await _run(engine, "t1", first, "s") == echo(answer)
        prompts = [[*first, *answer, 7, 8], [*first, *answer, 9]]
        texts = await asyncio.gather(*(_run(engine, f"t2-{i}", prompt, "s") for i, prompt in enumerate(prompts)))
        assert list(texts) == [echo(references.greedy(key, prompt)) for prompt in prompts]
        assert [info.session_id for info in engine.list_sessions()] == ["s"]
    finally:
        await engine.close()


async def test_sessions_expire_list_and_drop(references: References) -> None:
    key = "demo/llama-5m"
    now = [0.0]
    model = references.load(key)
    engine = PagedEngine(
        model,
        TokenEcho(),
        config=EngineConfig(
            num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, sessions=_settings(idle_timeout_s=60.0)
        ),
        session_clock=lambda: now[0],
    )
    try:
        await _run(engine, "a1", _tokens(4, 20), "a")
        now[0] = 30.0
        await _run(engine, "b1", _tokens(5, 20), "b")
        sessions = engine.list_sessions()
        assert [(info.session_id, info.last_active) for info in sessions] == [("a", 0.0), ("b", 30.0)]
        assert sessions[0].num_blocks == 27 // BLOCK_SIZE  # 20 + 8 tokens, the last one not computed
        used = engine.get_stats().pool.num_used_blocks
        now[0] = 61.0
        assert [info.session_id for info in engine.list_sessions()] == ["b"]
        stats = engine.get_stats()
        assert stats.sessions is not None and stats.sessions.num_expired_sessions == 1
        assert stats.pool.num_used_blocks == used - 27 // BLOCK_SIZE
        assert engine.drop_session("b") and not engine.drop_session("b")
        assert engine.list_sessions() == [] and engine.get_stats().pool.num_used_blocks == 0
        assert engine.get_active_session_ids() == set()
    finally:
        await engine.close()


async def test_a_cancelled_turn_keeps_what_it_computed(references: References) -> None:
    key = "demo/llama-5m"
    engine = _engine(references.load(key), _settings())
    try:
        prompt = _tokens(6, 33)
        request = GenerationRequest("long", prompt, SamplingParams(max_tokens=10_000, temperature=0.0), session_id="s")
        stream = engine.generate(request)
        generated = 0
        while generated < 5:
            generated += (await anext(stream)).num_new_tokens
        assert engine.get_active_session_ids() == {"s"}
        await stream.aclose()  # the client went away
        assert [info.session_id for info in engine.list_sessions()] == ["s"]
        answer = references.greedy(key, prompt)
        follow_up = [*prompt, *answer[:4], 12, 13]
        before = _sessions(engine)
        assert await _run(engine, "next", follow_up, "s") == echo(references.greedy(key, follow_up))
        assert _delta(_sessions(engine), before, "num_gpu_reused_tokens") >= 32
    finally:
        await engine.close()


async def test_without_a_session_cache_a_session_id_changes_nothing(references: References) -> None:
    key = "demo/llama-5m"
    engine = _engine(references.load(key), None)
    try:
        prompt = _tokens(7, 25)
        assert await _run(engine, "t", prompt, "s") == echo(references.greedy(key, prompt))
        assert engine.get_stats().sessions is None and engine.list_sessions() == []
        assert not engine.drop_session("s")
        assert engine.get_stats().pool.num_used_blocks == 0
    finally:
        await engine.close()


async def test_a_shared_system_prompt_is_shared_across_sessions_by_the_prefix_cache(references: References) -> None:
    key = "demo/llama-5m"
    engine = _engine(references.load(key), _settings())
    try:
        system = _tokens(8, 32)
        for index, session_id in enumerate(("a", "b")):
            prompt = [*system, *_tokens(20 + index, 9)]
            assert await _run(engine, session_id, prompt, session_id) == echo(references.greedy(key, prompt))
        # b's first turn reused a's 8 system-prompt blocks, which a's session holds; both
        # sessions now hold the same 8 physical blocks.
        assert engine.get_stats().pool.num_cache_hits == 8
        a, b = engine.list_sessions()
        assert a.num_gpu_blocks == b.num_gpu_blocks == (32 + 9 + NUM_NEW_TOKENS - 1) // BLOCK_SIZE
        assert engine.get_stats().pool.num_used_blocks == 2 * a.num_gpu_blocks - 8
        prompt = [*system, *_tokens(21, 9)]
        prompt += [*references.greedy(key, prompt), 5, 6, 7]
        before = _sessions(engine)
        assert await _run(engine, "b2", prompt, "b") == echo(references.greedy(key, prompt))
        assert _delta(_sessions(engine), before, "num_gpu_reused_tokens") == 48
    finally:
        await engine.close()


# ---------------------------------------------------------------------- the cost model


def test_the_cost_model_is_measured_on_the_served_model(references: References) -> None:
    model = references.load("demo/llama-5m")
    runner = ModelRunner(model, num_blocks=128, block_size=16, num_host_blocks=64)
    profile = measure_cost_model(
        runner, 128, key="k", chunk_tokens=64, max_pass_tokens=256, max_context_tokens=1024, num_repeats=2
    )
    costs = profile.cost_model
    assert profile.num_samples == 6 + 3  # 2 pass sizes x 3 contexts, 3 batched copies
    assert costs.seconds_per_token > 0 or costs.seconds_per_token_pair > 0
    # Linear in the context, more for later chunks.
    assert costs.get_rebuild_seconds(64, 960) >= costs.get_rebuild_seconds(64, 0) > 0
    assert costs.swap_seconds_per_block > 0 or costs.swap_seconds_per_call > 0
    assert all(float(run.pool.abs().sum()) == 0.0 for run in runner.pools.runs)  # the pool is left as it was


async def test_a_saved_cost_profile_is_used_and_a_stale_one_replaced(references: References, tmp_path: Path) -> None:
    key = "demo/llama-5m"
    path = tmp_path / "profiles" / "llama.json"
    path.parent.mkdir()
    path.write_bytes(CostProfile("another model", COSTS).to_json())
    engine = _engine(references.load(key), SessionSettings(cost_profile_path=str(path)), num_blocks=64)
    await engine.close()
    measured = engine.cost_profile
    assert measured is not None and measured.key != "another model" and measured.num_samples > 0
    assert CostProfile.from_json(path.read_bytes()) == measured
    engine = _engine(references.load(key), SessionSettings(cost_profile_path=str(path)), num_blocks=64)
    await engine.close()
    assert engine.cost_profile == measured


async def test_the_workers_factory_passes_the_session_settings_through(references: References) -> None:
    model = references.load("demo/llama-5m")
    block_bytes = get_model_shape(model.config, torch.float32).get_kv_bytes_per_block(16)
    weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    loaded = LoadedModel(model, TokenEcho(), torch.device("cpu"), torch.float32, weight_bytes, 2048, allocation_bytes=0)
    engine = build_paged_engine(
        loaded, sessions=SessionSettings(host_pool_bytes=10 * block_bytes + 5, cost_model=COSTS)
    )
    try:
        stats = engine.get_stats().sessions
        assert stats is not None and stats.host_pool_bytes == 10 * block_bytes
        assert engine.cost_profile is not None and engine.cost_profile.cost_model == COSTS
    finally:
        await engine.close()
