"""Loading a replica's model within its allocation (virtual GPUs enforce it themselves)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from shoal.services.worker.launch import WorkerLaunch
from shoal.services.worker.loader import ModelLoadError, build_max_memory, load_model
from shoal.services.worker.main import build_engine, get_min_engine_bytes
from shoal.shared.config import LoggingConfig, WorkerConfig
from shoal.shared.messages import ModelSpec, ReplicaRecord
from shoal.shared.model_settings import InvalidModelPath

MODEL = "demo/llama-5m"
CPU = torch.device("cpu")


def _replica(num_bytes: int) -> ReplicaRecord:
    return ReplicaRecord(replica_id="r", model=MODEL, node_id="n", gpu_bytes={0: num_bytes})


def test_loads_within_its_allocation(demo_models_root: Path) -> None:
    loaded = load_model(demo_models_root, ModelSpec(key=MODEL, path=MODEL), _replica(1 << 30), device=CPU)
    assert 15e6 < loaded.weight_bytes < 25e6, "~5M float32 parameters"
    assert loaded.allocation_bytes == 1 << 30
    assert loaded.max_model_len == 2048


def test_a_model_too_large_for_its_virtual_allocation_fails_clearly(demo_models_root: Path) -> None:
    with pytest.raises(ModelLoadError, match="do not fit this replica's allocation of 1048576 bytes"):
        load_model(demo_models_root, ModelSpec(key=MODEL, path=MODEL), _replica(1 << 20), device=CPU)


def test_a_max_model_len_beyond_the_checkpoints_positions_is_refused(demo_models_root: Path) -> None:
    """As vLLM refuses it: positions past the trained ones give garbage (rotary) or fail (learned)."""
    with pytest.raises(ModelLoadError, match="max_model_len 4096 is longer than the checkpoint's 2048 positions"):
        load_model(demo_models_root, ModelSpec(key=MODEL, path=MODEL, max_model_len=4096), _replica(1 << 30),
                   device=CPU)
    shorter = load_model(demo_models_root, ModelSpec(key=MODEL, path=MODEL, max_model_len=512), _replica(1 << 30),
                         device=CPU)
    assert shorter.max_model_len == 512


def test_paths_outside_the_models_root_or_without_a_checkpoint_are_refused(demo_models_root: Path,
                                                                         tmp_path: Path) -> None:
    with pytest.raises(InvalidModelPath, match="models root"):
        ModelSpec(key="x", path="../x")  # refused where a spec is made or decoded
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "escape").symlink_to(demo_models_root / MODEL)
    with pytest.raises(ModelLoadError, match="outside the models root"):
        load_model(tmp_path / "root", ModelSpec(key="x", path="escape"), _replica(1 << 30), device=CPU)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path, ModelSpec(key="x", path="empty"), _replica(1 << 30), device=CPU)


def test_max_memory_gives_non_target_gpus_nothing() -> None:
    assert build_max_memory({1: 5 << 30, 2: 7 << 30}, num_visible_gpus=4) == {
        0: 0, 1: 5 << 30, 2: 7 << 30, 3: 0, "cpu": 0,
    }


async def test_the_worker_checks_its_engines_real_minimum_at_load(demo_models_root: Path) -> None:
    """The loader refuses exactly the allocations the paged engine could not start on: its
    minimum is the engine's activation reserve plus one KV block, not 0 bytes."""
    spec = ModelSpec(key=MODEL, path=MODEL)
    args = WorkerLaunch(
        nats_url="nats://unused", node_id="n", models_root=str(demo_models_root), replica=_replica(1 << 30),
        model=spec, device="cpu", worker=WorkerConfig(), logging=LoggingConfig(),
    )
    min_engine_bytes = get_min_engine_bytes(args)
    assert not isinstance(min_engine_bytes, int)
    min_bytes = min_engine_bytes(AutoConfig.from_pretrained(demo_models_root / MODEL), torch.float32)
    weight_bytes = load_model(demo_models_root, spec, _replica(1 << 30), device=CPU).weight_bytes
    with pytest.raises(ModelLoadError, match=rf"plus the engine's minimum \({min_bytes} bytes"):
        load_model(demo_models_root, spec, _replica(weight_bytes + min_bytes - 1), device=CPU,
                   min_kv_reserve_bytes=min_engine_bytes)
    loaded = load_model(demo_models_root, spec, _replica(weight_bytes + min_bytes), device=CPU,
                        min_kv_reserve_bytes=min_engine_bytes)
    engine, _ = build_engine(args, loaded)
    try:
        assert engine.get_stats().pool.num_blocks == 1, "the least that loads is the engine's smallest pool"
    finally:
        await engine.close()


def test_a_dispatched_model_parks_without_accelerates_hooks(demo_models_root: Path) -> None:
    """accelerate's hooks move each layer's inputs to the device it was dispatched to: parked
    and restored elsewhere, a model that kept them would send its activations to the old GPU."""
    from accelerate import dispatch_model

    from shoal.services.worker.loader import detach_dispatch

    loaded = load_model(demo_models_root, ModelSpec(key=MODEL, path=MODEL), _replica(1 << 30), device=CPU)
    input_ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        expected = loaded.model(input_ids).logits
    model = dispatch_model(loaded.model, device_map={"": "cpu"}, force_hooks=True)
    assert hasattr(model, "_hf_hook") and "to" in model.__dict__ and model.hf_device_map == {"": "cpu"}
    detach_dispatch(model)
    assert not [name for name, module in model.named_modules() if hasattr(module, "_hf_hook")]
    assert "to" not in model.__dict__ and "cuda" not in model.__dict__ and "hf_device_map" not in model.__dict__
    with torch.inference_mode():
        assert torch.equal(model(input_ids).logits, expected)


def test_a_cuda_restore_that_would_leave_a_context_behind_is_refused(demo_models_root: Path) -> None:
    """A CUDA context lives as long as its process: a worker parked from GPU 0 restores onto an
    allocation that includes GPU 0, or is refused (and replaced by a fresh worker). Checked
    before any CUDA call, so it runs here."""
    from dataclasses import replace as replace_field

    from shoal.services.worker.loader import get_stray_context_gpus, restore_weights

    loaded = load_model(demo_models_root, ModelSpec(key=MODEL, path=MODEL), _replica(1 << 30), device=CPU)
    parked_on_cuda = replace_field(loaded, device=torch.device("cuda"), context_gpus=frozenset({0}))
    elsewhere = ReplicaRecord(replica_id="r", model=MODEL, node_id="n", gpu_bytes={1: 1 << 30})
    assert get_stray_context_gpus(parked_on_cuda, elsewhere) == [0]
    with pytest.raises(ModelLoadError, match=r"CUDA context lives on GPU\(s\) \[0\], outside the new allocation \[1\]"):
        restore_weights(parked_on_cuda, elsewhere)
    wider = ReplicaRecord(replica_id="r", model=MODEL, node_id="n", gpu_bytes={0: 1 << 29, 1: 1 << 29})
    assert get_stray_context_gpus(parked_on_cuda, wider) == []
    assert get_stray_context_gpus(loaded, elsewhere) == [], "virtual GPUs hold no context"
