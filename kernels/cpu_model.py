"""ctypes bindings of the native library's model forward (kernels/csrc/cpu_model.c) and of
its packed float32 products (cpu_gemm.c).

`PackedLinear` holds one weight in the products' panel layout; `ModelWeights` holds a
decoder's packed weights and the C structure that describes them; `run_forward` runs one
batch through every layer. The engine's adapter from a Hugging Face model to these is
`shoal.services.worker.engine.native_forward`. Everything here is float32 on the CPU, except
that a product's panels may hold its weights as bfloat16 (`PANEL_DTYPES`): they are widened to
float32 in registers, and the arithmetic stays float32.
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shoal.kernels.cpu_kernels import CpuKernels, DecodePlan

PANEL = 32
"""Output columns per packed panel (cpu_model.h's SHOAL_PANEL)."""
EPILOGUE_STORE, EPILOGUE_SILU_MUL = 0, 1
WEIGHTS_F32, WEIGHTS_BF16 = 0, 1
PANEL_DTYPES = {torch.float32: WEIGHTS_F32, torch.bfloat16: WEIGHTS_BF16}
"""The panels' element types (cpu_model.h's SHOAL_WEIGHTS_*): float32, or bfloat16 in words of
two columns (column j and j + 16 of a panel's step), half the bytes."""
ISA_BEST, ISA_GENERIC, ISA_AVX2, ISA_AVX512 = -1, 0, 1, 2
ISA_NAMES = {ISA_GENERIC: "generic", ISA_AVX2: "avx2", ISA_AVX512: "avx512"}

_FORWARD_ERRORS = {
    -2: "a token id is outside the vocabulary",
    -3: "a position is negative",
    -4: "a slot is outside the KV cache",
    -5: "the decode plan does not match the batch or the cache",
    -6: "a logit row is outside the batch",
    -7: "no memory for the attention's scratch",
    -8: "the batch is empty or has no attention",
}

_i64, _ptr, _f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
AttendCallback = ctypes.CFUNCTYPE(None, ctypes.c_int64)


class _Linear(ctypes.Structure):
    """cpu_model.h's ``struct shoal_linear``."""

    _fields_ = [("panels", _ptr), ("bias", _ptr), ("num_out", _i64), ("num_in", _i64), ("epilogue", _i64),
                ("dtype", _i64)]


class _LayerWeights(ctypes.Structure):
    """cpu_model.c's ``struct shoal_layer_weights``."""

    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("key_cache", _ptr),
        ("value_cache", _ptr),
    ]


class _Model(ctypes.Structure):
    """cpu_model.c's ``struct shoal_model``."""

    _fields_ = [
        ("num_layers", _i64),
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("vocab", _i64),
        ("eps", _f64),
        ("scale", _f64),
        ("embedding", _ptr),
        ("final_norm", _ptr),
        ("lm_head", _ptr),
        ("inv_freq", _ptr),
        ("rope_scaling", _f64),
        ("num_slots", _i64),
        ("layers", _ptr),
    ]


class _Step(ctypes.Structure):
    """cpu_model.c's ``struct shoal_step``."""

    _fields_ = [
        ("num_tokens", _i64),
        ("token_ids", _ptr),
        ("positions", _ptr),
        ("slot_mapping", _ptr),
        ("decode", _ptr),
        ("decode_rows_are_sequences", _i64),
        ("attend", AttendCallback),
        ("num_logit_rows", _i64),
        ("logit_rows", _ptr),
        ("rope", _ptr),
        ("hidden", _ptr),
        ("delta", _ptr),
        ("normed", _ptr),
        ("qkv", _ptr),
        ("attn", _ptr),
        ("act", _ptr),
        ("final_rows", _ptr),
        ("logits", _ptr),
        ("argmax", _ptr),
        ("num_threads", _i64),
        ("prefill_num_queries", _ptr),
        ("whole_last_layer", _i64),
    ]


_bound: set[int] = set()


