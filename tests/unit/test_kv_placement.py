"""Each layer's KV on its layer's device: runs of layers, one pool each, copies and swaps per
run. On the CPU, devices are injected as labels (``cpu:0``, ``cpu:1``) to make several runs."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from shoal.services.worker.engine.kv_placement import KVPools, get_layer_devices
from shoal.services.worker.engine.model_runner import allocate_pool

CPU0, CPU1 = torch.device("cpu", 0), torch.device("cpu", 1)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def test_layers_are_found_on_their_devices(demo_models_root: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(demo_models_root / "demo" / "llama-5m")
    assert get_layer_devices(model) == [torch.device("cpu")] * model.config.num_hidden_layers


def test_runs_of_layers_get_a_pool_each_and_blocks_move_in_every_run() -> None:
    pools = KVPools([CPU0, CPU0, CPU1, CPU1, CPU1, CPU0], (10, 4, 2, 8), torch.float32, _zeros)
    assert [(run.first_layer, run.num_layers, run.device) for run in pools.runs] == [
        (0, 2, CPU0), (2, 3, CPU1), (5, 1, CPU0)
    ]
    assert pools.devices == (CPU0, CPU1)
    assert len(pools.layer_caches) == 6 and pools.nbytes == 6 * 2 * 10 * 4 * 2 * 8 * 4
    for layer, (key_cache, value_cache) in enumerate(pools.layer_caches):
        key_cache[3].fill_(layer + 1)
        value_cache[3].fill_(-(layer + 1))
    pools.copy_blocks(torch.tensor([[3, 7]]))
    for layer, (key_cache, value_cache) in enumerate(pools.layer_caches):
        assert (key_cache[7] == layer + 1).all() and (value_cache[7] == -(layer + 1)).all()

    host = torch.zeros((6, 2, 5, 4, 2, 8))
    pools.swap_out(host, torch.tensor([[7, 4]]))
    assert [int(host[layer, 0, 4, 0, 0, 0]) for layer in range(6)] == [1, 2, 3, 4, 5, 6]
    host[:, :, 1] = 42.0
    pools.swap_in(host, torch.tensor([[1, 0]]))
    assert all((key_cache[0] == 42).all() and (value_cache[0] == 42).all() for key_cache, value_cache in
               pools.layer_caches)
    pools.zero_blocks(torch.tensor([0, 7]))
    assert all(not key_cache[[0, 7]].any() and not value_cache[[0, 7]].any() for key_cache, value_cache in
               pools.layer_caches)


def test_released_cpu_pools_keep_their_addresses_and_read_as_zeros() -> None:
    """A park (`KVPools.release`): the native forward holds the pools' addresses, so on the CPU
    they stay and only the pages go back; `restore` changes nothing there."""
    pools = KVPools([CPU0, CPU0, CPU1], (64, 16, 2, 64), torch.float32, allocate_pool)
    addresses = [(key.data_ptr(), value.data_ptr()) for key, value in pools.layer_caches]
    caches = pools.layer_caches
    for key_cache, value_cache in caches:
        key_cache.fill_(1.5)
        value_cache.fill_(-2.5)
    pools.release()
    assert pools.layer_caches is caches, "the runner and the native forward hold this list"
    assert [(key.data_ptr(), value.data_ptr()) for key, value in pools.layer_caches] == addresses
    assert all(not key.any() and not value.any() for key, value in pools.layer_caches)
    pools.restore()
    assert [(key.data_ptr(), value.data_ptr()) for key, value in pools.layer_caches] == addresses
    assert pools.nbytes == 3 * 2 * 64 * 16 * 2 * 64 * 4
