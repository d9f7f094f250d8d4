"""The torch reference of the fused layer ops (`shoal.kernels.layer_ops`): transformers'
own arithmetic, op by op, so that the native CPU code and the CUDA kernels are tested
against what the model would compute without them.

* `rms_norm`: LlamaRMSNorm (float32 inside, ``weight * x.to(dtype)``), after the
  decoder layer's residual add (``residual + x`` in the model's dtype).
* `rotary_embedding`: ``apply_rotary_pos_emb``'s ``q * cos + rotate_half(q) * sin``.
* `silu_mul`: LlamaMLP's ``act_fn(gate) * up`` with ``act_fn`` SiLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> None:
    """out = weight * norm(x), or with `residual`: residual += x, then out = weight * norm(residual)."""
    if residual is not None:
        residual.copy_(residual + x)
        x = residual
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    out.copy_(weight * hidden.to(x.dtype))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """query [tokens, heads, head_dim] and key [tokens, kv_heads, head_dim] rotated in place by
    each token's cos and sin [tokens, head_dim]."""
    cos, sin = cos[:, None, :].to(query.dtype), sin[:, None, :].to(query.dtype)
    query.copy_(query * cos + rotate_half(query) * sin)
    key.copy_(key * cos + rotate_half(key) * sin)


def silu_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """out [rows, n] = silu(gate_up[:, :n]) * gate_up[:, n:]."""
    n = gate_up.shape[1] // 2
    out.copy_(F.silu(gate_up[:, :n]) * gate_up[:, n:])
