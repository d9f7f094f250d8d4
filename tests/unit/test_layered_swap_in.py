"""Copies back from the host pool layer by layer (`layered_swap_in`): on random pools split
into runs of layers, random pairs and both CPU modes, each `wait(layer)` leaves that layer
and every layer before it as one `ops.swap_blocks` of all layers would, and `finish` every
layer; a helper thread's failure reaches the caller, after every layer's copy ended."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.kernels import ops
from shoal.kernels.contract import KVContractError
from shoal.services.worker.engine.kv_placement import KVPools
from shoal.services.worker.engine.layered_swap_in import LayeredSwapIn


def _random_pools(
    layer_labels: list[str], num_blocks: int, block_shape: tuple[int, int, int], dtype: torch.dtype
) -> KVPools:
    def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.randn(shape).to(dtype)

    return KVPools([torch.device(label) for label in layer_labels], (num_blocks, *block_shape), dtype, allocate)


def _layer(pools: KVPools, layer: int) -> torch.Tensor:
    key, value = pools.layer_caches[layer]
    return torch.stack([key, value])


@pytest.fixture(scope="module")
def helper() -> ThreadPoolExecutor:
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


@settings(max_examples=40, deadline=None)
@given(
    runs=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    pool_blocks=st.integers(1, 10),
    host_blocks=st.integers(1, 10),
    block_shape=st.tuples(st.sampled_from([1, 4, 16]), st.integers(1, 3), st.sampled_from([8, 64])),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    mode=st.sampled_from(["inline", "thread"]),
    data=st.data(),
)
def test_each_layer_is_in_once_waited_for(
    helper: ThreadPoolExecutor,
    runs: list[int],
    pool_blocks: int,
    host_blocks: int,
    block_shape: tuple[int, int, int],
    dtype: torch.dtype,
    mode: str,
    data: st.DataObject,
) -> None:
    labels = [f"cpu:{run}" for run, size in enumerate(runs) for _ in range(size)]
    num_layers = len(labels)
    pools = _random_pools(labels, pool_blocks, block_shape, dtype)
    host = torch.randn(num_layers, 2, host_blocks, *block_shape).to(dtype)
    num_pairs = data.draw(st.integers(1, min(pool_blocks, host_blocks)))
    sources = data.draw(st.permutations(range(host_blocks)))[:num_pairs]
    targets = data.draw(st.permutations(range(pool_blocks)))[:num_pairs]
    pairs = torch.tensor(list(zip(sources, targets, strict=True)), dtype=torch.int64)
    before = [_layer(pools, layer).clone() for layer in range(num_layers)]
    expected = []
    for layer in range(num_layers):
        layer_pool = before[layer].clone().unsqueeze(0)
        ops.swap_blocks(host[layer : layer + 1], layer_pool, pairs)
        expected.append(layer_pool[0])

    swap_in = LayeredSwapIn(pools, host, pairs, mode, helper)  # type: ignore[arg-type]
    waited = data.draw(st.lists(st.integers(0, num_layers - 1), max_size=3))
    for layer in sorted(waited):
        swap_in.wait(layer)
        for done in range(layer + 1):
            assert torch.equal(_layer(pools, done), expected[done]), (mode, layer, done)
        if mode == "inline":  # nothing is copied before it is asked for
            for pending in range(layer + 1, num_layers):
                assert torch.equal(_layer(pools, pending), before[pending])
    swap_in.finish()
    for layer in range(num_layers):
        assert torch.equal(_layer(pools, layer), expected[layer])
    assert swap_in.get_exposed_seconds() >= 0.0


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_a_pair_outside_the_pool_fails_the_wait_and_the_finish(helper: ThreadPoolExecutor, mode: str) -> None:
    pools = _random_pools(["cpu", "cpu"], 4, (4, 1, 8), torch.float32)
    host = torch.zeros(2, 2, 4, 4, 1, 8)
    swap_in = LayeredSwapIn(pools, host, torch.tensor([[0, 7]]), mode, helper)  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        swap_in.wait(0)
    with pytest.raises(IndexError):  # the other layer's copy ended, and failed too
        swap_in.finish()


def test_pairs_outside_the_contract_are_refused_before_any_copy(helper: ThreadPoolExecutor) -> None:
    pools = _random_pools(["cpu"], 4, (4, 1, 8), torch.float32)
    with pytest.raises(KVContractError):
        LayeredSwapIn(pools, torch.zeros(1, 2, 4, 4, 1, 8), torch.tensor([[0, 1, 2]]), "thread", helper)
