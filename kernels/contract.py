"""Argument checks for the KV-cache ops: one contract, the same answer on the CPU and CUDA paths.

Two kinds of checks:

* shapes, dtypes, layouts and devices (`check_write_kv`, `check_paged_attention`,
  ...): `shoal.kernels.ops` runs them on every call, on both paths, before any
  work. They read no tensor's values.
* the index values of a `paged_attention` batch (`check_attention_batch`), on host
  lists: the CPU planner runs them on every batch (it reads the values anyway); on
  CUDA tensors, reading them would synchronize the stream on every call and layer,
  so they run only when the setting ``check_cuda_indices`` is on, and otherwise the
  kernel stops with a device-side assert on the same mistakes.

Index values that are read where they are used (slots, block ids, table entries)
are checked there: an `IndexError` before anything is written on the CPU, a
device-side assert on CUDA. The checks run on every call of every layer, so
messages are only formatted on failure.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shoal.shared.errors import ShoalError

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
"""The largest head_dim `paged_attention` takes, on both paths: the CUDA kernel holds a
row's head dims in registers, up to 8 per lane of a warp (csrc/kv_ops.h's kMaxHeadDim)."""


class KVContractError(ShoalError, ValueError):
    """An argument of a KV-cache op breaks the documented contract."""


def _check_index(name: str, tensor: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    if tensor.dtype != dtype or tensor.dim() != ndim:
        raise KVContractError(
            f"{name} must be {dtype} with {ndim} dims, got {tensor.dtype} {tuple(tensor.shape)}"
        )
    if not tensor.is_contiguous():  # the CUDA kernels index it as a flat array
        raise KVContractError(f"{name} must be contiguous, got strides {tensor.stride()}")


def _check_layer_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4:
        raise KVContractError(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(key_cache.shape)}"
        )
    if key_cache.dtype not in CACHE_DTYPES:
        raise KVContractError(f"cache dtype {key_cache.dtype} is not one of {CACHE_DTYPES}")
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise KVContractError(
            f"value_cache {value_cache.dtype} {tuple(value_cache.shape)} must match key_cache "
            f"{key_cache.dtype} {tuple(key_cache.shape)}"
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise KVContractError("key_cache and value_cache must be contiguous")
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if block_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise KVContractError(
            f"key_cache needs block_size, num_kv_heads and head_dim of at least 1, got {tuple(key_cache.shape)}"
        )


def check_attention_cache(key_cache: torch.Tensor) -> None:
    """Raises KVContractError unless `paged_attention` can read a cache of `key_cache`'s
    geometry: block_size, num_kv_heads and head_dim at least 1, head_dim at most
    `MAX_HEAD_DIM`. Only its shape is read (the CPU planner calls this once per batch)."""
    shape = key_cache.shape
    if len(shape) != 4 or shape[1] < 1 or shape[2] < 1 or not 1 <= shape[3] <= MAX_HEAD_DIM:
        raise KVContractError(
            f"paged_attention needs a key_cache [num_blocks, block_size >= 1, num_kv_heads >= 1, "
            f"1 <= head_dim <= {MAX_HEAD_DIM}], got {tuple(shape)}"
        )


def _check_pool(name: str, cache: torch.Tensor) -> None:
    if cache.dim() != 6 or cache.shape[1] != 2:
        raise KVContractError(
            f"{name} must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(cache.shape)}"
        )
    if cache.dtype not in CACHE_DTYPES:
        raise KVContractError(f"{name} dtype {cache.dtype} is not one of {CACHE_DTYPES}")
    if not cache.is_contiguous():
        raise KVContractError(f"{name} must be contiguous")


def _check_block_mapping(block_mapping: torch.Tensor) -> None:
    if block_mapping.dtype != torch.int64 or block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise KVContractError(
            f"block_mapping must be int64 [num_pairs, 2], got {block_mapping.dtype} {tuple(block_mapping.shape)}"
        )
    if not block_mapping.is_contiguous():
        raise KVContractError(f"block_mapping must be contiguous, got strides {block_mapping.stride()}")


def _check_rows(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A [tokens, heads, head_dim] input or output: shape, dtype, contiguous last dim."""
    if tensor.shape != shape:
        raise KVContractError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    if tensor.dtype != dtype:
        raise KVContractError(f"{name} dtype {tensor.dtype} != cache dtype {dtype}")
    if tensor.stride(2) != 1 and tensor.numel():
        raise KVContractError(f"{name}'s last dim must be contiguous, got strides {tensor.stride()}")


