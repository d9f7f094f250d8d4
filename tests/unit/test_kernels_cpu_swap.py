"""The native CPU swap_blocks (kernels/csrc/cpu_cache_ops.c's shoal_copy_blocks_between):
the same bits as the torch gather-and-scatter on random pools and pairs, on one or several
threads, and nothing copied when a pair is out of range."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.kernels import cpu_kernels, ops, reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 4),
    src_blocks=st.integers(1, 12),
    dst_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 4, 16]),
    kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([8, 24, 64]),
    dtype=st.sampled_from(DTYPES),
    threads=st.integers(1, 3),
    data=st.data(),
)
def test_native_swap_matches_torch(
    native: cpu_kernels.CpuKernels, layers: int, src_blocks: int, dst_blocks: int, block_size: int, kv_heads: int,
    head_dim: int, dtype: torch.dtype, threads: int, data: st.DataObject,
) -> None:
    num_pairs = data.draw(st.integers(0, min(src_blocks, dst_blocks)))
    sources = data.draw(st.permutations(range(src_blocks)))[:num_pairs]
    targets = data.draw(st.permutations(range(dst_blocks)))[:num_pairs]
    mapping = torch.tensor([[s, t] for s, t in zip(sources, targets, strict=True)], dtype=torch.int64).view(-1, 2)
    src = torch.randn(layers, 2, src_blocks, block_size, kv_heads, head_dim).to(dtype)
    dst = torch.randn(layers, 2, dst_blocks, block_size, kv_heads, head_dim).to(dtype)
    expected = dst.clone()
    reference.swap_blocks_torch(src, expected, mapping)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # stream_min_bytes=0 would need a private entry; the streaming path runs in the large test below
        assert native.copy_blocks_between(src, dst, mapping)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(dst.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       expected.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_a_large_swap_takes_the_streaming_path_and_copies_exactly(native: cpu_kernels.CpuKernels) -> None:
    src = torch.randn(4, 2, 64, 16, 4, 64)  # 2 MB per layer plane pair: over the streaming threshold
    dst = torch.zeros(4, 2, 80, 16, 4, 64)
    mapping = torch.stack([torch.randperm(64)[:48], torch.randperm(80)[:48]], dim=1)
    expected = dst.clone()
    reference.swap_blocks_torch(src, expected, mapping)
    ops.swap_blocks(src, dst, mapping)
    assert torch.equal(dst, expected)


@settings(max_examples=30, deadline=None)
@given(
    num_pairs=st.integers(2, 40),
    threads=st.integers(1, 2),
    data=st.data(),
)
def test_pairs_in_any_order_with_repeated_sources_match_torch(
    native: cpu_kernels.CpuKernels, num_pairs: int, threads: int, data: st.DataObject
) -> None:
    """The native copy reads the sources in address order (it sorts the pairs when no two
    share a destination): any order of pairs, a source copied to several blocks."""
    src_blocks, dst_blocks = data.draw(st.integers(1, 48)), data.draw(st.integers(num_pairs, 64))
    sources = data.draw(st.lists(st.integers(0, src_blocks - 1), min_size=num_pairs, max_size=num_pairs))
    targets = data.draw(st.permutations(range(dst_blocks)))[:num_pairs]
    mapping = torch.tensor(list(zip(sources, targets, strict=True)), dtype=torch.int64)
    src = torch.randn(3, 2, src_blocks, 4, 2, 8)
    dst = torch.randn(3, 2, dst_blocks, 4, 2, 8)
    expected = dst.clone()
    reference.swap_blocks_torch(src, expected, mapping)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert native.copy_blocks_between(src, dst, mapping, num_threads=threads)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(dst, expected)


def test_a_destination_named_twice_gets_the_later_pairs_block(native: cpu_kernels.CpuKernels) -> None:
    src, dst = torch.randn(1, 2, 4, 4, 1, 8), torch.zeros(1, 2, 3, 4, 1, 8)
    # sorted by source, the pair (0 -> 1) would come last and win: the order is kept instead
    assert native.copy_blocks_between(src, dst, torch.tensor([[3, 1], [2, 0], [0, 1]]))
    assert torch.equal(dst[:, :, 1], src[:, :, 0]) and torch.equal(dst[:, :, 0], src[:, :, 2])
    assert native.copy_blocks_between(src, dst, torch.tensor([[0, 1], [3, 1]]))
    assert torch.equal(dst[:, :, 1], src[:, :, 3])


def test_a_pair_out_of_range_raises_and_copies_nothing(native: cpu_kernels.CpuKernels) -> None:
    src, dst = torch.randn(2, 2, 4, 4, 1, 8), torch.zeros(2, 2, 3, 4, 1, 8)
    with pytest.raises(IndexError, match="pair 1"):
        native.copy_blocks_between(src, dst, torch.tensor([[0, 1], [1, 3]]))
    assert not dst.any()


def test_tensors_it_does_not_take_are_left_to_torch(native: cpu_kernels.CpuKernels) -> None:
    src = torch.randn(2, 2, 4, 4, 1, 8)
    assert not native.copy_blocks_between(src, torch.zeros(2, 2, 4, 4, 1, 8, dtype=torch.float16),
                                          torch.tensor([[0, 1]]))
    assert not native.copy_blocks_between(src, torch.zeros(2, 2, 4, 4, 1, 8), torch.tensor([[0, 1]]).int())
