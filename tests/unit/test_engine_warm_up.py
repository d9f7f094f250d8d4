"""The engine's warm-up pass: the real path once before serving, leaving the pool as it was."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from shoal.services.worker.engine.factory import build_paged_engine
from shoal.services.worker.engine.warm_up import CPU_WARM_UP_TOKENS, get_warm_up_lengths
from shoal.services.worker.generation import GenerationRequest
from shoal.services.worker.loader import LoadedModel, model_weight_bytes
from shoal.shared.messages import SamplingParams

MODEL = "demo/llama-5m"


def test_cuda_warms_up_at_the_token_budget_with_every_sequence() -> None:
    lengths = get_warm_up_lengths(
        on_cuda=True, max_num_batched_tokens=2048, max_num_seqs=64, pool_tokens=1 << 20, max_model_len=4096
    )
    assert lengths == [32] * 64
    uneven = get_warm_up_lengths(
        on_cuda=True, max_num_batched_tokens=100, max_num_seqs=8, pool_tokens=1 << 20, max_model_len=4096
    )
    assert uneven == [13] * 4 + [12] * 4


def test_the_pass_stays_within_the_pool_and_the_model_length() -> None:
    small_pool = get_warm_up_lengths(
        on_cuda=True, max_num_batched_tokens=2048, max_num_seqs=64, pool_tokens=48, max_model_len=48
    )
    assert small_pool == [1] * 48
    one_seq = get_warm_up_lengths(
        on_cuda=True, max_num_batched_tokens=2048, max_num_seqs=1, pool_tokens=1 << 20, max_model_len=512
    )
    assert one_seq == [512] * 4, "no sequence is longer than the model serves"


def test_the_cpu_runs_a_small_pass() -> None:
    lengths = get_warm_up_lengths(
        on_cuda=False, max_num_batched_tokens=2048, max_num_seqs=64, pool_tokens=1 << 20, max_model_len=2048
    )
    assert sum(lengths) == CPU_WARM_UP_TOKENS and len(lengths) == 2


async def test_the_factorys_engine_warms_up_and_leaves_the_pool_untouched(demo_models_root: Path) -> None:
    path = demo_models_root / MODEL
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    loaded = LoadedModel(
        model,
        tokenizer,
        torch.device("cpu"),
        torch.float32,
        model_weight_bytes(model),
        2048,
        allocation_bytes=0,
    )
    engine = build_paged_engine(loaded)
    try:
        assert engine.kernels == "cpu"
        assert engine.num_warm_up_tokens == CPU_WARM_UP_TOKENS
        stats = engine.get_stats().pool
        assert (stats.num_allocations, stats.num_frees, stats.num_peak_used_blocks) == (0, 0, 0)
        assert (stats.num_cache_misses, stats.num_cached_blocks) == (0, 0)
        assert not any(run.pool.any() for run in engine._runner.pools.runs), "the blocks the pass wrote are zeroed again"
        # and the engine then serves exactly
        prompt = [5, 17, 300, 41, 9]
        reference = AutoModelForCausalLM.from_pretrained(path).eval()
        config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            expected = reference.generate(torch.tensor([prompt]), generation_config=config)[0, 5:].tolist()
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        text = ""
        async for output in engine.generate(GenerationRequest("r", prompt, params)):
            text += output.text
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
    finally:
        await engine.close()
