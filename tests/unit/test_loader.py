"""Loading a replica's model within its allocation (virtual GPUs enforce it themselves)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.services.worker.loader import ModelLoadError, build_max_memory, load_model
from shoal.shared.messages import ModelSpec, ReplicaRecord

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


def test_paths_outside_the_models_root_or_without_a_checkpoint_are_refused(demo_models_root: Path,
                                                                         tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="models root"):
        load_model(demo_models_root, ModelSpec(key="x", path="../x"), _replica(1 << 30), device=CPU)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path, ModelSpec(key="x", path="empty"), _replica(1 << 30), device=CPU)


def test_max_memory_gives_non_target_gpus_nothing() -> None:
    assert build_max_memory({1: 5 << 30, 2: 7 << 30}, num_visible_gpus=4) == {
        0: 0, 1: 5 << 30, 2: 7 << 30, 3: 0, "cpu": 0,
    }
