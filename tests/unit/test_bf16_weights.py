"""Bfloat16 weights in the native forward's panels (kernels/csrc/cpu_gemm.c's SHOAL_WEIGHTS_BF16):
the products equal the float32 products of the same weights rounded to bfloat16, on every
code path; the packing rounds as torch does; the panels take half the bytes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaConfig

from shoal.kernels import cpu_kernels
from shoal.kernels.cpu_model import ISA_NAMES, PANEL, PackedLinear, pack_into
from shoal.services.worker.engine import native_forward, packed_load
from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.model_runner import ModelRunner
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.generation import GenerationRequest
from shoal.services.worker.loader import LoadedModel, load_model, model_weight_bytes
from shoal.shared.messages import ModelSpec, ReplicaRecord, SamplingParams
from tests.token_echo import TokenEcho, echo
from tests.unit.test_native_forward import available_isas, make_product, product_cases
from tests.unit.test_packed_load import _save_tiny, _tiny_models

pytestmark = pytest.mark.skipif(cpu_kernels.try_load() is None, reason="no native CPU library")


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_packed_load's tiny models (biases, an untied lm_head, q/k/v packed one by one) and
    one saved in bfloat16 (its weights taken as they are)."""
    root = tmp_path_factory.mktemp("tiny")
    _tiny_models(root)
    _save_tiny(root, "bf16-file", LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
        num_hidden_layers=2, max_position_embeddings=128, attention_bias=True, tie_word_embeddings=False),
        dtype=torch.bfloat16)
    return root


def _rounded(weight: torch.Tensor) -> torch.Tensor:
    return weight.to(torch.bfloat16).float()


@settings(max_examples=30, deadline=None)
@product_cases
def test_bf16_products_equal_float32_products_of_the_rounded_weights(
    native: cpu_kernels.CpuKernels, rows: int, num_out: int, num_in: int, with_bias: bool, seed: int
) -> None:
    weight, bias, x = make_product(seed, rows, num_out, num_in, with_bias)
    half = PackedLinear(native, weight, bias, panel_dtype=torch.bfloat16)
    rounded = PackedLinear(native, _rounded(weight), bias)
    expected = torch.nn.functional.linear(x.double(), _rounded(weight).double(), None if bias is None else bias.double())
    for isa in available_isas(native):
        out = half.forward(x, isa=isa)
        # the same kernel on the same values, summed in the same order: the same bits
        assert torch.equal(out, rounded.forward(x, isa=isa)), ISA_NAMES[isa]
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * num_in**0.5,
                                   msg=lambda m, isa=isa: f"{ISA_NAMES[isa]}: {m}")
        for threads in (2, 3):
            assert torch.equal(half.forward(x, isa=isa, num_threads=threads), out)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 30), blocks=st.integers(1, 6), num_in=st.integers(1, 100), seed=st.integers(0, 2**31))
