"""The fused layer ops' CUDA kernels (kernels/csrc/layer_ops.cu) against the torch reference
(`shoal.kernels.layer_reference`, transformers' arithmetic) on random shapes, in float32,
bfloat16 and float16. Skipped without CUDA; the CPU twins: tests/unit/test_kernels_layer_ops.py."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import layer_ops, layer_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# float32: the reductions' order; half dtypes: one rounding of the result either way
TOLERANCE = {torch.float32: {"rtol": 2e-6, "atol": 2e-6}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
             torch.float16: {"rtol": 2e-3, "atol": 1e-3}}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 300), (65, 2048), (3, 5)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference(dtype: torch.dtype, rows: int, hidden: int, with_residual: bool) -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(rows * hidden)
    x = torch.randn(rows, hidden + 3, device=DEVICE, generator=generator).to(dtype)[:, :hidden]
    weight = torch.randn(hidden, device=DEVICE, generator=generator).to(dtype)
    residual = torch.randn(rows, hidden, device=DEVICE, generator=generator).to(dtype) if with_residual else None
    expected, expected_residual = torch.empty(rows, hidden, device=DEVICE, dtype=dtype), None
    if residual is not None:
        expected_residual = residual.clone()
    layer_reference.rms_norm(expected, x, weight, 1e-6, expected_residual)
    out = torch.empty(rows, hidden, device=DEVICE, dtype=dtype)
    layer_ops.rms_norm(out, x, weight, 1e-6, residual)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    if residual is not None:
        assert torch.equal(residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 2, 64), (9, 12, 4, 128), (33, 3, 1, 6)])
def test_rotary_matches_the_reference(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int) -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(tokens * heads)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=DEVICE, generator=generator).to(dtype)
    query, key = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    angles = torch.rand(tokens, head_dim // 2, device=DEVICE, generator=generator) * 50
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    expected_query, expected_key = query.clone(), key.clone()
    layer_reference.rotary_embedding(expected_query, expected_key, cos, sin)
    layer_ops.rotary_embedding(query, key, cos, sin)
    torch.testing.assert_close(query, expected_query, **TOLERANCE[dtype])
    torch.testing.assert_close(key, expected_key, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 16), (5, 704), (64, 2560), (2, 3)])
def test_silu_mul_matches_the_reference(dtype: torch.dtype, rows: int, n: int) -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(rows * n)
    gate_up = (torch.randn(rows, 2 * n, device=DEVICE, generator=generator) * 6).to(dtype)
    expected = torch.empty(rows, n, device=DEVICE, dtype=dtype)
    layer_reference.silu_mul(expected, gate_up)
    out = torch.empty(rows, n, device=DEVICE, dtype=dtype)
    layer_ops.silu_mul(out, gate_up)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
