"""Park and restore on a real GPU, measured with NVML as the node agent measures them: what a
parked worker keeps (its CUDA context, docs/operations.md), that a restored one serves
exactly, and that a restore which would strand the context elsewhere is refused. Skipped
without CUDA (the refusal and the hook removal are also tested on the CPU,
tests/unit/test_loader.py)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from shoal.services.node_agent.gpus import nvml_process_bytes
from shoal.services.worker.engine.factory import build_paged_engine
from shoal.services.worker.generation import GenerationRequest
from shoal.services.worker.loader import (
    ModelLoadError,
    detach_dispatch,
    load_model,
    park_weights,
    restore_weights,
    resume_engine,
)
from shoal.shared.messages import ModelSpec, ReplicaRecord, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODEL = "demo/llama-100m"
NUM_NEW_TOKENS = 8
MAX_CONTEXT_BYTES = 1 << 30
"""A CUDA context with torch's lazily loaded modules stays well under this (measured figures
are printed by the test; none is recorded here without a GPU)."""


def _replica(gpu_bytes: dict[int, int]) -> ReplicaRecord:
    return ReplicaRecord(replica_id="r", model=MODEL, node_id="n", gpu_bytes=gpu_bytes)


def _greedy_reference(root: Path, prompt: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(root / MODEL, dtype=torch.float32).to("cuda").eval()
    input_ids = torch.tensor([prompt], device="cuda")
    config = GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return output[0, len(prompt) :].tolist()


async def test_a_parked_worker_keeps_only_its_context_and_serves_again_after_a_restore(
    demo_models_root: Path,
) -> None:
    pid = os.getpid()
    prompt = list(range(20, 60))
    expected = _greedy_reference(demo_models_root, prompt)
    replica = _replica({0: 4 << 30})
    loaded = load_model(demo_models_root, ModelSpec(key=MODEL, path=MODEL), replica, device=torch.device("cuda"))
    engine = build_paged_engine(loaded)
    serving = nvml_process_bytes(pid, [0])
    assert serving is not None, "NVML must be readable on a GPU machine"
    text_before = [o.text async for o in engine.generate(GenerationRequest(
        "a", prompt, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)))]
    await engine.close()
    del engine
    gc.collect()

    park_weights(loaded, replica)
    residual = nvml_process_bytes(pid, [0])
    print(f"NVML: serving {serving / 2**20:.0f} MiB, parked {residual and residual / 2**20:.0f} MiB "
          f"({torch.cuda.get_device_name(0)})")
    assert residual is not None and 0 < residual < serving
    assert residual < MAX_CONTEXT_BYTES, "only the context stays: weights, KV pool and cached blocks are gone"
    assert torch.cuda.memory_reserved(0) == 0
    assert all(p.device.type == "cpu" for p in loaded.model.parameters())
    assert all(p.is_pinned() for p in loaded.model.parameters()), "parked in page-locked memory (DMA on wake)"

    if torch.cuda.device_count() >= 2:
        with pytest.raises(ModelLoadError, match="CUDA context lives on GPU"):
            restore_weights(loaded, _replica({1: 4 << 30}))
    restore_weights(loaded, replica)
    engine = build_paged_engine(loaded)
    try:
        text_after = [o.text async for o in engine.generate(GenerationRequest(
            "b", prompt, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)))]
        assert "".join(text_after) == "".join(text_before)
        assert loaded.tokenizer.decode(expected, skip_special_tokens=True) == "".join(text_after)
    finally:
        await engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_model_dispatched_over_two_gpus_parks_without_hooks_and_restores_over_both(
    demo_models_root: Path,
) -> None:
    weights = 100 << 20  # llama-100m's float32 weights are ~400 MiB: GPU 0 takes only part of them
    replica = _replica({0: weights, 1: 4 << 30})
    loaded = load_model(demo_models_root, ModelSpec(key=MODEL, path=MODEL), replica, device=torch.device("cuda"))
    assert {p.device.index for p in loaded.model.parameters()} == {0, 1}
    input_ids = torch.tensor([[5, 6, 7, 8]], device="cuda:0")
    with torch.inference_mode():
        before = loaded.model(input_ids).logits.cpu()
    park_weights(loaded, replica)
    assert not [n for n, m in loaded.model.named_modules() if hasattr(m, "_hf_hook")]
    assert {p.device.type for p in loaded.model.parameters()} == {"cpu"}
    restore_weights(loaded, replica)
    assert {p.device.index for p in loaded.model.parameters()} == {0, 1}
    with torch.inference_mode():
        after = loaded.model(input_ids).logits.cpu()
    torch.testing.assert_close(after, before)
    detach_dispatch(loaded.model)


async def test_a_cold_sleep_drops_the_weights_and_a_wake_reloads_them_onto_the_gpu(demo_models_root: Path) -> None:
    """`weight_drop` on CUDA: the parameters' storage is released (neither GPU nor host memory
    holds the weights), the wake reads them from the model's file, and the replica answers as
    before."""
    from shoal.services.worker.weight_drop import drop_weights, reload_weights

    pid = os.getpid()
    prompt = list(range(20, 60))
    replica = _replica({0: 4 << 30})
    loaded = load_model(demo_models_root, ModelSpec(key=MODEL, path=MODEL), replica, device=torch.device("cuda"))
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    engine = build_paged_engine(loaded)
    text_before = "".join([o.text async for o in engine.generate(GenerationRequest("a", prompt, params))])
    await engine.close()
    del engine
    gc.collect()

    dropped = drop_weights(loaded)
    park_weights(loaded, replica)
    residual = nvml_process_bytes(pid, [0])
    assert residual is not None and residual < MAX_CONTEXT_BYTES
    assert sum(p.numel() for p in loaded.model.parameters()) == 0, "no copy of the weights is kept anywhere"

    reload_weights(loaded, dropped)
    restore_weights(loaded, replica)
    assert all(p.device.type == "cuda" for p in loaded.model.parameters())
    engine = build_paged_engine(loaded)
    try:
        text_after = "".join([o.text async for o in engine.generate(GenerationRequest("b", prompt, params))])
        assert text_after == text_before
    finally:
        await engine.close()


async def test_an_engine_kept_across_the_sleep_frees_its_pool_and_serves_exactly_after_resume(
    demo_models_root: Path,
) -> None:
    """What a worker's park and wake onto the same allocation do (`ReplicaRuntime`): the engine
    suspended (its KV pool dropped), the weights parked, then restored and the engine resumed."""
    prompt = list(range(20, 60))
    expected = _greedy_reference(demo_models_root, prompt)
    replica = _replica({0: 4 << 30})
    loaded = load_model(demo_models_root, ModelSpec(key=MODEL, path=MODEL), replica, device=torch.device("cuda"))
    engine = build_paged_engine(loaded)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        before = "".join([o.text async for o in engine.generate(GenerationRequest("a", prompt, params))])
        assert before == loaded.tokenizer.decode(expected, skip_special_tokens=True)
        await engine.suspend()
        park_weights(loaded, replica)
        assert torch.cuda.memory_reserved(0) == 0, "the suspended engine holds nothing on the GPU"

        restore_weights(loaded, replica)
        resume_engine(engine, loaded)  # as the worker does: the passes wait for the weights' copy
        assert engine.kv_cache_bytes > 0 and torch.cuda.memory_allocated(0) >= engine.kv_cache_bytes
        for request_id in ("b", "c"):  # "c" again: a prefix-cache hit on the resumed pool
            after = "".join([o.text async for o in engine.generate(GenerationRequest(request_id, prompt, params))])
            assert after == before
    finally:
        await engine.close()