def test_the_bf16_gate_up_product_equals_the_rounded_float32_one(
    native: cpu_kernels.CpuKernels, rows: int, blocks: int, num_in: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(2 * 16 * blocks, num_in, generator=generator)
    bias = torch.randn(2 * 16 * blocks, generator=generator)
    x = torch.randn(rows, num_in, generator=generator)
    half = PackedLinear(native, weight, bias, silu_mul=True, panel_dtype=torch.bfloat16)
    rounded = PackedLinear(native, _rounded(weight), bias, silu_mul=True)
    for isa in available_isas(native):
        assert torch.equal(half.forward(x, isa=isa), rounded.forward(x, isa=isa)), ISA_NAMES[isa]


def _unpack(panels: torch.Tensor, num_out: int, num_in: int) -> torch.Tensor:
    """The float32 panels' layout [panel][k][32] of bf16 panels (words of columns j, j + 16)."""
    words = panels.view(torch.int32).view(-1, num_in, 16).to(torch.int64) & 0xFFFFFFFF
    low = ((words & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    high = ((words >> 16) << 16).to(torch.int32).view(torch.float32)
    return torch.cat([low, high], dim=2).reshape(-1)


@pytest.mark.parametrize("silu_mul", [False, True])
def test_bf16_panels_hold_the_float32_panels_rounded_as_torch_rounds(
    native: cpu_kernels.CpuKernels, silu_mul: bool
) -> None:
    generator = torch.Generator().manual_seed(7)
    num_out, num_in = (64, 37) if silu_mul else (45, 37)
    # every kind of value: ties (an odd and an even bf16 below), subnormals, infinities, the
    # largest float32 (rounds to infinity); NaNs apart (torch's own conversions differ on them)
    bits = torch.randint(-(2**31), 2**31 - 1, (num_out, num_in), generator=generator, dtype=torch.int64)
    bits[0, :7] = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x00008000, 0x7F800000, -0x800000, 0x7F7FFFFF])
    weight = bits.to(torch.int32).view(torch.float32)
    weight = torch.where(weight.isnan(), torch.zeros(()), weight).contiguous()
    half = PackedLinear(native, weight, panel_dtype=torch.bfloat16, silu_mul=silu_mul)
    assert half.panels.dtype == torch.bfloat16 and half.panels.numel() == -(-num_out // PANEL) * num_in * PANEL
    expected = PackedLinear(native, _rounded(weight), silu_mul=silu_mul).panels
    unpacked = _unpack(half.panels, num_out, num_in)
    assert torch.equal(unpacked.view(torch.int32), expected.view(torch.int32))
    # a bfloat16 weight is taken as it is, with the same result
    from_bf16 = torch.empty_like(half.panels)
    pack_into(native, weight.to(torch.bfloat16), from_bf16, silu_mul=silu_mul)
    assert torch.equal(from_bf16.view(torch.int16), half.panels.view(torch.int16))
    weight[1, 3] = float("nan")
    assert _unpack(PackedLinear(native, weight, panel_dtype=torch.bfloat16, silu_mul=silu_mul).panels,
                   num_out, num_in).isnan().sum() == 1


def test_bf16_panels_take_half_the_bytes(native: cpu_kernels.CpuKernels) -> None:
    weight = torch.randn(96, 64)
    assert PackedLinear(native, weight, panel_dtype=torch.bfloat16).nbytes * 2 == PackedLinear(native, weight).nbytes
    with pytest.raises(ValueError, match="float32"):
        PackedLinear(native, weight.to(torch.bfloat16))  # a bf16 weight only into bf16 panels
    with pytest.raises(ValueError, match="bfloat16"):
        PackedLinear(native, weight, panel_dtype=torch.float16)


# ------------------------------------------------------------------ loading and serving

CPU = torch.device("cpu")
NUM_NEW_TOKENS = 12


def _replica() -> ReplicaRecord:
    return ReplicaRecord(replica_id="r", model="m", node_id="n", gpu_bytes={0: 4 << 30})


def _load(root: Path, key: str, dtype: str = "bfloat16") -> LoadedModel:
    return load_model(root, ModelSpec(key="m", path=key, dtype=dtype), _replica(), device=CPU, native_pack=True)


def _rounded_reference(model_dir: Path) -> Any:
    """The checkpoint's model in float32 with every parameter rounded to bfloat16: the contract."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = parameter.data.to(torch.bfloat16).float()
    return model


def _linears(packed: Any) -> list[tuple[str, Any]]:
    named = [(f"{index}.{role}", getattr(layer, role)) for index, layer in enumerate(packed.layers)
             for role in ("qkv", "o", "gate_up", "down")]
    return named + ([("lm_head", packed.lm_head)] if packed.lm_head is not None else [])


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/qwen2-25m", "llama-bias-untied", "qwen2-tied", "bf16-file"])
def test_a_bf16_load_holds_the_rounded_model(
    native: cpu_kernels.CpuKernels, demo_models_root: Path, tiny_root: Path, key: str
) -> None:
    model_dir = (demo_models_root if key.startswith("demo/") else tiny_root) / key
    config = AutoConfig.from_pretrained(model_dir)
    loaded = packed_load.load_packed(model_dir, config, attn_implementation=None, weights_dtype=torch.bfloat16)
    assert loaded is not None
    model, weight_bytes = loaded
    assert packed_load.get_weights_dtype(model) == torch.bfloat16
    reference = _rounded_reference(model_dir)
    plain = {name: p for name, p in model.named_parameters() if p.numel() > 0}
    for name, parameter in plain.items():  # embedding, norms: float32 holding the rounded values
        assert parameter.dtype == torch.float32
        assert torch.equal(parameter, dict(reference.named_parameters())[name]), name
    expected = native_forward.pack_model(reference)  # float32 panels of the rounded weights
    packed = native_forward.pack_model(model)
    generator = torch.Generator().manual_seed(3)
    for (name, linear), (_, expected_linear) in zip(_linears(packed), _linears(expected), strict=True):
        assert linear.panels.dtype == torch.bfloat16, name
        assert linear.nbytes - (0 if linear.bias is None else linear.bias.numel() * 4) == (
            expected_linear.nbytes - (0 if expected_linear.bias is None else expected_linear.bias.numel() * 4)) // 2
        x = torch.randn(5, linear.num_in, generator=generator)
        assert torch.equal(linear.forward(x), expected_linear.forward(x)), name
    fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    product_params = sum(p.numel() for name, p in fresh.named_parameters()
                         if ("proj" in name and name.endswith(".weight"))
                         or (name == "lm_head.weight" and not config.tie_word_embeddings))
    assert weight_bytes == model_weight_bytes(fresh) - 2 * product_params, "products at 2 bytes, the rest at 4"


def test_a_bf16_model_that_runs_through_transformers_gets_its_rounded_parameters_back(tiny_root: Path) -> None:
    model_dir = tiny_root / "llama-bias-untied"
    loaded = packed_load.load_packed(model_dir, AutoConfig.from_pretrained(model_dir), attn_implementation=None,
                                     weights_dtype=torch.bfloat16)
    assert loaded is not None
    model = loaded[0]
    assert packed_load.restore_parameters(model)
    reference = dict(_rounded_reference(model_dir).named_parameters())
    for name, parameter in model.named_parameters():
        assert parameter.dtype == torch.float32 and torch.equal(parameter, reference[name]), name


def test_load_model_takes_bf16_to_the_native_path_on_the_cpu(demo_models_root: Path) -> None:
    half = _load(demo_models_root, "demo/llama-5m")
    full = _load(demo_models_root, "demo/llama-5m", dtype="float32")
    assert half.dtype == torch.float32, "it runs in float32: activations and KV cache"
    assert packed_load.get_weights_dtype(half.model) == torch.bfloat16
    assert packed_load.get_weights_dtype(full.model) == torch.float32
    # the products at half their bytes; the embedding (a fifth of llama-5m) and norms stay float32
    assert 0.5 < half.weight_bytes / full.weight_bytes < 0.65, (half.weight_bytes, full.weight_bytes)
    engine = PagedEngine(half.model, TokenEcho(), config=EngineConfig(num_blocks=16, block_size=4, warm_up=False))
    assert engine.forward == "native"
    assert engine.packed_weight_bytes * 2 == PagedEngine(
        full.model, TokenEcho(), config=EngineConfig(num_blocks=16, block_size=4, warm_up=False)).packed_weight_bytes
    # without the native path: the ordinary bfloat16 load, as before
    ordinary = load_model(demo_models_root, ModelSpec(key="m", path="demo/llama-5m", dtype="bfloat16"), _replica(),
                          device=CPU)
    assert all(p.dtype == torch.bfloat16 for p in ordinary.model.parameters())


def _prompts(vocab_size: int, lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(5, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def _greedy(reference: Any, prompt: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt])
    config = GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        output = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    return output[0, len(prompt):].tolist()


async def _complete(engine: PagedEngine, request_id: str, prompt: list[int]) -> str:
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    text = ""
    async for output in engine.generate(GenerationRequest(request_id, prompt, params)):
        text += output.text
    return text


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/qwen2-25m", "demo/llama-100m"])
async def test_greedy_with_bf16_weights_equals_generate_of_the_rounded_model(demo_models_root: Path, key: str) -> None:
    loaded = _load(demo_models_root, key)
    reference = _rounded_reference(demo_models_root / key)
    prompts = _prompts(reference.config.vocab_size, [1, 5, 16, 37])
    expected = [echo(_greedy(reference, prompt)) for prompt in prompts]
    engine = PagedEngine(loaded.model, TokenEcho(), config=EngineConfig(
        num_blocks=128, block_size=4, max_num_batched_tokens=64, warm_up=False))
    assert engine.forward == "native"
    try:
        for index, prompt in enumerate(prompts):  # one at a time: decode rows of one
            assert await _complete(engine, f"a{index}", prompt) == expected[index], f"prompt {index}"
        together = await asyncio.gather(*(_complete(engine, f"b{i}", p) for i, p in enumerate(prompts)))
        assert together == expected, "batched: several rows per product"
    finally:
        await engine.close()


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/qwen2-25m"])
def test_logits_with_bf16_weights_match_the_rounded_model_not_the_float32_one(demo_models_root: Path, key: str) -> None:
    """Greedy tokens of the demo models do not tell the rounded model from the float32 one; the
    logits do: the native pass's equal the rounded model's (to float32's summation order), and
    lie far from the unrounded model's."""
    from tests.unit.test_native_forward import BLOCK_SIZE, Sequences, hf_last_logits

    model_dir = demo_models_root / key
    loaded = packed_load.load_packed(model_dir, AutoConfig.from_pretrained(model_dir), attn_implementation=None,
                                     weights_dtype=torch.bfloat16)
    assert loaded is not None
    model = loaded[0]
    reference = _rounded_reference(model_dir)
    unrounded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = ModelRunner(model, 3 * 64 // BLOCK_SIZE, BLOCK_SIZE, packed_model=native_forward.pack_model(model))
    prompts = _prompts(reference.config.vocab_size, [5, 17, 33])
    sequences = Sequences(runner, prompts)
    steps = sequences.greedy(2)
    for step, logits in enumerate(steps):
        for seq, tokens in enumerate(sequences.tokens):
            context = tokens[: len(tokens) - 2 + step]
            torch.testing.assert_close(logits[seq], hf_last_logits(reference, context), rtol=1e-4, atol=1e-4)
            assert (logits[seq] - hf_last_logits(unrounded, context)).abs().max() > 1e-3
