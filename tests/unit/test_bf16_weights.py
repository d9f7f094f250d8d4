"""Bfloat16 weights in the native forward's panels (kernels/csrc/cpu_gemm.c's SHOAL_WEIGHTS_BF16):
the products equal the float32 products of the same weights rounded to bfloat16, on every
code path; the packing rounds as torch does; the panels take half the bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.kernels import cpu_kernels
from shoal.kernels.cpu_model import ISA_NAMES, PANEL, PackedLinear, get_gemm_isa, pack_into


def _isas(native: cpu_kernels.CpuKernels) -> list[int]:
    return list(range(get_gemm_isa(native) + 1))


def _rounded(weight: torch.Tensor) -> torch.Tensor:
    return weight.to(torch.bfloat16).float()


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    num_out=st.integers(1, 130),
    num_in=st.integers(1, 150),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_bf16_products_equal_float32_products_of_the_rounded_weights(
    native: cpu_kernels.CpuKernels, rows: int, num_out: int, num_in: int, with_bias: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_out, num_in, generator=generator)
    bias = torch.randn(num_out, generator=generator) if with_bias else None
    x = torch.randn(rows, num_in, generator=generator)
    half = PackedLinear(native, weight, bias, panel_dtype=torch.bfloat16)
    rounded = PackedLinear(native, _rounded(weight), bias)
    expected = torch.nn.functional.linear(x.double(), _rounded(weight).double(), None if bias is None else bias.double())
    for isa in _isas(native):
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
    for isa in _isas(native):
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
