"""Shoal's native CPU kernels (kernels/csrc/*.c), loaded with ctypes: the bindings, and
this process's choice of implementation.

Two kernels, one library (built by `shoal.kernels.cpu_build`):

* ``write_kv`` (`cpu_cache_ops.c`): the torch version (`shoal.kernels.reference`) moves
  scattered rows with ordinary stores, and a store to a line that is not in the
  cache reads the line first, so a large write to scattered slots runs at a third
  to a half of a contiguous copy; this C loop can use streaming (non-temporal)
  stores instead.
* paged decode attention (`cpu_attention.c`): one query row per sequence attends
  to its context read straight from the blocks by block table, where the torch
  version first gathers every sequence's blocks into a contiguous copy. Its
  metadata is a `DecodePlan`, built once per forward pass and used by every layer.

Where the library cannot be built or loaded (no compiler, a failed compile, no private
directory to build in), the torch implementation runs instead, with the same
results, and the reason is logged once. The settings (`shoal.kernels.settings`)
choose: ``cpu = "torch"`` forces the torch implementation of both;
``cpu_attention = "torch"`` that of the attention only.
"""

from __future__ import annotations

import array
import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from shoal.kernels import cpu_build
from shoal.kernels.cpu_build import ABI_VERSION, NativeBuildError
from shoal.kernels.settings import KernelSettings, get_settings, on_configure

log = structlog.get_logger(__name__)

STREAM_MIN_BYTES = 1024 * 1024
"""A write of at least this many bytes (K and V, padding included) uses streaming stores,
which skip reading each destination line first but leave the rows out of the cache. Below
it, ordinary stores: a decode step's write (tens to hundreds of KB per layer) then stays in
the cache for the attention that reads it next. About the L2 size: on the 2-core EPYC it
was measured on (1 MB L2 per core, 32 MB L3), streaming is as fast as ordinary stores at
512 KB even into rows already in L3, and faster from 1 MB on (docs/kernels.md)."""


# The element sizes of the contract's dtypes; the C loop moves bytes and needs only these.
_ELEMENT_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
# The attention kernel's dtype codes (cpu_attention.c's DTYPE_*).
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

ISA_BEST, ISA_BASELINE, ISA_AVX2 = 0, 1, 2
"""The attention kernel's code paths (cpu_attention.c's ISA_*): the best this CPU runs,
the baseline (SSE2 on x86-64), AVX2 with FMA (x86-64, chosen at run time)."""
ISA_NAMES = {ISA_BASELINE: "baseline", ISA_AVX2: "avx2"}
ATTENTION_CHUNK = 16
"""The attention kernel takes head_dim in steps of this many elements."""
_DECODE_OK, _DECODE_BAD_GEOMETRY, _DECODE_NO_MEMORY, _DECODE_NO_ISA = -1, -2, -3, -4