def _bind(library: ctypes.CDLL) -> None:
    """Declares the model functions' signatures on a loaded library (once)."""
    if id(library) in _bound:
        return
    library.shoal_pack_linear.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
    library.shoal_pack_linear.restype = None
    library.shoal_pack_linear_bf16.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr]
    library.shoal_pack_linear_bf16.restype = None
    library.shoal_linear_forward.argtypes = [_ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64]
    library.shoal_linear_forward.restype = _i64
    library.shoal_model_forward.argtypes = [_ptr, _ptr]
    library.shoal_model_forward.restype = _i64
    library.shoal_gemm_isa.argtypes = []
    library.shoal_gemm_isa.restype = _i64
    library.shoal_rest_threads.argtypes = []
    library.shoal_rest_threads.restype = None
    library.shoal_thread_stats.argtypes = [_ptr]
    library.shoal_thread_stats.restype = None
    library.shoal_prefill_attention.argtypes = [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _f64,
                                                _i64, _i64]
    library.shoal_prefill_attention.restype = _i64
    _bound.add(id(library))


def get_gemm_isa(kernels: CpuKernels) -> int:
    """The products' code path on this CPU: `ISA_AVX512`, `ISA_AVX2` or `ISA_GENERIC`."""
    _bind(kernels.library)
    return int(kernels.library.shoal_gemm_isa())


def rest_threads(kernels: CpuKernels) -> None:
    """Lets the forward's idle helper threads sleep now rather than keep their cores looking for
    the next pass: call it when none comes soon (the engine has nothing to run)."""
    _bind(kernels.library)
    kernels.library.shoal_rest_threads()


@dataclass(frozen=True)
class ThreadStats:
    """The native forward's helper threads, counted since the library was loaded."""

    num_helpers: int
    """Helper threads started (each pass uses the caller and up to ``num_threads - 1`` of them)."""
    num_shared_programs: int
    """Passes (or products) posted to the helpers."""
    num_idle_told: int
    """Helpers' idle waits that ended asleep because they were told to rest (`rest_threads`,
    or a pass run on one thread)."""
    num_idle_timed_out: int
    """Helpers' idle waits that ended asleep after looking for the next pass for their whole
    idle window (~2 ms)."""


def get_thread_stats(kernels: CpuKernels) -> ThreadStats:
    """The library's thread counters (`ThreadStats`)."""
    _bind(kernels.library)
    values = (ctypes.c_int64 * 4)()
    kernels.library.shoal_thread_stats(values)
    return ThreadStats(*(int(v) for v in values))


