"""Models whose attention the paged engine would compute wrong are refused at load, saying why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Gemma2Config, GptOssConfig, MistralConfig

from shoal.services.worker.engine.factory import build_paged_engine
from shoal.services.worker.engine.model_support import (
    UnsupportedAttention,
    check_attention,
    get_unsupported_attention,
)
from shoal.services.worker.loader import ModelLoadError, load_model
from shoal.shared.messages import ModelSpec, ReplicaRecord

CPU = torch.device("cpu")


def test_the_demo_models_are_served(demo_models_root: Path) -> None:
    for name in ("llama-5m", "llama-100m", "qwen2-25m"):
        config = AutoConfig.from_pretrained(demo_models_root / "demo" / name)
        assert get_unsupported_attention(config) is None, name


def test_soft_capped_attention_is_refused() -> None:
    reason = get_unsupported_attention(Gemma2Config(), 2048)
    assert reason is not None and "attn_logit_softcapping=50.0" in reason and 'engine = "hf"' in reason
    # Without the soft cap, Gemma-2 is served (its sliding layers within their window: the
    # engine caps its serving length there).
    assert get_unsupported_attention(Gemma2Config(attn_logit_softcapping=None), 8192) is None


def test_attention_sinks_are_refused() -> None:
    reason = get_unsupported_attention(GptOssConfig(), 128)
    assert reason is not None and "attention sinks" in reason


def test_a_sliding_window_is_served_within_it_not_refused() -> None:
    assert get_unsupported_attention(MistralConfig(sliding_window=4096), 32768) is None


def test_the_loader_refuses_before_loading_the_weights(demo_models_root: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "demo" / "capped"
    shutil.copytree(demo_models_root / "demo" / "llama-5m", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["attn_logit_softcapping"] = 30.0
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "model.safetensors").write_bytes(b"not weights")  # never read: refused first
    replica = ReplicaRecord(replica_id="r", model="capped", node_id="n", gpu_bytes={0: 1 << 30})
    with pytest.raises(ModelLoadError, match=r"capped: llama soft-caps attention logits"):
        load_model(tmp_path, ModelSpec(key="capped", path="demo/capped"), replica, device=CPU,
                   get_unsupported_reason=get_unsupported_attention)


def test_the_engine_factory_refuses_a_model_holding_sinks(demo_models_root: Path) -> None:
    replica = ReplicaRecord(replica_id="r", model="m", node_id="n", gpu_bytes={0: 1 << 30})
    loaded = load_model(demo_models_root, ModelSpec(key="m", path="demo/llama-5m"), replica, device=CPU)
    attention = loaded.model.model.layers[1].self_attn
    attention.sinks = torch.nn.Parameter(torch.zeros(loaded.model.config.num_attention_heads))
    with pytest.raises(UnsupportedAttention, match=r"layers\.1\.self_attn has attention sinks"):
        build_paged_engine(loaded)
    with pytest.raises(UnsupportedAttention):
        check_attention(loaded.model.config, 2048, loaded.model)