def _check_same_device(op: str, *tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if any(tensor.device != device for tensor in tensors[1:]):
        raise KVContractError(
            f"{op}: all tensors must be on one device, got {[str(t.device) for t in tensors]}"
        )


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raises KVContractError unless the arguments fit `ops.write_kv`'s contract."""
    _check_layer_caches(key_cache, value_cache)
    _check_index("slot_mapping", slot_mapping, torch.int64, 1)
    rows = (slot_mapping.shape[0], key_cache.shape[2], key_cache.shape[3])
    _check_rows("key", key, rows, key_cache.dtype)
    _check_rows("value", value, rows, key_cache.dtype)
    _check_same_device("write_kv", key, value, key_cache, value_cache, slot_mapping)


def check_paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Raises KVContractError unless the arguments fit `ops.paged_attention`'s contract."""
    _check_layer_caches(key_cache, value_cache)
    check_attention_cache(key_cache)
    if query.dim() != 3 or query.shape[2] != key_cache.shape[3]:
        raise KVContractError(
            f"query must be [num_tokens, num_heads, head_dim={key_cache.shape[3]}], got {tuple(query.shape)}"
        )
    if query.shape[1] < 1 or query.shape[1] % key_cache.shape[2]:
        raise KVContractError(
            f"num_heads {query.shape[1]} must be a positive multiple of num_kv_heads {key_cache.shape[2]}"
        )
    _check_rows("query", query, query.shape, key_cache.dtype)
    _check_rows("out", out, query.shape, key_cache.dtype)
    _check_index("block_tables", block_tables, torch.int32, 2)
    _check_index("seq_lens", seq_lens, torch.int32, 1)
    _check_index("query_start_loc", query_start_loc, torch.int32, 1)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise KVContractError(
            f"with {num_seqs} sequences block_tables needs {num_seqs} rows and query_start_loc "
            f"{num_seqs + 1} entries, got {block_tables.shape[0]} and {query_start_loc.shape[0]}"
        )
    if num_seqs == 0 and query.shape[0]:  # query_start_loc = [0]: no row belongs to a sequence
        raise KVContractError(f"with no sequences the query must have no rows, got {query.shape[0]}")
    _check_same_device(
        "paged_attention", out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc
    )


def check_copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Raises KVContractError unless the arguments fit `ops.copy_blocks`'s contract."""
    _check_pool("kv_cache", kv_cache)
    _check_block_mapping(block_mapping)
    if block_mapping.device != kv_cache.device and block_mapping.device.type != "cpu":
        raise KVContractError("block_mapping must be on kv_cache's device or on the CPU")


def check_swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Raises KVContractError unless the arguments fit `ops.swap_blocks`'s contract."""
    _check_pool("src_cache", src_cache)
    _check_pool("dst_cache", dst_cache)
    if src_cache.dtype != dst_cache.dtype:
        raise KVContractError(f"pools differ in dtype: {src_cache.dtype} vs {dst_cache.dtype}")
    if src_cache.shape[:2] != dst_cache.shape[:2] or src_cache.shape[3:] != dst_cache.shape[3:]:
        raise KVContractError(
            f"pools differ in more than their block count: {tuple(src_cache.shape)} vs {tuple(dst_cache.shape)}"
        )
    _check_block_mapping(block_mapping)
    cuda_devices = {t.device for t in (src_cache, dst_cache) if t.is_cuda}
    if len(cuda_devices) > 1:
        raise KVContractError(f"pools on two CUDA devices are not supported: {cuda_devices}")
    if block_mapping.device.type != "cpu" and block_mapping.device not in cuda_devices:
        raise KVContractError("block_mapping must be on the CPU or on the pools' CUDA device")


def check_attention_batch(
    num_tokens: int,
    block_size: int,
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_start_loc: Sequence[int],
) -> None:
    """Raises KVContractError unless a `paged_attention` batch's index values fit the contract.

    Every query row belongs to exactly one sequence: ``query_start_loc`` runs from 0 to
    `num_tokens` and never decreases. Each sequence has ``0 <= q_len <= seq_len``, and its
    row of `block_tables` lists at least the blocks ``seq_len`` needs. Block ids are not
    checked here (see the module's docstring).

    Args:
        num_tokens: the query's rows.
        block_size: the cache's tokens per block.
        block_tables: each sequence's block ids (rows of any length).
        seq_lens: each sequence's context length, including its query rows.
        query_start_loc: num_seqs + 1 entries.
    """
    if query_start_loc[0] != 0 or query_start_loc[-1] != num_tokens:
        raise KVContractError(
            f"query_start_loc must run from 0 to num_tokens={num_tokens} (the query's rows), "
            f"got {query_start_loc[0]} .. {query_start_loc[-1]}"
        )
    for seq, seq_len in enumerate(seq_lens):
        q_len = query_start_loc[seq + 1] - query_start_loc[seq]
        if not 0 <= q_len <= seq_len:
            raise KVContractError(f"sequence {seq}: q_len {q_len} must be in [0, seq_len={seq_len}]")
        num_blocks = -(-seq_len // block_size)
        if num_blocks > len(block_tables[seq]):
            raise KVContractError(
                f"sequence {seq} needs {num_blocks} blocks but block_tables has {len(block_tables[seq])} columns"
            )
