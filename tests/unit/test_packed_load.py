"""Loading a model straight into the native forward's panels (`engine/packed_load.py`): every
tensor lands where `native_forward.pack_model` puts it, bit for bit, on the demo models and
on small models that take the other branches (q/k/v rows that do not fill whole panels,
biases, an untied lm_head); a model the path does not take loads the ordinary way; an
engine that does not run the native forward gets the parameters back. Greedy output equal to
`generate` on packed loads: test_engine_correctness.py (the ``:packed`` model keys)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config

from shoal.kernels import cpu_kernels
from shoal.services.worker.engine import packed_load
from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.native_forward import PackedModel, pack_model
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.generation import GenerationRequest
from shoal.services.worker.loader import load_model, model_weight_bytes
from shoal.shared.messages import ModelSpec, ReplicaRecord, SamplingParams
from tests.token_echo import TokenEcho, echo

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(cpu_kernels.try_load() is None, reason="no native CPU library")


def _replica() -> ReplicaRecord:
    return ReplicaRecord(replica_id="r", model="m", node_id="n", gpu_bytes={0: 1 << 30})


def _save_tiny(root: Path, name: str, config: LlamaConfig | Qwen2Config, dtype: torch.dtype = torch.float32) -> Path:
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    for parameter in model.parameters():  # biases and norms are zeros and ones at initialisation
        torch.nn.init.normal_(parameter, std=0.5)
    model.save_pretrained(root / name)
    return root / name


def _tiny_models(root: Path) -> dict[str, Path]:
    common = {"vocab_size": 96, "max_position_embeddings": 128, "num_hidden_layers": 2}
    return {
        # k and v: 16 rows each, so q/k/v are joined before packing; biases on q/k/v and o
        "llama-bias-untied": _save_tiny(root, "llama-bias-untied", LlamaConfig(
            hidden_size=48, intermediate_size=80, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
            attention_bias=True, mlp_bias=True, tie_word_embeddings=False, **common)),
        # q: 64 rows, k and v: 32: packed one by one into their panels; tied lm_head
        "qwen2-tied": _save_tiny(root, "qwen2-tied", Qwen2Config(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=True, **common)),
    }


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    _tiny_models(root)
    return root


def _assert_same_packing(packed: PackedModel, expected: PackedModel) -> None:
    assert (packed.num_heads, packed.num_kv_heads, packed.head_dim, packed.eps, packed.rope_scaling) == (
        expected.num_heads, expected.num_kv_heads, expected.head_dim, expected.eps, expected.rope_scaling)
    for name in ("embedding", "final_norm", "inv_freq"):
        assert torch.equal(getattr(packed, name), getattr(expected, name)), name
    assert len(packed.layers) == len(expected.layers)
    for index, (layer, expected_layer) in enumerate(zip(packed.layers, expected.layers, strict=True)):
        assert torch.equal(layer.input_norm, expected_layer.input_norm)
        assert torch.equal(layer.post_norm, expected_layer.post_norm)
        for role in ("qkv", "o", "gate_up", "down"):
            linear, expected_linear = getattr(layer, role), getattr(expected_layer, role)
            where = f"layer {index} {role}"
            assert torch.equal(linear.panels.view(-1), expected_linear.panels.view(-1)), where
            assert (linear.bias is None) == (expected_linear.bias is None), where
            assert linear.bias is None or torch.equal(linear.bias, expected_linear.bias), where
            assert (linear.num_in, linear.num_out, linear.struct.epilogue) == (
                expected_linear.num_in, expected_linear.num_out, expected_linear.struct.epilogue), where
    assert (packed.lm_head is None) == (expected.lm_head is None)
    if packed.lm_head is not None and expected.lm_head is not None:
        assert torch.equal(packed.lm_head.panels.view(-1), expected.lm_head.panels.view(-1))
    assert packed.nbytes == expected.nbytes


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/qwen2-25m", "llama-bias-untied", "qwen2-tied"])
def test_every_tensor_lands_where_pack_model_puts_it(demo_models_root: Path, tiny_root: Path, key: str) -> None:
    model_dir = (demo_models_root if key.startswith("demo/") else tiny_root) / key
    config = AutoConfig.from_pretrained(model_dir)
    loaded = packed_load.load_packed(model_dir, config, attn_implementation=None)
    assert loaded is not None
    model, weight_bytes = loaded
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert weight_bytes == model_weight_bytes(reference)
    expected = pack_model(reference)
    assert pack_model(model) is pack_model(model), "the engine's pack_model returns what the load attached"
    _assert_same_packing(pack_model(model), expected)
    released = [name for name, p in model.named_parameters() if p.numel() == 0]
    assert released == [name for name, p in reference.named_parameters() if p.numel() == 0], (
        "the products' parameters are released, as pack_model releases them")
    assert model.config.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight)


def test_load_model_reads_packed_only_when_asked_and_where_it_applies(demo_models_root: Path, tiny_root: Path) -> None:
    spec = ModelSpec(key="m", path="demo/llama-5m")
    packed = load_model(demo_models_root, spec, _replica(), device=CPU, native_pack=True)
    ordinary = load_model(demo_models_root, spec, _replica(), device=CPU)
    assert packed.weight_bytes == ordinary.weight_bytes
    assert packed.model.model.layers[0].self_attn.q_proj.weight.numel() == 0
    assert ordinary.model.model.layers[0].self_attn.q_proj.weight.numel() > 0
    # neither float32 nor bfloat16 (which loads packed: test_bf16_weights.py): the ordinary path
    half = load_model(demo_models_root, ModelSpec(key="m", path="demo/llama-5m", dtype="float16"), _replica(),
                      device=CPU, native_pack=True)
    assert all(p.numel() > 0 and p.dtype == torch.float16 for p in half.model.parameters())


def test_a_file_that_is_not_float32_loads_the_ordinary_way(tmp_path: Path) -> None:
    model_dir = _save_tiny(tmp_path, "half-file", LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
        num_hidden_layers=1, max_position_embeddings=64), dtype=torch.bfloat16)
    config = AutoConfig.from_pretrained(model_dir)
    assert packed_load.load_packed(model_dir, config, attn_implementation=None) is None


def test_a_model_on_another_device_or_dtype_is_skipped(demo_models_root: Path) -> None:
    model_dir = demo_models_root / "demo/llama-5m"
    config = AutoConfig.from_pretrained(model_dir)
    assert packed_load.get_skip_reason(model_dir, config, torch.float32, CPU) is None
    assert packed_load.get_skip_reason(model_dir, config, torch.bfloat16, CPU) is None
    assert packed_load.get_skip_reason(model_dir, config, torch.float16, CPU) is not None
    assert packed_load.get_skip_reason(model_dir, config, torch.float32, torch.device("cuda")) is not None
    assert "no single" in str(packed_load.get_skip_reason(demo_models_root, config, torch.float32, CPU))


async def test_an_engine_off_the_native_forward_gets_the_parameters_back(demo_models_root: Path) -> None:
    model_dir = demo_models_root / "demo/llama-5m"
    loaded = packed_load.load_packed(model_dir, AutoConfig.from_pretrained(model_dir), attn_implementation=None)
    assert loaded is not None
    model = loaded[0]
    engine = PagedEngine(model, TokenEcho(), config=EngineConfig(num_blocks=64, block_size=4, native_forward=False))
    try:
        assert engine.forward == "transformers"
        reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        prompt = [5, 9, 17, 33, 2, 8]
        with torch.inference_mode():
            output = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
        text = ""
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        async for chunk in engine.generate(GenerationRequest("r", prompt, params)):
            text += chunk.text
        assert text == echo(output[0, len(prompt):].tolist())
    finally:
        await engine.close()


def test_restored_parameters_are_the_files(demo_models_root: Path) -> None:
    model_dir = demo_models_root / "demo/qwen2-25m"
    loaded = packed_load.load_packed(model_dir, AutoConfig.from_pretrained(model_dir), attn_implementation=None)
    assert loaded is not None
    model = loaded[0]
    assert packed_load.restore_parameters(model)
    assert not packed_load.restore_parameters(model), "once"
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.detach(), expected[name].detach()), name
    assert not packed_load.restore_parameters(reference), "a model loaded the ordinary way has its parameters"


def test_weights_are_allocated_on_huge_page_boundaries() -> None:
    small = packed_load.allocate_weights(1000)
    assert small.numel() == 1000 and small.dtype == torch.float32
    large = packed_load.allocate_weights(3 << 20)
    assert large.numel() == 3 << 20 and large.is_contiguous()
    assert large.data_ptr() % packed_load.HUGE_PAGE_BYTES == 0
    large.fill_(1.5)
    assert float(large.sum()) == 1.5 * (3 << 20)