def pack_into(kernels: CpuKernels, weight: torch.Tensor, panels: torch.Tensor, *, silu_mul: bool = False) -> None:
    """Writes `weight` [num_out, num_in] (contiguous, on the CPU) into `panels` in the products'
    layout, as `PackedLinear` packs it: float32 `panels` (a float32 weight) hold at least
    ceil(num_out / PANEL) * num_in * PANEL contiguous floats; bfloat16 `panels` as many
    bfloat16 (the weight float32, rounded to nearest even, or bfloat16, taken as it is).
    ctypes lets go of the GIL for the copy: several threads may pack at once
    (`engine.packed_load`)."""
    bf16_panels = panels.dtype == torch.bfloat16
    weight_dtypes = (torch.float32, torch.bfloat16) if bf16_panels else (torch.float32,)
    if weight.dtype not in weight_dtypes or weight.dim() != 2 or not weight.is_cpu or not weight.is_contiguous():
        raise ValueError(f"pack_into takes a contiguous float32 CPU matrix, got {weight.dtype} {tuple(weight.shape)}")
    num_out, num_in = weight.shape
    if panels.dtype not in PANEL_DTYPES or not panels.is_contiguous() or (
        panels.numel() < -(-num_out // PANEL) * num_in * PANEL
    ):
        raise ValueError(f"panels too small for a [{num_out}, {num_in}] weight (or not float32 / bfloat16)")
    if silu_mul and (num_out % 32 or num_out == 0):
        raise ValueError(f"a gate/up weight needs 2 x a multiple of 16 rows, got {num_out}")
    _bind(kernels.library)
    epilogue = EPILOGUE_SILU_MUL if silu_mul else EPILOGUE_STORE
    if bf16_panels:
        kernels.library.shoal_pack_linear_bf16(
            weight.data_ptr(), int(weight.dtype == torch.bfloat16), num_out, num_in, epilogue, panels.data_ptr()
        )
    else:
        kernels.library.shoal_pack_linear(weight.data_ptr(), num_out, num_in, epilogue, panels.data_ptr())


class PackedLinear:
    """A float32 weight [num_out, num_in] (and bias) in the products' panel layout.

    Args:
        kernels: the loaded native library.
        weight: [num_out, num_in]; with `silu_mul`, the gate rows then the up rows
            ([2 x intermediate, num_in], intermediate a multiple of 16): the product then
            returns SiLU(gate) * up, [rows, intermediate].
        bias: [num_out] or None.
        panel_dtype: float32, or bfloat16: the panels hold the weight rounded to bfloat16
            (a bfloat16 `weight` as it is), and the product is float32 arithmetic on those
            values.
    """

    def __init__(
        self,
        kernels: CpuKernels,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        silu_mul: bool = False,
        panel_dtype: torch.dtype = torch.float32,
    ) -> None:
        library = kernels.library
        _bind(library)
        if panel_dtype not in PANEL_DTYPES:
            raise ValueError(f"panels are float32 or bfloat16, not {panel_dtype}")
        if weight.dtype != torch.float32 and not (weight.dtype == torch.bfloat16 == panel_dtype):
            raise ValueError(f"PackedLinear takes a float32 CPU matrix, got {weight.dtype} {tuple(weight.shape)}")
        if weight.dim() != 2 or not weight.is_cpu:
            raise ValueError(f"PackedLinear takes a float32 CPU matrix, got {weight.dtype} {tuple(weight.shape)}")
        num_out, num_in = weight.shape
        if silu_mul and (num_out % 32 or num_out == 0):
            raise ValueError(f"a gate/up weight needs 2 x a multiple of 16 rows, got {num_out}")
        weight = weight.contiguous()
        num_panels = -(-num_out // PANEL)
        self.panels = torch.empty(num_panels * num_in * PANEL, dtype=panel_dtype)
        pack_into(kernels, weight, self.panels, silu_mul=silu_mul)
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous().clone()
        if self.bias is not None and self.bias.shape != (num_out,):
            raise ValueError(f"bias must be [{num_out}], got {tuple(self.bias.shape)}")
        self.num_in = num_in
        self.num_out = num_out // 2 if silu_mul else num_out
        """Columns of the product's result."""
        self.struct = _Linear(
            self.panels.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            num_out,
            num_in,
            EPILOGUE_SILU_MUL if silu_mul else EPILOGUE_STORE,
            PANEL_DTYPES[panel_dtype],
        )
        self._library = library

    @classmethod
    def from_panels(
        cls,
        kernels: CpuKernels,
        panels: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        num_out: int,
        num_in: int,
        epilogue: int = EPILOGUE_STORE,
    ) -> PackedLinear:
        """A weight already in the panel layout (`engine.packed_load` fills it straight from a
        weights file): `panels` float32 or bfloat16, contiguous, as `pack_into` writes them for
        `num_out` weight rows of `num_in`; `bias` [num_out] float32 contiguous or None. Both
        are used as they are (not copied) and must live as long as this does."""
        _bind(kernels.library)
        if panels.dtype not in PANEL_DTYPES or not panels.is_contiguous() or not panels.is_cpu:
            raise ValueError("panels must be a contiguous float32 or bfloat16 CPU tensor")
        if panels.numel() != -(-num_out // PANEL) * num_in * PANEL:
            raise ValueError(f"{panels.numel()} floats are not the panels of a [{num_out}, {num_in}] weight")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (num_out,) or not bias.is_contiguous()):
            raise ValueError(f"bias must be float32 [{num_out}], contiguous")
        self = cls.__new__(cls)
        self.panels = panels
        self.bias = bias
        self.num_in = num_in
        self.num_out = num_out // 2 if epilogue == EPILOGUE_SILU_MUL else num_out
        self.struct = _Linear(
            panels.data_ptr(), None if bias is None else bias.data_ptr(), num_out, num_in, epilogue,
            PANEL_DTYPES[panels.dtype],
        )
        self._library = kernels.library
        return self

    @property
    def nbytes(self) -> int:
        """Bytes held (panels, padding and bias)."""
        bias_bytes = 0 if self.bias is None else self.bias.numel() * 4
        return self.panels.numel() * self.panels.element_size() + bias_bytes

    def forward(self, x: torch.Tensor, *, num_threads: int = 1, isa: int = ISA_BEST) -> torch.Tensor:
        """x [rows, num_in] float32 (rows contiguous) -> [rows, num_out]: tests and benchmarks.

        Raises:
            ValueError: the tensor does not fit, or `isa` is not available on this CPU.
        """
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.num_in or x.stride(1) != 1:
            raise ValueError(f"expected float32 [rows, {self.num_in}] with contiguous rows, got {tuple(x.shape)}")
        out = torch.empty((x.shape[0], self.num_out), dtype=torch.float32)
        status = self._library.shoal_linear_forward(
            ctypes.addressof(self.struct), x.data_ptr(), x.stride(0), out.data_ptr(), self.num_out, x.shape[0],
            num_threads, isa,
        )
        if status != -1:
            raise ValueError(f"code path {isa} is not available on this CPU")
        return out


@dataclass
class LayerWeights:
    """One decoder layer, packed: what `ModelWeights` points the C structure at."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear


@dataclass
class ModelWeights:
    """A decoder's weights as the native forward reads them, and the C structure over them.

    Tensors must stay alive as long as the structure (they do: this object holds them).
    `layer_caches` are each layer's (key, value) caches [num_blocks, block_size, kv_heads,
    head_dim], contiguous float32.
    """

    kernels: CpuKernels
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    embedding: torch.Tensor
    final_norm: torch.Tensor
    lm_head: PackedLinear | None
    inv_freq: torch.Tensor
    """float32 [head_dim / 2]: the rotary frequencies (transformers' ``rotary_emb.inv_freq``)."""
    rope_scaling: float
    """The rotary embedding's ``attention_scaling`` (1.0 for most types)."""
    layers: list[LayerWeights]
    layer_caches: list[tuple[torch.Tensor, torch.Tensor]]
    struct: _Model = field(init=False)
    _layer_structs: ctypes.Array[_LayerWeights] = field(init=False)

    def __post_init__(self) -> None:
        _bind(self.kernels.library)
        assert self.inv_freq.dtype == torch.float32 and self.inv_freq.shape == (self.head_dim // 2,)
        assert self.inv_freq.is_contiguous()
        key_cache = self.layer_caches[0][0]
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        for key, value in self.layer_caches:
            assert key.is_contiguous() and value.is_contiguous() and key.dtype == torch.float32
            assert key.shape == (key_cache.shape[0], key_cache.shape[1], self.num_kv_heads, self.head_dim)
            assert value.shape == key.shape
        array_type = _LayerWeights * len(self.layers)
        self._layer_structs = array_type(*(
            _LayerWeights(
                layer.input_norm.data_ptr(),
                layer.post_norm.data_ptr(),
                layer.qkv.struct,
                layer.o.struct,
                layer.gate_up.struct,
                layer.down.struct,
                key.data_ptr(),
                value.data_ptr(),
            )
            for layer, (key, value) in zip(self.layers, self.layer_caches, strict=True)
        ))
        hidden = self.embedding.shape[1]
        self.struct = _Model(
            len(self.layers),
            hidden,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.layers[0].gate_up.num_out,
            self.embedding.shape[0],
            self.eps,
            self.scale,
            self.embedding.data_ptr(),
            self.final_norm.data_ptr(),
            None if self.lm_head is None else ctypes.addressof(self.lm_head.struct),
            self.inv_freq.data_ptr(),
            self.rope_scaling,
            num_slots,
            ctypes.addressof(self._layer_structs),
        )

    @property
    def hidden_size(self) -> int:
        return int(self.embedding.shape[1])

    @property
    def intermediate_size(self) -> int:
        return self.layers[0].gate_up.num_out

    @property
    def vocab_size(self) -> int:
        return int(self.embedding.shape[0])


@dataclass(frozen=True, eq=False)
class PrefillPlan:
    """A batch's sequences for the tiled causal attention (cpu_prefill_attention.c): each
    sequence's query rows are the last `num_queries` of its context, from its entry's row in
    `sequences` (a decode row is a sequence of one query row). Built once per pass."""

    sequences: DecodePlan
    """One entry per sequence: its block table, context length and first query row."""
    num_queries: array.array[int]
    """int32 [num_seqs]."""

    @classmethod
    def build(
        cls,
        kernels: CpuKernels,
        key_cache: torch.Tensor,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_start_loc: Sequence[int],
    ) -> PrefillPlan | None:
        """The plan of a batch (sequences without query rows left out), or None where the
        kernel does not take the cache or the ids (`CpuKernels.plan_decode`)."""
        seqs = [seq for seq in range(len(seq_lens)) if query_start_loc[seq + 1] > query_start_loc[seq]]
        sequences = kernels.plan_decode(
            key_cache,
            [block_tables[seq] for seq in seqs],
            [seq_lens[seq] for seq in seqs],
            [query_start_loc[seq] for seq in seqs],
        )
        if sequences is None or key_cache.dtype != torch.float32:
            return None
        num_queries = array.array("i", [query_start_loc[seq + 1] - query_start_loc[seq] for seq in seqs])
        return cls(sequences, num_queries)

    @property
    def num_queries_address(self) -> int:
        return int(self.num_queries.buffer_info()[0])

    def run(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        *,
        num_threads: int = 1,
        isa: int = ISA_BEST,
    ) -> None:
        """out[t, h] = causal attention of query row t, head h (tests and benchmarks): query and
        out [num_tokens, num_heads, head_dim] float32 (heads and elements contiguous), the
        caches as the plan's.

        Raises:
            ValueError: the tensors or the plan do not fit, or `isa` is not available.
        """
        library = self.sequences.kernels.library
        _bind(library)
        for tensor in (out, query):
            if tensor.dtype != torch.float32 or tensor.dim() != 3 or tensor.stride(2) != 1 or (
                tensor.stride(1) != tensor.shape[2]
            ):
                raise ValueError("query and out must be float32 [tokens, heads, head_dim], heads contiguous")
        for cache in (key_cache, value_cache):
            if tuple(cache.shape) != self.sequences.cache_shape or cache.dtype != torch.float32:
                raise ValueError("the caches do not have the plan's shape")
            if not cache.is_contiguous():
                raise ValueError("the caches must be contiguous")
        if out.shape != query.shape:
            raise ValueError("out and query differ in shape")
        status = library.shoal_prefill_attention(
            self.sequences.address, self.num_queries_address, out.data_ptr(), out.stride(0), query.data_ptr(),
            query.stride(0), query.shape[0], query.shape[1], key_cache.data_ptr(), value_cache.data_ptr(), scale,
            num_threads, isa,
        )
        if status != -1:
            raise ValueError({-2: "the plan does not fit the batch", -3: "out of memory",
                              -4: f"code path {isa} is not available on this CPU"}.get(status, str(status)))


class ForwardError(RuntimeError):
    """The native forward refused a batch (nothing was computed)."""


@dataclass
class StepBuffers:
    """Activations of one forward pass, reused from step to step (float32, contiguous)."""

    rope: torch.Tensor
    hidden: torch.Tensor
    delta: torch.Tensor
    normed: torch.Tensor
    qkv: torch.Tensor
    attn: torch.Tensor
    act: torch.Tensor
    final_rows: torch.Tensor
    logits: torch.Tensor | None
    argmax: torch.Tensor
    """int64 [logit rows]: each row's most likely token (with an lm_head)."""

    @classmethod
    def allocate(cls, weights: ModelWeights, num_tokens: int, num_logit_rows: int) -> StepBuffers:
        h, d = weights.hidden_size, weights.head_dim
        qkv = (weights.num_heads + 2 * weights.num_kv_heads) * d

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=torch.float32)

        return cls(
            rope=empty(num_tokens, d),
            hidden=empty(num_tokens, h),
            delta=empty(num_tokens, h),
            normed=empty(num_tokens, h),
            qkv=empty(num_tokens, qkv),
            attn=empty(num_tokens, weights.num_heads * d),
            act=empty(num_tokens, weights.intermediate_size),
            final_rows=empty(num_logit_rows, h),
            logits=None if weights.lm_head is None else empty(num_logit_rows, weights.vocab_size),
            argmax=torch.empty(num_logit_rows, dtype=torch.int64),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def num_logit_rows(self) -> int:
        return int(self.final_rows.shape[0])


def run_forward(
    weights: ModelWeights,
    buffers: StepBuffers,
    *,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    logit_rows: torch.Tensor,
    decode_plan_address: int | None,
    attend: Callable[[int], None] | None,
    num_threads: int,
    decode_rows_are_sequences: bool = True,
    prefill: PrefillPlan | None = None,
    whole_last_layer: bool = False,
) -> None:
    """One batch through every layer: `buffers.final_rows` (and `buffers.logits` and
    `buffers.argmax` with an lm_head) hold the wanted rows' results after it.

    Args:
        token_ids, positions, slot_mapping: int64 [num_tokens], contiguous.
        logit_rows: int64 [n]: the rows whose final hidden state (and logits) are wanted.
        decode_plan_address: a `DecodePlan` with one entry per row (a decode row, or a prefill
            row planned as a sequence that ends at its position): attention then runs natively;
            None otherwise.
        attend: called with the layer index after that layer's K/V are written, when there is
            no decode plan: fills `buffers.attn` from `buffers.qkv` (the engine's torch
            attention). An exception it raises is re-raised after the pass.
        num_threads: threads for this pass.
        decode_rows_are_sequences: every plan entry is a different sequence's only row (a
            decode step): a row's K/V write and attention run in one phase.
        prefill: instead of a decode plan, every sequence of the batch with its query rows:
            attention then runs natively, by the tiled causal kernel, whatever the lengths.
        whole_last_layer: compute the last layer past its K/V write for every row, not only
            for `logit_rows` (which is what a native-attention pass does otherwise; the
            results differ in the last bits, as decode and prefill attention do).

    Raises:
        ForwardError: the batch was refused (an index out of range).
    """
    num_tokens = token_ids.shape[0]
    assert buffers.num_tokens >= num_tokens and buffers.num_logit_rows >= logit_rows.shape[0]
    errors: list[BaseException] = []
    callback = None
    if prefill is not None:
        assert decode_plan_address is None, "a pass attends by one plan"
        decode_plan_address = prefill.sequences.address
    elif decode_plan_address is None:
        assert attend is not None, "a batch with prefill rows needs the attention callback"
        user = attend

        def call(layer: int) -> None:
            if errors:
                return
            try:
                user(layer)
            except BaseException as error:  # ctypes would print it and drop it
                errors.append(error)

        callback = AttendCallback(call)
    step = _Step(
        num_tokens,
        token_ids.data_ptr(),
        positions.data_ptr(),
        slot_mapping.data_ptr(),
        decode_plan_address,
        int(decode_rows_are_sequences),
        callback if callback is not None else AttendCallback(),
        logit_rows.shape[0],
        logit_rows.data_ptr(),
        buffers.rope.data_ptr(),
        buffers.hidden.data_ptr(),
        buffers.delta.data_ptr(),
        buffers.normed.data_ptr(),
        buffers.qkv.data_ptr(),
        buffers.attn.data_ptr(),
        buffers.act.data_ptr(),
        buffers.final_rows.data_ptr(),
        0 if buffers.logits is None else buffers.logits.data_ptr(),
        0 if buffers.logits is None else buffers.argmax.data_ptr(),
        num_threads,
        None if prefill is None else prefill.num_queries_address,
        int(whole_last_layer),
    )
    status = weights.kernels.library.shoal_model_forward(ctypes.addressof(weights.struct), ctypes.addressof(step))
    if status != -1:
        raise ForwardError(f"native forward refused the batch: {_FORWARD_ERRORS.get(status, status)}")
    if errors:
        raise errors[0]
