"""The session cache on a GPU: every turn of a conversation served from KV cached in the
pool, copied back from the pinned host pool by the CUDA `swap_blocks` kernel, or partly
dropped and recomputed, equals Hugging Face `generate` on the same GPU (greedy, float32).
`tests/unit/test_engine_sessions.py` runs the same on the CPU. Skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.engine.session_kv import SessionSettings
from shoal.services.worker.generation import GenerationRequest
from shoal.shared.kv_cache.cost_model import CostModel
from shoal.shared.messages import SamplingParams
from shoal.shared.model_memory import get_model_shape
from tests.token_echo import TokenEcho, echo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
BLOCK_SIZE = 4
NUM_BLOCKS = 256
NUM_NEW_TOKENS = 8
COSTS = CostModel(seconds_per_token=1e-4, seconds_per_token_pair=1e-6, swap_seconds_per_block=1e-7)


def _load(root: Path, key: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(root / key, dtype=torch.float32).to(DEVICE).eval()


def _greedy(model: Any, prompt: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt], device=DEVICE)
    config = GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    return output[0, len(prompt) :].tolist()


def _tokens(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, 4096, (length,), generator=generator).tolist()


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/qwen2-25m"])
@pytest.mark.parametrize("tier", ["gpu", "cpu", "mixed"])
@pytest.mark.parametrize("swap_in_by_layer", ["auto", "off", "inline"])
async def test_every_turn_equals_generate_on_the_gpu(
    demo_models_root: Path, key: str, tier: str, swap_in_by_layer: str
) -> None:
    """"auto" is the side stream with one event per layer; "off" and "inline" the others."""
    if tier == "gpu" and swap_in_by_layer != "auto":
        pytest.skip("nothing is copied back")
    reference = _load(demo_models_root, key)
    model = _load(demo_models_root, key)
    block_bytes = get_model_shape(model.config, torch.float32).get_kv_bytes_per_block(BLOCK_SIZE)
    common: dict[str, Any] = {"cost_model": COSTS, "swap_in_by_layer": swap_in_by_layer}
    settings = {
        "gpu": SessionSettings(**common),
        "cpu": SessionSettings(**common, gpu_fraction=0.0, host_pool_bytes=200 * block_bytes),
        "mixed": SessionSettings(**common, gpu_fraction=8 / NUM_BLOCKS, host_pool_bytes=8 * block_bytes),
    }[tier]
    engine = PagedEngine(
        model,
        TokenEcho(),
        config=EngineConfig(
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=64,
            enable_prefix_caching=tier == "gpu",
            sessions=settings,
        ),
    )
    assert engine.kernels == "cuda"
    try:
        history = _tokens(0, 37)
        for turn in range(4):
            expected = _greedy(reference, history)
            request = GenerationRequest(
                f"t{turn}",
                history,
                SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True),
                session_id="chat",
            )
            text = ""
            async for output in engine.generate(request):
                text += output.text
            assert text == echo(expected), f"turn {turn}"
            history = history + expected + _tokens(turn + 1, 11)
        stats = engine.get_stats().sessions
        assert stats is not None and stats.num_hits == 3
        if tier != "gpu":
            assert stats.swap_in_bytes > 0 and stats.exposed_swap_seconds > 0
    finally:
        await engine.close()