class _DecodePlanStruct(ctypes.Structure):
    """cpu_attention.c's ``struct shoal_decode_plan``."""

    _fields_ = [
        ("num_seqs", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("seq_lens", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("dtype", ctypes.c_int64),
    ]


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """The decoding sequences of one forward pass, as the native attention reads them.

    Built once per pass (`CpuKernels.plan_decode`) and used by every layer, whose caches
    must have `cache_shape` and `dtype` (checked on every call). The int32 arrays are
    owned here; the C struct points into them.
    """

    kernels: CpuKernels
    cache_shape: tuple[int, int, int, int]
    """[num_blocks, block_size, num_kv_heads, head_dim] of every layer's key and value cache."""
    dtype: torch.dtype
    num_seqs: int
    block_tables: array.array[int]
    """int32 [num_seqs, table_stride]: each sequence's blocks, padded with 0."""
    seq_lens: array.array[int]
    rows: array.array[int]
    """int32 [num_seqs]: each sequence's query (and output) row."""
    struct: _DecodePlanStruct
    address: int
    """The struct's address, the kernel's first argument."""

    def run(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        *,
        isa: int = ISA_BEST,
    ) -> bool:
        """Decode attention of the plan's sequences into their rows of `out`; see
        `CpuKernels.decode_attention`."""
        return self.kernels.decode_attention(self, out, query, key_cache, value_cache, scale, isa=isa)


class CpuKernels:
    """The loaded library: `write_kv` and decode attention on raw pointers and strides."""

    def __init__(self, library_path: Path, *, decode_attention: bool = True) -> None:
        """Loads a built library.

        Args:
            decode_attention: whether `shoal.kernels.reference` runs the native decode
                attention (False: the torch one; the setting ``cpu_attention = "torch"``).

        Raises:
            NativeBuildError: it cannot be loaded or was built from another signature.
        """
        self.library_path = library_path
        try:
            library = ctypes.CDLL(str(library_path))
            abi = library.shoal_cpu_kernels_abi
            abi.restype = ctypes.c_int64
            streaming = library.shoal_cpu_kernels_streaming
            streaming.restype = ctypes.c_int64
            write_kv = library.shoal_write_kv
            attention = library.shoal_decode_attention
            attention_isa = library.shoal_decode_attention_isa
            copy_between = library.shoal_copy_blocks_between
            rms_norm = library.shoal_rms_norm
            rotary = library.shoal_rotary
            silu_mul = library.shoal_silu_mul
        except (OSError, AttributeError) as error:
            raise NativeBuildError(f"cannot load {library_path}: {error}") from error
        if abi() != ABI_VERSION:
            raise NativeBuildError(f"{library_path} has ABI {abi()}, this module needs {ABI_VERSION}")
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        write_kv.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
        write_kv.restype = i64
        attention.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_double, i64]
        attention.restype = i64
        attention_isa.restype = i64
        copy_between.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, i64, i64, i64]
        copy_between.restype = i64
        self._copy_between = copy_between
        rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, ctypes.c_double]
        rms_norm.restype = None
        rotary.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, i64, i64]
        rotary.restype = None
        silu_mul.argtypes = [ptr, i64, ptr, i64, i64, i64]
        silu_mul.restype = None
        self._rms_norm, self._rotary, self._silu_mul = rms_norm, rotary, silu_mul
        self.library_path = library_path
        self.library = library
        """The loaded library (`shoal.kernels.cpu_model` binds its model functions on it)."""
        self.has_streaming_stores = bool(streaming())
        """False where the build has no streaming stores (not x86-64): every write uses memcpy."""
        self.decode_attention_enabled = decode_attention
        """Whether `shoal.kernels.attention_plan` plans decode attention for this library."""
        self.attention_isa = int(attention_isa())
        """The attention kernel's code path on this CPU: `ISA_AVX2` or `ISA_BASELINE`."""
        self._write_kv = write_kv
        self._decode_attention = attention

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        stream_min_bytes: int | None = None,
    ) -> bool:
        """`shoal.kernels.ops.write_kv` in C, when the tensors allow it.

        Everything the C loop relies on for memory safety is checked here (devices,
        dtypes, shapes, contiguous caches and last dims, slots in range), because the
        engine calls this without the public op's contract checks.

        Args:
            stream_min_bytes: streaming stores from this many bytes written (K and
                V, padding included); None for `STREAM_MIN_BYTES`.

        Returns:
            Whether it wrote; False (nothing done) for tensors it does not take:
            not all on the CPU, mixed dtypes, elements of other than 2 or 4 bytes,
            shapes that do not match, a last dim or a cache that is not contiguous.

        Raises:
            IndexError: a slot is past the end of the cache (nothing was written).
        """
        # Attribute reads of a tensor cost ~0.1 us each and a decode step's write
        # ~3 us, so these are as few and as cheap as possible (dtypes are singletons).
        dtype, shape, rows = key_cache.dtype, key_cache.shape, key.shape
        element_bytes = _ELEMENT_BYTES.get(dtype, 0)
        if not (
            element_bytes
            and key.dtype is dtype
            and value.dtype is dtype
            and value_cache.dtype is dtype
            and slot_mapping.dtype is torch.int64
            and key.is_cpu
            and value.is_cpu
            and key_cache.is_cpu
            and value_cache.is_cpu
            and slot_mapping.is_cpu
            and len(shape) == 4
            and len(rows) == 3
            and value_cache.shape == shape
            and value.shape == rows
            and rows[1] == shape[2]
            and rows[2] == shape[3]
            and slot_mapping.dim() == 1
            and slot_mapping.shape[0] == rows[0]
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
        ):
            return False
        key_strides, value_strides = key.stride(), value.stride()
        if key_strides[2] != 1 or value_strides[2] != 1:
            return False
        num_tokens, num_heads, head_bytes = rows[0], rows[1], rows[2] * element_bytes
        num_bytes = 2 * num_tokens * num_heads * head_bytes
        threshold = STREAM_MIN_BYTES if stream_min_bytes is None else stream_min_bytes
        num_slots = shape[0] * shape[1]
        bad_token = self._write_kv(
            key.data_ptr(),
            value.data_ptr(),
            key_strides[0] * element_bytes,
            key_strides[1] * element_bytes,
            value_strides[0] * element_bytes,
            value_strides[1] * element_bytes,
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            slot_mapping.data_ptr(),
            slot_mapping.stride(0),
            num_tokens,
            num_heads,
            head_bytes,
            num_slots,
            num_bytes >= threshold,
        )
        if bad_token >= 0:
            slot = int(slot_mapping[bad_token])
            raise IndexError(
                f"write_kv: token {bad_token}'s slot {slot} is past the cache's {num_slots} slots"
            )
        return True

    # --- the fused layer ops (`shoal.kernels.layer_ops`), float32 ---------------------------

    def rms_norm(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
    ) -> bool:
        """`layer_ops.rms_norm` in C (arguments already checked against its contract);
        False (nothing done) unless every tensor is float32 on the CPU."""
        tensors = (out, x, weight) if residual is None else (out, x, weight, residual)
        if not all(t.is_cpu and t.dtype is torch.float32 for t in tensors) or not weight.is_contiguous():
            return False
        self._rms_norm(
            out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0),
            None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
            weight.data_ptr(), x.shape[0], x.shape[1], eps,
        )
        return True

    def rotary_embedding(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """`layer_ops.rotary_embedding` in C (arguments already checked); False (nothing done)
        unless every tensor is float32 on the CPU."""
        if not all(t.is_cpu and t.dtype is torch.float32 for t in (query, key, cos, sin)):
            return False
        self._rotary(
            query.data_ptr(), query.stride(0), query.stride(1), query.shape[1],
            key.data_ptr(), key.stride(0), key.stride(1), key.shape[1],
            cos.data_ptr(), sin.data_ptr(), cos.stride(0), query.shape[0], query.shape[2],
        )
        return True

    def silu_mul(self, out: torch.Tensor, gate_up: torch.Tensor) -> bool:
        """`layer_ops.silu_mul` in C (arguments already checked); False (nothing done) unless
        both tensors are float32 on the CPU."""
        if not all(t.is_cpu and t.dtype is torch.float32 for t in (out, gate_up)):
            return False
        self._silu_mul(out.data_ptr(), out.stride(0), gate_up.data_ptr(), gate_up.stride(0), out.shape[0],
                       out.shape[1])
        return True

    def copy_blocks_between(
        self,
        src_cache: torch.Tensor,
        dst_cache: torch.Tensor,
        block_mapping: torch.Tensor,
        num_threads: int | None = None,
    ) -> bool:
        """`shoal.kernels.ops.swap_blocks` in C: every pair's block, every layer, key and value,
        copied straight from one pool into the other, in one pass (the torch version gathers
        into a temporary, then scatters). A move of at least `STREAM_MIN_BYTES` shares its
        layers among torch's intra-op thread count, as torch's own large copies do.

        Args:
            num_threads: the library's threads to share it among; None: as above. 1 runs it
                on the calling thread alone, never waiting for the library's threads (what a
                thread that copies while a native forward pass runs must do: a pass holds
                them until it ends).

        Returns:
            Whether it copied; False (nothing done) for tensors it does not take: not all on
            the CPU, not contiguous, mismatched layouts, or a mapping that is not int64
            [num_pairs, 2] contiguous.

        Raises:
            IndexError: a pair names a block outside its pool (nothing was copied).
        """
        src_shape, dst_shape = src_cache.shape, dst_cache.shape
        if not (
            src_cache.is_cpu
            and dst_cache.is_cpu
            and block_mapping.is_cpu
            and src_cache.dtype is dst_cache.dtype
            and block_mapping.dtype is torch.int64
            and block_mapping.dim() == 2
            and block_mapping.shape[1] == 2
            and block_mapping.is_contiguous()
            and len(src_shape) == 6
            and len(dst_shape) == 6
            and src_shape[:2] == dst_shape[:2]
            and src_shape[3:] == dst_shape[3:]
            and src_cache.is_contiguous()
            and dst_cache.is_contiguous()
        ):
            return False
        num_pairs = block_mapping.shape[0]
        if num_pairs == 0:
            return True
        block_bytes = src_cache[0, 0, 0].numel() * src_cache.element_size()
        num_src_blocks, num_dst_blocks = src_shape[2], dst_shape[2]
        bad = self._copy_between(
            src_cache.data_ptr(),
            dst_cache.data_ptr(),
            src_shape[0] * 2,
            num_src_blocks * block_bytes,
            num_dst_blocks * block_bytes,
            block_bytes,
            num_src_blocks,
            num_dst_blocks,
            block_mapping.data_ptr(),
            num_pairs,
            int(src_shape[0] * 2 * num_pairs * block_bytes >= STREAM_MIN_BYTES),
            num_threads
            if num_threads is not None
            else torch.get_num_threads() if num_pairs * block_bytes * src_shape[0] >= STREAM_MIN_BYTES else 1,
        )
        if bad >= 0:
            src, dst = (int(v) for v in block_mapping[bad])
            raise IndexError(
                f"swap_blocks: pair {bad} ({src} -> {dst}) names a block outside its pool "
                f"({num_src_blocks} source blocks, {num_dst_blocks} destination blocks)"
            )
        return True

    def plan_decode(
        self,
        key_cache: torch.Tensor,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        rows: Sequence[int],
    ) -> DecodePlan | None:
        """The metadata of a batch of decoding sequences (one query row each), for every layer.

        Args:
            key_cache: a layer's key cache; every layer's caches must have its shape and dtype.
            block_tables: each sequence's block ids (entries past its length's blocks unused).
            seq_lens: each sequence's context length, at least 1.
            rows: each sequence's query row.

        Returns:
            The plan, or None where the kernel does not take the cache: not on the CPU, not
            contiguous, another dtype, a head_dim that is not a multiple of
            `ATTENTION_CHUNK`, or ids beyond int32.
        """
        code = _DTYPE_CODES.get(key_cache.dtype)
        if code is None or not key_cache.is_cpu or key_cache.dim() != 4 or not key_cache.is_contiguous():
            return None
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        if head_dim % ATTENTION_CHUNK or not seq_lens:
            return None
        needed = [-(-seq_len // block_size) for seq_len in seq_lens]
        stride = max(needed)
        flat: list[int] = []
        for table, num_used in zip(block_tables, needed, strict=True):
            used = table[:num_used]
            flat += used
            flat += [0] * (stride - len(used))
        try:
            tables, lens, row_ids = array.array("i", flat), array.array("i", seq_lens), array.array("i", rows)
        except OverflowError:  # beyond int32: left to the torch path and its index checks
            return None
        struct = _DecodePlanStruct(
            len(seq_lens),
            tables.buffer_info()[0],
            stride,
            lens.buffer_info()[0],
            row_ids.buffer_info()[0],
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            code,
        )
        return DecodePlan(
            self,
            (num_blocks, block_size, num_kv_heads, head_dim),
            key_cache.dtype,
            len(seq_lens),
            tables,
            lens,
            row_ids,
            struct,
            ctypes.addressof(struct),
        )

    def decode_attention(
        self,
        plan: DecodePlan,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        *,
        isa: int = ISA_BEST,
    ) -> bool:
        """`shoal.kernels.ops.paged_attention` for the plan's decoding sequences, in C.

        Reads each sequence's K/V rows in place through its block table; writes only the
        plan's rows of `out`. What the C code relies on for memory safety is checked here
        (tensors, shapes, dtypes, strides) or there before anything is read (block ids,
        lengths, rows; see `cpu_attention.c`'s `check_plan`).

        Args:
            out: [num_tokens, num_heads, head_dim], last dim contiguous.
            query: like `out`.
            key_cache: contiguous, of the plan's shape and dtype.
            value_cache: like `key_cache`.
            isa: the code path (`ISA_BEST`; tests pick `ISA_BASELINE` or `ISA_AVX2`).

        Returns:
            Whether it ran; False (nothing done) for tensors it does not take.

        Raises:
            IndexError: a sequence's block ids, length or row are out of range (nothing written).
            ValueError: `isa` is not available on this CPU.
        """
        # ~0.1 us per attribute read: the engine calls this once per layer per step.
        dtype, shape, q_shape = plan.dtype, plan.cache_shape, query.shape
        if not (
            key_cache.dtype is dtype
            and value_cache.dtype is dtype
            and query.dtype is dtype
            and out.dtype is dtype
            and key_cache.shape == shape
            and value_cache.shape == shape
            and len(q_shape) == 3
            and q_shape[2] == shape[3]
            and q_shape[1] % shape[2] == 0
            and out.shape == q_shape
            and key_cache.is_cpu
            and value_cache.is_cpu
            and query.is_cpu
            and out.is_cpu
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
        ):
            return False
        q_strides, out_strides = query.stride(), out.stride()
        if q_strides[2] != 1 or out_strides[2] != 1:
            return False
        status = self._decode_attention(
            plan.address,
            out.data_ptr(),
            out_strides[0],
            out_strides[1],
            query.data_ptr(),
            q_strides[0],
            q_strides[1],
            q_shape[0],
            q_shape[1],
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            scale,
            isa,
        )
        if status == _DECODE_OK:
            return True
        if status >= 0:
            raise IndexError(
                f"paged_attention: decoding sequence {status} (length {plan.seq_lens[status]}, row "
                f"{plan.rows[status]}) has a block id outside the pool's {shape[0]} blocks or a row "
                f"outside the {q_shape[0]} query rows"
            )
        if status == _DECODE_NO_ISA:
            raise ValueError(f"decode attention: code path {isa} is not available on this CPU")
        if status == _DECODE_NO_MEMORY:
            raise MemoryError("decode attention: no memory for its scratch")
        raise AssertionError(f"decode attention: the plan's geometry was refused ({status})")



def build_and_load(
    compiler: Sequence[str] | None = None,
    cache_dirs: Sequence[Path] | None = None,
    *,
    decode_attention: bool = True,
) -> CpuKernels:
    """Builds (unless cached) and loads the native kernels.

    Args:
        compiler: the compiler command; None for `cpu_build.default_compiler`.
        cache_dirs: candidate cache directories; None for `cpu_build.default_cache_dirs`.
        decode_attention: as `CpuKernels`.

    Raises:
        NativeBuildError: it cannot be built or loaded.
    """
    if compiler is None:
        compiler = cpu_build.default_compiler()
    if cache_dirs is None:
        cache_dirs = cpu_build.default_cache_dirs()
    return CpuKernels(cpu_build.build(compiler, cache_dirs), decode_attention=decode_attention)


def select(
    settings: KernelSettings | None = None,
    compiler: Sequence[str] | None = None,
    cache_dirs: Sequence[Path] | None = None,
) -> CpuKernels | None:
    """The native kernels, or None for the torch implementation (logged when not by choice).

    Args:
        settings: the choice (its `cpu` and `cpu_attention`); None for the configured one
            (`shoal.kernels.settings.get_settings`).
        compiler: as `build_and_load`.
        cache_dirs: as `build_and_load`.
    """
    chosen = get_settings() if settings is None else settings
    if chosen.cpu == "torch":
        return None
    try:
        return build_and_load(compiler, cache_dirs, decode_attention=chosen.cpu_attention == "native")
    except NativeBuildError as error:
        log.warning("kernels.cpu_native_unavailable", error=str(error), using="torch")
        return None


_lock = threading.Lock()
_selected: tuple[CpuKernels | None] | None = None


def try_load() -> CpuKernels | None:
    """This process's choice: the native kernel, or None (the torch implementation).

    Made once, by the first call (`select`: builds or loads the library, or logs why
    not), and again after a `configure` that changes the CPU settings; later calls
    return it at the cost of a global lookup.
    """
    global _selected
    if _selected is None:
        with _lock:
            if _selected is None:
                _selected = (select(),)
    return _selected[0]


def use(kernels: CpuKernels | None) -> CpuKernels | None:
    """Replaces this process's choice (None: the torch implementation); returns the previous one.

    For tests and benchmarks that compare the two implementations in one process.
    """
    global _selected
    previous = try_load()
    with _lock:
        _selected = (kernels,)
    return previous


def _forget_choice(previous: KernelSettings, new: KernelSettings) -> None:
    """Drops the choice when the CPU settings change: the next op makes it anew."""
    global _selected
    if (previous.cpu, previous.cpu_attention) != (new.cpu, new.cpu_attention):
        with _lock:
            _selected = None


on_configure(_forget_choice)
