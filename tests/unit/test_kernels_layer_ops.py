"""The fused layer ops (`shoal.kernels.layer_ops`): the native CPU code against the torch
reference (transformers' arithmetic) on random shapes and layouts, the contract's refusals,
and the reference against transformers' own modules. CUDA: tests/gpu/test_layer_ops_cuda.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from shoal.kernels import cpu_kernels, layer_ops, layer_reference
from shoal.kernels.contract import KVContractError

# The native RMSNorm sums its squares in another order than torch's mean; everything else is
# the same float32 operations in the same order, up to SiLU's exponential (within an ulp).
TOLERANCE = {"rtol": 2e-6, "atol": 2e-6}


def strided_rows(rows: int, features: int, generator: torch.Generator, pad: int) -> torch.Tensor:
    """Random [rows, features] whose rows are `pad` elements wider than the data (row stride != features)."""
    wide = torch.randn(rows, features + pad, generator=generator)
    return wide[:, :features]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 70),
    hidden=st.integers(1, 300),
    pad=st.sampled_from([0, 3]),
    with_residual=st.booleans(),
    in_place=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_rms_norm_matches_the_reference(
    native: cpu_kernels.CpuKernels, rows: int, hidden: int, pad: int, with_residual: bool, in_place: bool,
    seed: int,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = strided_rows(rows, hidden, generator, pad)
    weight = torch.randn(hidden, generator=generator)
    residual = strided_rows(rows, hidden, generator, pad) if with_residual else None
    expected_x, expected_residual = x.clone(), None if residual is None else residual.clone()
    expected = torch.empty(rows, hidden)
    layer_reference.rms_norm(expected, expected_x, weight, 1e-6, expected_residual)
    out = x if in_place else torch.empty(rows, hidden)
    assert native.rms_norm(out, x, weight, 1e-6, residual)
    torch.testing.assert_close(out, expected, **TOLERANCE)
    if residual is not None:
        assert torch.equal(residual, expected_residual), "the residual sum is one float32 addition"


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 20),
    heads=st.integers(1, 8),
    kv_heads=st.integers(1, 4),
    half=st.integers(1, 64),
    fused_qkv=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_rotary_matches_the_reference(
    native: cpu_kernels.CpuKernels, tokens: int, heads: int, kv_heads: int, half: int, fused_qkv: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    head_dim = 2 * half
    if fused_qkv:  # q and k as views of one projection's rows, as a fused QKV product leaves them
        qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=generator)
        query, key = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    else:
        query = torch.randn(tokens, heads, head_dim, generator=generator)
        key = torch.randn(tokens, kv_heads, head_dim, generator=generator)
    angles = torch.rand(tokens, half, generator=generator) * 100
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    expected_query, expected_key = query.clone(), key.clone()
    layer_reference.rotary_embedding(expected_query, expected_key, cos, sin)
    assert native.rotary_embedding(query, key, cos, sin)
    assert torch.equal(query, expected_query) and torch.equal(key, expected_key)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 40), n=st.integers(1, 200), pad=st.sampled_from([0, 5]), seed=st.integers(0, 2**31))
def test_silu_mul_matches_the_reference(native: cpu_kernels.CpuKernels, rows: int, n: int, pad: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    gate_up = strided_rows(rows, 2 * n, generator, pad) * 8  # beyond exp's easy range too
    expected = torch.empty(rows, n)
    layer_reference.silu_mul(expected, gate_up)
    out = torch.empty(rows, n)
    assert native.silu_mul(out, gate_up)
    torch.testing.assert_close(out, expected, **TOLERANCE)


def test_silu_mul_at_the_exponentials_limits(native: cpu_kernels.CpuKernels) -> None:
    gate = torch.tensor([-200.0, -88.0, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 200.0, 1e30])
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)])[None]
    out, expected = torch.empty(1, gate.numel()), torch.empty(1, gate.numel())
    layer_reference.silu_mul(expected, gate_up)
    assert native.silu_mul(out, gate_up)
    torch.testing.assert_close(out, expected, **TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_take_any_cpu_dtype_and_follow_the_reference(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=generator).to(dtype)
    weight = torch.randn(64, generator=generator).to(dtype)
    residual = torch.randn(5, 64, generator=generator).to(dtype)
    out, expected = torch.empty_like(x), torch.empty_like(x)
    expected_residual = residual.clone()
    layer_reference.rms_norm(expected, x, weight, 1e-5, expected_residual)
    layer_ops.rms_norm(out, x, weight, 1e-5, residual)
    torch.testing.assert_close(out, expected, **TOLERANCE)
    assert torch.equal(residual, expected_residual)
    gate_up = torch.randn(5, 64, generator=generator).to(dtype)
    out, expected = torch.empty(5, 32, dtype=dtype), torch.empty(5, 32, dtype=dtype)
    layer_reference.silu_mul(expected, gate_up)
    layer_ops.silu_mul(out, gate_up)
    torch.testing.assert_close(out, expected, **TOLERANCE)


def test_the_reference_is_transformers_arithmetic() -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-6, max_position_embeddings=64)
    generator = torch.Generator().manual_seed(2)
    norm = LlamaRMSNorm(64, eps=1e-6)
    norm.weight.data = torch.randn(64, generator=generator)
    x = torch.randn(7, 64, generator=generator)
    out = torch.empty_like(x)
    layer_reference.rms_norm(out, x, norm.weight.detach(), 1e-6)
    assert torch.equal(out, norm(x).detach())
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 3, 17, 63]])
    cos, sin = rotary(x, positions)
    query, key = torch.randn(4, 4, 16, generator=generator), torch.randn(4, 2, 16, generator=generator)
    hf_query, hf_key = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin)
    layer_reference.rotary_embedding(query, key, cos[0], sin[0])
    assert torch.equal(query, hf_query[0].transpose(0, 1)) and torch.equal(key, hf_key[0].transpose(0, 1))


def test_contract_breaks_are_refused_before_anything_is_written() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(KVContractError, match="weight"):
        layer_ops.rms_norm(torch.empty(3, 8), x, torch.ones(7), 1e-6)
    with pytest.raises(KVContractError, match="last dim"):
        layer_ops.rms_norm(torch.empty(3, 8), torch.randn(8, 3).t(), torch.ones(3), 1e-6)
    with pytest.raises(KVContractError, match="residual"):
        layer_ops.rms_norm(torch.empty(3, 8), x, torch.ones(8), 1e-6, residual=torch.zeros(2, 8))
    query, key = torch.randn(2, 4, 6), torch.randn(2, 2, 6)
    before = query.clone()
    with pytest.raises(KVContractError, match="cos and sin"):
        layer_ops.rotary_embedding(query, key, torch.ones(2, 4), torch.ones(2, 4))
    with pytest.raises(KVContractError, match="even"):
        layer_ops.rotary_embedding(torch.randn(2, 4, 5), torch.randn(2, 2, 5), torch.ones(2, 5), torch.ones(2, 5))
    assert torch.equal(query, before)
    with pytest.raises(KVContractError, match="2 n"):
        layer_ops.silu_mul(torch.empty(3, 4), torch.randn(3, 7))
