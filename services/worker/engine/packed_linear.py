"""oneDNN-packed weights for the linear layers of a model served on the CPU.

torch runs a float32 `nn.Linear` on the CPU through MKL's sgemm. On the development
machine (AMD EPYC, one thread) that reached 26-94 GFLOPS, least for the few rows of a
decode step (7 rows: 40 GFLOPS); the same products through oneDNN, with each weight
reordered once into its blocked layout, reached 31-110 (7 rows: 100). A forward pass is
mostly these products, so the engine reorders each linear weight once and runs the
layer as ``torch.ops.mkldnn._linear_pointwise``, the op that torch.compile's CPU
"freezing" pass emits for the same purpose. The weights' values and the float32
arithmetic are unchanged; sums are accumulated in another order, so results may differ
from MKL's in the last bits, as they already do between batch sizes.

The packed tensor replaces the weight: the parameter keeps its name, dtype and device
but its storage is released, so memory stays what it was and the engine counts the
packed bytes as weights. The model keeps working for inference (its linear layers run
on the packed weights), but its `state_dict` no longer holds those weights: the engine
owns the model. Weights tied to another module (an `lm_head` sharing the embedding
matrix) are left alone, since the other module still reads them.
"""

from __future__ import annotations

import types
from collections import Counter
from typing import Any

import torch

PACKABLE_DTYPES = (torch.float32,)
"""Measured to gain; oneDNN also packs bfloat16, not measured here."""

EXACT_ROWS = 64
"""Products of up to this many rows run at their exact size (`get_bucket_rows`)."""

_PACKED_ATTR = "_shoal_packed_weight"


def is_available() -> bool:
    """Whether this torch build has the oneDNN linear ops."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Run each packable `nn.Linear` of `model` on a oneDNN-packed copy of its weight.

    Packable: exactly `nn.Linear`, on the CPU, float32, its weight used by no other
    module. Packing twice packs nothing more.

    Returns:
        Bytes of all packed weights of `model` (what their parameters no longer hold).
    """
    if not is_available():
        return 0
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            type(module) is torch.nn.Linear
            and not hasattr(module, _PACKED_ATTR)
            and weight is not None
            and weight.device.type == "cpu"
            and weight.dtype in PACKABLE_DTYPES
            and uses[id(weight)] == 1
        ):
            _pack(module)
    return get_packed_bytes(model)


_WARMED_ROWS_ATTR = "_shoal_warmed_rows"


def warm_up(model: torch.nn.Module, max_rows: int) -> int:
    """Has oneDNN build its kernels for products of 1..`max_rows` rows (decode steps) now.

    Each (rows, weight shape) pair costs 0.5-1.4 ms the first time (`get_bucket_rows`);
    without this the first decode steps of each batch size pay it. One product per
    distinct weight shape and row count, on zeros.

    Remembered on the model: a model already warmed for as many rows (a replica woken after a
    park, in the same process) runs nothing.

    Returns:
        Products run.
    """
    if getattr(model, _WARMED_ROWS_ATTR, 0) >= max_rows:
        return 0
    shapes: dict[tuple[int, int, bool], torch.nn.Linear] = {}
    for module in model.modules():
        packed = getattr(module, _PACKED_ATTR, None)
        if packed is not None and isinstance(module, torch.nn.Linear):
            key = (module.in_features, module.out_features, module.bias is not None)
            shapes.setdefault(key, module)
    with torch.inference_mode():
        for (in_features, _, _), module in shapes.items():
            for num_rows in range(1, max_rows + 1):
                module(torch.zeros((num_rows, in_features), dtype=module.weight.dtype))
    if shapes:
        setattr(model, _WARMED_ROWS_ATTR, max_rows)
    return len(shapes) * max_rows


def get_packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the packed weights held by `model`'s linear layers."""
    packed = (getattr(module, _PACKED_ATTR, None) for module in model.modules())
    return sum(t.numel() * t.element_size() for t in packed if t is not None)


def _pack(module: torch.nn.Linear) -> None:
    weight = module.weight
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    bias = None if module.bias is None else module.bias.detach()
    setattr(module, _PACKED_ATTR, packed)
    module.forward = types.MethodType(_make_forward(packed, bias), module)  # type: ignore[method-assign]
    weight.data = weight.data.new_empty(0)  # the packed copy is the weight now


def get_bucket_rows(num_rows: int) -> int:
    """The row count a product of `num_rows` rows runs at (at least `num_rows`).

    oneDNN builds a kernel per input shape, 0.5-1.4 ms the first time a row count
    appears (measured; as long as a small model's whole layer), and caches 1024 of them.
    Up to `EXACT_ROWS` rows (a decode step: one row per sequence) the count is exact;
    above, it is rounded up to one of 16 sizes per power of two (at most 6.25% more
    rows), so an engine meets a bounded set of shapes however its prefill chunks fall:
    144 row counts up to 2048 tokens, times a model's few distinct weight shapes.
    """
    if num_rows <= EXACT_ROWS:
        return num_rows
    step = 1 << (num_rows.bit_length() - 5)  # 16 sizes per power of two
    return -(-num_rows // step) * step


def _make_forward(packed: torch.Tensor, bias: torch.Tensor | None) -> Any:
    def forward(self: torch.nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
        in_features = hidden_states.shape[-1]
        num_rows = hidden_states.numel() // in_features if in_features else 0
        bucket_rows = get_bucket_rows(num_rows)
        if bucket_rows == num_rows:
            return torch.ops.mkldnn._linear_pointwise(hidden_states, packed, bias, "none", [], "")
        rows = hidden_states.new_empty((bucket_rows, in_features))
        rows[:num_rows] = hidden_states.reshape(num_rows, in_features)
        rows[num_rows:].zero_()  # computed and dropped; zeros keep them cheap and finite
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        return out[:num_rows].view(*hidden_states.shape[:-1], out.shape[-1])

    return forward
