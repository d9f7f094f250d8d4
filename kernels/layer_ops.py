"""Fused element-wise ops of a decoder layer: RMSNorm after the residual add, rotary
embedding in place on q and k, SiLU(gate) * up.

One contract on every device: CUDA tensors run the kernels of ``kernels/csrc/layer_ops.cu``
(built with the KV ops' extension), float32 CPU tensors the native C code of
``kernels/csrc/cpu_fused.c`` (the same functions the native forward pass runs between its
products, `shoal.services.worker.engine.native_forward`), anything else the torch
reference (`shoal.kernels.layer_reference`: transformers' arithmetic), which is also what
the other two are tested against. Arguments that break the contract raise
`KVContractError` (a `ValueError`) before anything is written.

Tensors are 2-D [rows, features] (or [tokens, heads, head_dim] for rotary) with a
contiguous last dim and any row stride; all of one op's tensors share a dtype and a device.
"""

from __future__ import annotations

import torch

from shoal.kernels import cpu_kernels, cuda_ext, layer_reference
from shoal.kernels.contract import KVContractError
from shoal.kernels.settings import get_settings


def _check_matrix(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    if tensor.dim() != 2:
        raise KVContractError(f"{name} must be 2-D [rows, features], got {tuple(tensor.shape)}")
    if tensor.dtype != like.dtype or tensor.device != like.device:
        raise KVContractError(f"{name} must be {like.dtype} on {like.device}, got {tensor.dtype} on {tensor.device}")
    if tensor.shape[1] and tensor.stride(1) != 1:
        raise KVContractError(f"{name}'s last dim must be contiguous, got strides {tensor.stride()}")


def _use_cuda(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and get_settings().cuda == "kernels"


def _native(tensor: torch.Tensor) -> cpu_kernels.CpuKernels | None:
    return cpu_kernels.try_load() if tensor.is_cpu and tensor.dtype == torch.float32 else None


def rms_norm(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> None:
    """out = weight * x / sqrt(mean(x^2) + eps) per row (float32 inside); with `residual`,
    first residual += x (in place) and the norm is of that sum. `out` may be `x`.

    Args:
        out: [rows, hidden], written.
        x: [rows, hidden].
        weight: [hidden], contiguous.
        eps: added to the mean square.
        residual: [rows, hidden] or None.
    """
    _check_matrix("x", x, x)
    _check_matrix("out", out, x)
    if out.shape != x.shape:
        raise KVContractError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise KVContractError(f"weight must be {x.dtype} [{x.shape[1]}] on {x.device}, got {weight.dtype} "
                              f"{tuple(weight.shape)} on {weight.device}")
    if residual is not None:
        _check_matrix("residual", residual, x)
        if residual.shape != x.shape:
            raise KVContractError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if _use_cuda(x):
        cuda_ext.load_extension().rms_norm(out, x, weight.contiguous(), eps, residual)
        return
    native = _native(x)
    if native is not None and native.rms_norm(out, x, weight.contiguous(), eps, residual):
        return
    layer_reference.rms_norm(out, x, weight, eps, residual)


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates query and key in place (rotate-half layout, transformers' Llama rotary):
    ``x * cos + rotate_half(x) * sin`` with each token's cos and sin.

    Args:
        query: [tokens, heads, head_dim], head_dim even, last dim contiguous.
        key: [tokens, kv_heads, head_dim], likewise.
        cos: [tokens, head_dim] as transformers' rotary embedding returns it (its two halves
            are equal: the kernels read the first).
        sin: like `cos`, with its layout.
    """
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise KVContractError(f"query and key must be [tokens, heads, head_dim] with one token count and head_dim, "
                              f"got {tuple(query.shape)} and {tuple(key.shape)}")
    if query.shape[2] % 2:
        raise KVContractError(f"head_dim must be even, got {query.shape[2]}")
    for name, tensor in (("query", query), ("key", key)):
        if tensor.dtype != query.dtype or tensor.device != query.device:
            raise KVContractError(f"{name} must be {query.dtype} on {query.device}")
        if tensor.numel() and tensor.stride(2) != 1:
            raise KVContractError(f"{name}'s last dim must be contiguous, got strides {tensor.stride()}")
    _check_matrix("cos", cos, query)
    _check_matrix("sin", sin, query)
    if cos.shape != (query.shape[0], query.shape[2]) or sin.shape != cos.shape or sin.stride() != cos.stride():
        raise KVContractError(f"cos and sin must be [tokens={query.shape[0]}, head_dim={query.shape[2]}] with one "
                              f"layout, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if _use_cuda(query):
        cuda_ext.load_extension().rotary_embedding(query, key, cos, sin)
        return
    native = _native(query)
    if native is not None and native.rotary_embedding(query, key, cos, sin):
        return
    layer_reference.rotary_embedding(query, key, cos, sin)


def silu_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """out = silu(gate) * up, for gate_up = [gate | up] along the last dim.

    Args:
        out: [rows, n], written.
        gate_up: [rows, 2 n].
    """
    _check_matrix("gate_up", gate_up, gate_up)
    _check_matrix("out", out, gate_up)
    if gate_up.shape[1] % 2 or out.shape != (gate_up.shape[0], gate_up.shape[1] // 2):
        raise KVContractError(f"gate_up must be [rows, 2 n] and out [rows, n], got {tuple(gate_up.shape)} and "
                              f"{tuple(out.shape)}")
    if _use_cuda(gate_up):
        cuda_ext.load_extension().silu_mul(out, gate_up)
        return
    native = _native(gate_up)
    if native is not None and native.silu_mul(out, gate_up):
        return
    layer_reference.silu_mul(out, gate_up)
