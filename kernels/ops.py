"""Shoal's KV-cache operations: the public API of `shoal.kernels`.

Every function runs Shoal's CUDA kernels when its tensors are on a CUDA device
(the extension is built on first use, see `shoal.kernels.cuda_ext`) and the
vectorized torch implementation in `shoal.kernels.reference` otherwise (whose
`write_kv` is a small C loop, `shoal.kernels.cpu_kernels`, where the machine's C
compiler builds it). Both follow the one contract below; docs/kernels.md says
the same with more examples.

Layout
------
The engine allocates ONE tensor per pool::

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
                           |
                           0 = key, 1 = value

    key_cache = kv_cache[layer, 0]        value_cache = kv_cache[layer, 1]
    each [num_blocks, block_size, num_kv_heads, head_dim], contiguous

    key_cache
    +-------------------------- block 0 ---------------------------+-- block 1 --+--
    | token 0                 | token 1                 | ...      | token 0 ... |
    | head 0 | head 1 | ...   | head 0 | head 1 | ...   |          |             |
    | d0..dD | d0..dD |       | d0..dD | d0..dD |       |          |             |
    +--------------------------------------------------------------+-------------+--

    slot = block_id * block_size + offset_in_block
    (a slot is one token's row of num_kv_heads * head_dim values)

dtypes: float32, float16, bfloat16; the cache, key/value and query share one.
Index tensors: slot_mapping and block_mapping int64; block_tables, seq_lens and
query_start_loc int32. Index tensors live on the cache's device, except
`block_mapping`, which may also be a CPU tensor.

Sequences in `paged_attention`
------------------------------
Sequence s owns query rows ``query_start_loc[s]:query_start_loc[s + 1]``
(``q_len`` rows, possibly 0). Its context is ``seq_lens[s]`` tokens, INCLUDING
those q_len new tokens, whose K/V `write_kv` already stored; they are the last
q_len positions. Row i (position ``seq_len - q_len + i``) attends causally to
positions ``[0, seq_len - q_len + i]``::

    decode                 q_len = 1
    fresh prefill          q_len = seq_len
    prefill over a prefix  1 < q_len < seq_len    (prefix caching, chunked prefill)

all three may be mixed in one call. GQA/MQA: ``num_heads % num_kv_heads == 0``
and query head h reads kv head ``h // (num_heads // num_kv_heads)``. Softmax is
accumulated in float32; the output has the query's dtype.

What is checked, and where (`shoal.kernels.contract`; one contract, the same
answer on both paths):

* shapes, dtypes, devices and layouts (index tensors contiguous; block_size,
  num_kv_heads and head_dim at least 1; head_dim at most 256 and num_heads a
  positive multiple of num_kv_heads for `paged_attention`): on every call,
  before any work, `KVContractError`;
* the values of a `paged_attention` batch (``query_start_loc`` from 0 to
  num_tokens and never decreasing, ``q_len <= seq_len``,
  ``seq_len <= max_blocks_per_seq * block_size``): `KVContractError` from the
  CPU path on every call; on CUDA, reading them would synchronize the stream,
  so the kernel stops with a device-side assert instead, and the setting
  ``check_cuda_indices`` checks them on the host first (for debugging);
* slots, block ids and table entries in range: where they are read, an
  `IndexError` before anything is written on the CPU, a device-side assert on
  CUDA (never an out-of-bounds write);
* no block both a source and a destination (or a destination twice) in one
  `copy_blocks`: asserted on the CPU, trusted on CUDA. Neither path checks that
  no slot appears twice in one `write_kv`; if one does, which token's K/V
  lands there is unspecified.

The setting ``cuda = "reference"`` (`shoal.kernels.settings`) runs the torch
implementation on CUDA tensors too (for debugging, or where the extension cannot
be built).

A server calls `prepare` when it starts, so the kernels are built (or fail to
build) before the first request rather than inside its forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Literal

import torch

from shoal.kernels import contract, cpu_kernels, cuda_ext, reference
from shoal.kernels.settings import KernelSettings, get_settings, on_configure

KernelBackend = Literal["cuda", "reference", "cpu"]
"""Which implementation the ops run on a device: Shoal's CUDA kernels, the torch
implementation on CUDA tensors (the setting ``cuda = "reference"``), or the CPU one."""

# The settings as the ops read them on every call (module globals: no lookups through
# the settings object on the hot path), updated by every `configure`.
_USE_CUDA_KERNELS = get_settings().cuda == "kernels"
_CHECK_CUDA_INDICES = get_settings().check_cuda_indices


def _apply(previous: KernelSettings, new: KernelSettings) -> None:
    global _USE_CUDA_KERNELS, _CHECK_CUDA_INDICES
    _USE_CUDA_KERNELS = new.cuda == "kernels"
    _CHECK_CUDA_INDICES = new.check_cuda_indices


on_configure(_apply)


def _on_cuda(*tensors: torch.Tensor) -> bool:
    return _USE_CUDA_KERNELS and any(t.is_cuda for t in tensors)


def prepare(
    device: torch.device,
    *,
    load: Callable[[], ModuleType] = cuda_ext.load_extension,
    use_cuda_kernels: bool | None = None,
) -> KernelBackend:
    """Makes the ops ready to run on `device` now: on CUDA, builds and loads the kernels.

    On the CPU it builds (or loads from its cache) the native `write_kv`
    (`shoal.kernels.cpu_kernels`, a fraction of a second of the C compiler the first
    time on a machine), which never fails: without it the torch implementation serves, and
    the reason is logged.

    Without this, the extension is built by the first op that sees a CUDA tensor,
    i.e. inside a server's first forward pass (about a minute of nvcc), and a build
    failure fails every pass while the server looks healthy. There is no silent
    fallback: a CUDA server without its kernels refuses to start, with the
    compiler's message; running the torch implementation on the GPU instead (much
    slower: it gathers K/V per layer) is the operator's explicit choice, the
    setting ``cuda = "reference"``.

    Args:
        device: where the KV cache lives.
        load: builds and loads the extension (`cuda_ext.load_extension`; tests
            inject their own).
        use_cuda_kernels: whether CUDA tensors go to the kernels; None for the
            configured ``cuda`` setting, as the ops do.

    Returns:
        The implementation the ops run on `device`.

    Raises:
        KernelBuildError: `device` is CUDA, the kernels are wanted, and they
            cannot be built or loaded.
    """
    if device.type != "cuda":
        cpu_kernels.try_load()
        return "cpu"
    if not (_USE_CUDA_KERNELS if use_cuda_kernels is None else use_cuda_kernels):
        return "reference"
    load()
    return "cuda"


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes each new token's key and value into its slot of the paged cache.

    vLLM calls this ``reshape_and_cache``.

    Args:
        key: [num_tokens, num_kv_heads, head_dim]; the last dim contiguous, the
            token stride arbitrary (a transposed view of a projection is fine).
        value: same shape and dtype as `key`, strides of its own.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
        value_cache: same shape as `key_cache`.
        slot_mapping: int64 [num_tokens]; token i goes to slot
            ``slot_mapping[i]``; a negative slot is padding and is skipped.
    """
    contract.check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    if _on_cuda(key_cache):
        cuda_ext.load_extension().write_kv(key, value, key_cache, value_cache, slot_mapping)
    else:
        reference.write_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> None:
    """Varlen causal attention of a batch of sequences, reading K/V from the blocks.

    Args:
        out: [num_tokens, num_heads, head_dim], written in place; last dim contiguous.
        query: [num_tokens, num_heads, head_dim]; last dim contiguous.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
        value_cache: same shape as `key_cache`.
        block_tables: int32 [num_seqs, max_blocks_per_seq]; row s lists sequence
            s's blocks in order; entries past its last block are ignored.
        seq_lens: int32 [num_seqs]; context length of each sequence including
            its new query tokens.
        query_start_loc: int32 [num_seqs + 1]; cumulative query counts, starting at 0.
        scale: multiplies q.k before the softmax (usually head_dim ** -0.5).
    """
    contract.check_paged_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc
    )
    if _on_cuda(query):
        if _CHECK_CUDA_INDICES:  # copies the index tensors to the host: synchronizes the stream
            contract.check_attention_batch(
                query.shape[0],
                key_cache.shape[1],
                block_tables.tolist(),
                seq_lens.tolist(),
                query_start_loc.tolist(),
            )
        cuda_ext.load_extension().paged_attention(
            out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, float(scale)
        )
    else:
        reference.paged_attention(
            out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
        )


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies whole blocks inside one pool, every layer, key and value, in one call.

    Used for copy-on-write and fork. No block may be both a source and a
    destination in the same call, and no destination may appear twice.

    Args:
        kv_cache: the whole pool, [num_layers, 2, num_blocks, block_size,
            num_kv_heads, head_dim], contiguous.
        block_mapping: int64 [num_pairs, 2] of (src_block, dst_block); on the
            pool's device or on the CPU.
    """
    contract.check_copy_blocks(kv_cache, block_mapping)
    if _on_cuda(kv_cache):
        mapping = block_mapping.to(kv_cache.device, non_blocking=True)
        cuda_ext.load_extension().copy_blocks(kv_cache, mapping)
    else:
        reference.copy_blocks(kv_cache, block_mapping)


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies blocks from one pool to another, every layer, key and value, in one call.

    The pools may be on different devices: GPU -> pinned CPU (swap out),
    pinned CPU -> GPU (swap in), or both on one device. On CUDA, one kernel
    moves every block, reading or writing the pinned CPU pool through its
    mapped device address; a CPU pool that is not pinned is refused. Like
    any kernel it is asynchronous: synchronize the stream (or wait on an
    event recorded after it) before the host reads a swapped-out block or
    reuses a swapped-in one.

    Args:
        src_cache: [num_layers, 2, num_src_blocks, block_size, num_kv_heads,
            head_dim], contiguous.
        dst_cache: [num_layers, 2, num_dst_blocks, block_size, num_kv_heads,
            head_dim], contiguous; same dtype and all dims but the blocks'.
        block_mapping: int64 [num_pairs, 2] of (src_block, dst_block); on the
            CPU or on the CUDA device involved.
    """
    contract.check_swap_blocks(src_cache, dst_cache, block_mapping)
    if _on_cuda(src_cache, dst_cache):
        device = src_cache.device if src_cache.is_cuda else dst_cache.device
        mapping = block_mapping.to(device, non_blocking=True)
        cuda_ext.load_extension().swap_blocks(src_cache, dst_cache, mapping)
    else:
        reference.swap_blocks(src_cache, dst_cache, block_mapping)
