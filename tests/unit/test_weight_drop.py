"""Cold sleep's weight drop (`services/worker/weight_drop.py`): the demo models, loaded packed
and the ordinary way on the CPU, give their weights' memory back and, reloaded from their
files, answer token for token as before; a file that changed meanwhile is refused."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from shoal.kernels import cpu_kernels
from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.native_forward import pack_model
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.generation import GenerationRequest
from shoal.services.worker.loader import LoadedModel, ModelLoadError, load_model
from shoal.services.worker.weight_drop import drop_weights, reload_weights
from shoal.shared.messages import ModelSpec, ReplicaRecord, SamplingParams
from tests.token_echo import TokenEcho

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(cpu_kernels.try_load() is None, reason="no native CPU library")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _load(root: Path, key: str, *, packed: bool, dtype: str = "auto") -> LoadedModel:
    replica = ReplicaRecord(replica_id="r", model="m", node_id="n", gpu_bytes={0: 4 << 30})
    return load_model(root, ModelSpec(key="m", path=key, dtype=dtype), replica, device=CPU, native_pack=packed)


async def _generate(loaded: LoadedModel) -> str:
    engine = PagedEngine(loaded.model, TokenEcho(), config=EngineConfig(num_blocks=64, block_size=4, warm_up=False))
    try:
        text = ""
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        async for chunk in engine.generate(GenerationRequest("r", [5, 9, 17, 33, 2, 8], params)):
            text += chunk.text
        return text
    finally:
        await engine.close()


@pytest.mark.parametrize(("key", "packed"), [
    ("demo/llama-5m", True), ("demo/llama-5m", False), ("demo/qwen2-25m", True), ("demo/qwen2-25m", False),
    ("demo/llama-100m", True),
])
async def test_dropped_weights_come_back_token_for_token(demo_models_root: Path, key: str, packed: bool) -> None:
    loaded = _load(demo_models_root, key, packed=packed)
    before = await _generate(loaded)
    rss = _rss_bytes()
    dropped = drop_weights(loaded)
    released = rss - _rss_bytes()
    assert released > loaded.weight_bytes * 0.8, f"{released} of {loaded.weight_bytes} bytes given back"
    reload_weights(loaded, dropped)
    assert await _generate(loaded) == before


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/qwen2-25m"])
async def test_bf16_weights_come_back_bit_for_bit(demo_models_root: Path, key: str) -> None:
    """Bfloat16 weights (packed_load): the panels refilled in their layout, the other tensors
    rounded again."""
    loaded = _load(demo_models_root, key, packed=True, dtype="bfloat16")
    before = await _generate(loaded)
    packed = pack_model(loaded.model)
    tensors = [layer_tensor for layer in packed.layers for layer_tensor in (
        layer.qkv.panels, layer.o.panels, layer.gate_up.panels, layer.down.panels)]
    tensors += [p.data for p in loaded.model.parameters() if p.numel() > 0]
    assert any(t.dtype == torch.bfloat16 for t in tensors)
    snapshot = [t.clone() for t in tensors]
    dropped = drop_weights(loaded)
    assert dropped.rounded
    reload_weights(loaded, dropped)
    for tensor, saved in zip(tensors, snapshot, strict=True):
        assert torch.equal(tensor.view(torch.int16 if tensor.dtype == torch.bfloat16 else torch.int32),
                           saved.view(torch.int16 if saved.dtype == torch.bfloat16 else torch.int32))
    assert await _generate(loaded) == before


async def test_a_changed_file_is_refused(demo_models_root: Path, tmp_path: Path) -> None:
    shutil.copytree(demo_models_root / "demo/llama-5m", tmp_path / "m")
    loaded = _load(tmp_path, "m", packed=True)
    dropped = drop_weights(loaded)
    other = demo_models_root / "demo/qwen2-25m/model.safetensors"
    shutil.copyfile(other, tmp_path / "m/model.safetensors")
    with pytest.raises(ModelLoadError, match="changed"):
        reload_weights(loaded, dropped)


@pytest.mark.parametrize("damage", ["truncated", "broken index"])
async def test_unreadable_files_are_refused_with_a_load_error(
        demo_models_root: Path, tmp_path: Path, damage: str) -> None:
    shutil.copytree(demo_models_root / "demo/llama-5m", tmp_path / "m")
    loaded = _load(tmp_path, "m", packed=True)
    dropped = drop_weights(loaded)
    weights = tmp_path / "m/model.safetensors"
    if damage == "truncated":
        with open(weights, "r+b") as file:
            file.truncate(weights.stat().st_size // 2)
    else:
        (tmp_path / "m/model.safetensors.index.json").write_text('{"weight_map": {"x": "../../etc/passwd"}}')
    with pytest.raises(ModelLoadError, match="cannot be read back"):
        reload_weights(loaded, dropped)
