"""The engine's native forward pass on the CPU: a Hugging Face Llama, Mistral or Qwen2 model's
float32 weights, packed once, run by Shoal's C code (`shoal.kernels.cpu_model`) instead of
the model's modules.

A decode step of a small model is mostly not arithmetic when it runs through transformers:
~60 torch ops per layer, each dispatched from Python, of which 7 are products (the
profile in docs/engine.md). Here a whole pass is one call: every layer's products on
packed panels, RMSNorm with the residual add, rotary embedding, SiLU * up, the K/V write
and the attention, on the library's own threads: decode rows by the native decode kernel,
prefill rows of any length by the tiled causal kernel (cpu_prefill_attention.c). Only with
`NATIVE_LONG_PREFILL` off, or a cache the kernels do not take, does a batch with long
prefills call back into Python once per layer for its attention (the torch prefill attention
of `shoal.kernels.reference`).

Exact in the sense the engine's tests hold it to: the arithmetic is Hugging Face's in
float32; products sum in another order than MKL's, as the oneDNN-packed weights did.

`get_unsupported_reason` says why a model stays on the transformers path (another
architecture or dtype, a rotary type that depends on the sequence length, a head size the
native attention does not take, no native library).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.kernels import cpu_kernels, reference
from shoal.kernels.attention_plan import AttentionPlan
from shoal.kernels.cpu_kernels import DecodePlan
from shoal.kernels.cpu_model import (
    LayerWeights,
    ModelWeights,
    PackedLinear,
    PrefillPlan,
    StepBuffers,
    rest_threads,
    run_forward,
)
from shoal.services.worker.engine.attention import PagedBatch
from shoal.shared.model_memory import LLAMA_LIKE_MODEL_TYPES

SUPPORTED_MODEL_TYPES = LLAMA_LIKE_MODEL_TYPES
"""The memory estimate sizes these the way this forward runs them (`get_model_shape`)."""
_UNSUPPORTED_ROPE_TYPES = frozenset({"dynamic", "longrope"})
"""Rotary types whose frequencies depend on the sequence length (`dynamic_rope_update`):
a table computed once would not hold them."""
BUFFER_ROWS_STEP = 64
"""Activation buffers grow to the largest pass seen, in steps of this many rows."""
MAX_NATIVE_PREFILL_SCORES = 128 * 128
"""A pass whose prefills each have at most this many (query row, position) pairs attends
every prefill row as a sequence that ends at its position (the decode kernel); longer
prefills run the tiled causal kernel, which reuses each K/V row across a tile of query rows
(docs/engine.md). Both inside the pass, no Python callback."""
NATIVE_LONG_PREFILL = True
"""Longer prefills too run natively, by the tiled causal attention of cpu_prefill_attention.c
(the whole pass one C call); False: through the torch callback (benchmarks compare both)."""
LAST_LAYER_WANTED_ROWS_ONLY = True
"""With native attention, the last layer past its K/V write runs only for the rows whose
logits are wanted (a prefill's last row; none for a chunk that does not end its prompt):
cpu_model.c's tail. False: for every row (benchmarks and tests compare both)."""


def get_unsupported_reason(model: Any) -> str | None:
    """Why the native forward cannot run `model` (None: it can)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} (native: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        return f"weights are {parameter.dtype} on {parameter.device} (native: float32 on the CPU)"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} (native: silu)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in _UNSUPPORTED_ROPE_TYPES:
        return f"rotary type {rope_type!r} depends on the sequence length"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 16:
        return f"head_dim {head_dim} is not a multiple of 16 (the native decode attention's step)"
    if config.intermediate_size % 16:
        return f"intermediate_size {config.intermediate_size} is not a multiple of 16"
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) and any(kind != "full_attention" for kind in layer_types):
        return "sliding-window layers"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
        return "not a decoder with model.layers and model.rotary_emb"
    kernels = cpu_kernels.try_load()
    if kernels is None:
        return "the native CPU library is not available (or the setting cpu = 'torch')"
    if not kernels.decode_attention_enabled:
        return "the setting cpu_attention = 'torch'"
    return None


@dataclass
class PackedModel:
    """A model's weights in the native layout, before they are bound to a KV pool."""

    kernels: cpu_kernels.CpuKernels
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    embedding: torch.Tensor
    final_norm: torch.Tensor
    lm_head: PackedLinear | None
    """None when tied to the embedding: the logits are then a torch product with it."""
    inv_freq: torch.Tensor
    rope_scaling: float
    layers: list[LayerWeights]

    @property
    def linears(self) -> list[PackedLinear]:
        """Every packed product: each layer's q/k/v, o, gate/up and down, then an untied lm_head."""
        linears = [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if self.lm_head is not None:
            linears.append(self.lm_head)
        return linears

    @property
    def nbytes(self) -> int:
        """Bytes this holds that the model's parameters no longer do: the packed products and
        their biases (the embedding, norms and rotary frequencies stay the model's)."""
        return sum(p.nbytes for p in self.linears)


_PACKED_ATTR = "_shoal_native_packed"


def get_packed_model(model: Any) -> PackedModel | None:
    """The `PackedModel` `pack_model` (or a packed load) attached to `model`, if any."""
    return getattr(model, _PACKED_ATTR, None)


def pack_model(model: Any) -> PackedModel:
    """Packs `model`'s products for the native forward and releases their parameters' storage
    (the packed panels are the weights now: the model no longer runs by itself). A model
    packed before returns the same `PackedModel` (several engines may share one model).

    Raises:
        ValueError: `get_unsupported_reason` has one.
    """
    packed = get_packed_model(model)
    if packed is not None:
        return packed
    reason = get_unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"the native forward does not run this model: {reason}")
    kernels = cpu_kernels.try_load()
    assert kernels is not None
    inner = model.model

    def pack(modules: list[Any], *, silu_mul: bool = False) -> PackedLinear:
        weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
        biases = [m.bias for m in modules]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([
                b.detach() if b is not None else torch.zeros(m.out_features) for b, m in zip(biases, modules, strict=True)
            ])
        packed = PackedLinear(kernels, weight, bias, silu_mul=silu_mul)
        for module in modules:
            _release(module.weight)
            if module.bias is not None:
                _release(module.bias)
        return packed

    layers = []
    with torch.no_grad():
        for layer in inner.layers:
            attention, mlp = layer.self_attn, layer.mlp
            layers.append(LayerWeights(
                input_norm=layer.input_layernorm.weight.detach(),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                qkv=pack([attention.q_proj, attention.k_proj, attention.v_proj]),
                o=pack([attention.o_proj]),
                gate_up=pack([mlp.gate_proj, mlp.up_proj], silu_mul=True),
                down=pack([mlp.down_proj]),
            ))
        embedding = inner.embed_tokens.weight.detach()
        tied = model.lm_head.weight.data_ptr() == embedding.data_ptr()
        lm_head = None if tied else pack([model.lm_head])
    return attach_packed_model(model, layers, lm_head)


def attach_packed_model(model: Any, layers: list[LayerWeights], lm_head: PackedLinear | None) -> PackedModel:
    """Records `layers` and `lm_head` (None: tied to the embedding), packed from `model`'s
    weights, as its `PackedModel`, which `pack_model` returns from then on; the embedding,
    norms and rotary frequencies are the model's. `pack_model` packs from the parameters;
    `packed_load` straight from the weights file."""
    kernels = cpu_kernels.try_load()
    assert kernels is not None, "weights are packed only where the native library is loaded"
    config, inner = model.config, model.model
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    packed = PackedModel(
        kernels=kernels,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        eps=float(inner.norm.variance_epsilon),
        embedding=inner.embed_tokens.weight.detach(),
        final_norm=inner.norm.weight.detach(),
        lm_head=lm_head,
        inv_freq=inner.rotary_emb.inv_freq.detach().to(torch.float32).contiguous(),
        rope_scaling=float(inner.rotary_emb.attention_scaling),
        layers=layers,
    )
    setattr(model, _PACKED_ATTR, packed)
    return packed


def _release(parameter: torch.nn.Parameter) -> None:
    parameter.data = parameter.data.new_empty(0)


def get_available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadPolicy:
    """How many threads a pass takes: `fixed` when set, else ("auto") one thread for a pass
    whose products are too small to share, `max_threads` for the rest.

    Measured on the 2-core development VM, idle (docs/engine.md, "Threads"): two threads
    took llama-100m's decode step of one sequence from 10.3 to 6.0 ms (its 372 MB of weights
    stream from memory at ~60 GB/s on two cores, ~36 on one), llama-5m's of 8 sequences from
    0.49 to 0.31 ms, and left llama-5m's single sequence (0.74 M multiply-adds per layer) at
    0.19 ms, where a second thread only adds claims and cache-line transfers. Work is
    claimed item by item (cpu_threads.c): a second thread that the event loop or NATS holds
    costs the pass little.
    """

    max_threads: int
    fixed: int | None = None
    min_shared_multiply_adds: int = 2_000_000
    """Multiply-adds per layer below which a pass runs on one thread (auto)."""

    def get_num_threads(self, num_tokens: int, multiply_adds_per_token: int) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.max_threads <= 1 or num_tokens * multiply_adds_per_token < self.min_shared_multiply_adds:
            return 1
        return self.max_threads


class NativeForward:
    """Runs prepared steps through the packed model over the engine's KV pool.

    Args:
        packed: from `pack_model`.
        layer_caches: each layer's (key, value) cache views of the engine's KV tensor.
        threads: the thread policy.
    """

    def __init__(
        self, packed: PackedModel, layer_caches: list[tuple[torch.Tensor, torch.Tensor]], threads: ThreadPolicy
    ) -> None:
        self.packed = packed
        self.weights = ModelWeights(
            kernels=packed.kernels,
            num_heads=packed.num_heads,
            num_kv_heads=packed.num_kv_heads,
            head_dim=packed.head_dim,
            eps=packed.eps,
            scale=packed.head_dim**-0.5,
            embedding=packed.embedding,
            final_norm=packed.final_norm,
            lm_head=packed.lm_head,
            inv_freq=packed.inv_freq,
            rope_scaling=packed.rope_scaling,
            layers=packed.layers,
            layer_caches=layer_caches,
        )
        self.layer_caches = layer_caches
        self.threads = threads
        hidden = packed.embedding.shape[1]
        layer = packed.layers[0]
        self.multiply_adds_per_token = hidden * (layer.qkv.num_out + layer.gate_up.num_out * 2) + (
            layer.o.num_in * hidden + layer.down.num_in * hidden
        )
        """Per layer (the products)."""
        self._buffers: StepBuffers | None = None
        self._rows = torch.arange(0)
        self.last_argmax: torch.Tensor | None = None
        """int64 [rows kept]: the last pass's most likely token per row (None without an
        lm_head of its own: tied to the embedding, the logits are a torch product)."""
        self.last_hidden: torch.Tensor | None = None
        """The last pass's final (normed) hidden state per logits row: a view of a buffer the
        next pass overwrites."""

    def rest(self) -> None:
        """No pass comes soon: the forward's helper threads sleep now (`rest_threads`)."""
        rest_threads(self.packed.kernels)

    def _plan_rows(self, plan: AttentionPlan, num_tokens: int) -> DecodePlan | None:
        """Every row of the batch as a native decode entry: a decode row as it is, a prefill
        row as its sequence cut after the row's position (causal attention, row by row)."""
        batch = plan.decode_sequences
        tables: list[Sequence[int]] = []
        lens: list[int] = []
        rows: list[int] = []
        for seq, seq_len in enumerate(batch.seq_lens):
            start, end = batch.query_start_loc[seq], batch.query_start_loc[seq + 1]
            first_position = seq_len - (end - start)
            table = batch.block_tables[seq]
            for row in range(start, end):
                tables.append(table)
                lens.append(first_position + row - start + 1)
                rows.append(row)
        if len(rows) != num_tokens:
            return None
        return self.packed.kernels.plan_decode(batch.key_cache, tables, lens, rows)

    def _get_buffers(self, num_tokens: int, num_logit_rows: int) -> StepBuffers:
        buffers = self._buffers
        if buffers is None or buffers.num_tokens < num_tokens or buffers.num_logit_rows < num_logit_rows:
            rows = -(-max(num_tokens, buffers.num_tokens if buffers else 0) // BUFFER_ROWS_STEP) * BUFFER_ROWS_STEP
            logit_rows = max(num_logit_rows, buffers.num_logit_rows if buffers else 0, 1)
            self._buffers = buffers = StepBuffers.allocate(self.weights, rows, logit_rows)
            self._rows = torch.arange(rows, dtype=torch.int64)
        return buffers

    def execute(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        batch: PagedBatch,
        logits_to_keep: int | torch.Tensor,
    ) -> torch.Tensor:
        """Logits [rows kept, vocab] of one pass (the model call's `output.logits[0]`): a view
        of a buffer that the next pass overwrites."""
        plan = batch.cpu_plan
        assert plan is not None and batch.slot_mapping is not None, "the native forward runs the CPU path's batches"
        token_ids, positions = input_ids[0], position_ids[0]
        num_tokens = token_ids.shape[0]
        num_logit_rows = num_tokens if isinstance(logits_to_keep, int) else logits_to_keep.shape[0]
        buffers = self._get_buffers(num_tokens, num_logit_rows)
        logit_rows = self._rows[:num_tokens] if isinstance(logits_to_keep, int) else logits_to_keep
        native = plan.native_decode
        decode_address, rows_are_sequences, prefill = None, True, None
        if not plan.prefills and native is not None and native.num_seqs == num_tokens:
            decode_address = native.address
        elif plan.prefills and all(p.num_queries * p.seq_len <= MAX_NATIVE_PREFILL_SCORES for p in plan.prefills):
            native = self._plan_rows(plan, num_tokens)
            if native is not None:
                decode_address, rows_are_sequences = native.address, False
        elif plan.prefills and NATIVE_LONG_PREFILL:
            sequences = plan.decode_sequences
            prefill = PrefillPlan.build(
                self.packed.kernels, sequences.key_cache, sequences.block_tables, sequences.seq_lens,
                sequences.query_start_loc,
            )
        weights = self.weights
        heads, kv_heads, head_dim = weights.num_heads, weights.num_kv_heads, weights.head_dim
        num_threads = self.threads.get_num_threads(num_tokens, self.multiply_adds_per_token)

        def attend(layer: int) -> None:  # on whichever of the forward's threads claims it
            previous = torch.get_num_threads()  # per thread: the others wait for this phase
            torch.set_num_threads(num_threads)
            try:
                with torch.inference_mode():
                    attend_layer(layer)
            finally:
                torch.set_num_threads(previous)

        def attend_layer(layer: int) -> None:
            if batch.before_attention is not None:
                batch.before_attention(layer)
            qkv = buffers.qkv[:num_tokens]
            query = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
            key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
            value = qkv[:, (heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
            out = buffers.attn[:num_tokens].view(num_tokens, heads, head_dim)
            key_cache, value_cache = self.layer_caches[layer]
            reference.run_attention(out, query, key_cache, value_cache, plan, weights.scale, key, value)

        if (decode_address is not None or prefill is not None) and batch.before_attention is not None:
            # The attention runs inside the C pass, with no call per layer: every layer's
            # copies back from the host pool are waited for first.
            batch.before_attention(len(self.layer_caches) - 1)
        run_forward(
            weights,
            buffers,
            token_ids=token_ids,
            positions=positions,
            slot_mapping=batch.slot_mapping,
            logit_rows=logit_rows,
            decode_plan_address=decode_address,
            attend=None if decode_address is not None or prefill is not None else attend,
            num_threads=num_threads,
            decode_rows_are_sequences=rows_are_sequences,
            prefill=prefill,
            whole_last_layer=not LAST_LAYER_WANTED_ROWS_ONLY,
        )
        self.last_hidden = buffers.final_rows[:num_logit_rows]
        if buffers.logits is not None:
            self.last_argmax = buffers.argmax[:num_logit_rows]
            return buffers.logits[:num_logit_rows]
        self.last_argmax = None
        return torch.nn.functional.linear(buffers.final_rows[:num_logit_rows], weights.embedding)
