"""oneDNN-packed linear weights: same products, weights moved not copied, bounded shapes."""

from __future__ import annotations

import pytest
import torch

from shoal.services.worker.engine import packed_linear
from shoal.services.worker.engine.packed_linear import (
    EXACT_ROWS,
    get_bucket_rows,
    get_packed_bytes,
    pack_linear_weights,
)

pytestmark = pytest.mark.skipif(not packed_linear.is_available(), reason="torch built without oneDNN")


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.up = torch.nn.Linear(16, 40)
        self.down = torch.nn.Linear(40, 16, bias=False)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as Qwen2's lm_head

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.embed(token_ids)))))


def _weight_bytes(module: torch.nn.Linear) -> int:
    return module.weight.numel() * module.weight.element_size()


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 65, 100, 300])
def test_packed_layers_compute_the_same_products(num_tokens: int) -> None:
    model = TinyLM().eval()
    token_ids = torch.randint(0, 50, (1, num_tokens), generator=torch.Generator().manual_seed(num_tokens))
    with torch.inference_mode():
        expected = model(token_ids)
        unpacked_bytes = _weight_bytes(model.up) + _weight_bytes(model.down)
        assert pack_linear_weights(model) == unpacked_bytes
        actual = model(token_ids)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_weights_move_into_the_packed_tensors_and_tied_ones_stay() -> None:
    model = TinyLM().eval()
    embed_before = model.embed.weight.detach().clone()
    up_bytes, down_bytes = _weight_bytes(model.up), _weight_bytes(model.down)
    assert pack_linear_weights(model) == up_bytes + down_bytes
    assert model.up.weight.numel() == model.down.weight.numel() == 0, "the packed tensor is the weight now"
    assert model.up.weight.dtype == torch.float32 and model.up.bias is not None
    assert torch.equal(model.head.weight, embed_before), "a weight tied to the embedding is not packed"
    assert pack_linear_weights(model) == get_packed_bytes(model) == up_bytes + down_bytes, (
        "packing twice adds nothing"
    )


def test_other_dtypes_are_left_alone() -> None:
    model = TinyLM().to(torch.bfloat16).eval()
    assert pack_linear_weights(model) == 0
    assert model.up.weight.numel() == 40 * 16


def test_row_counts_fall_into_a_bounded_set_of_sizes() -> None:
    assert [get_bucket_rows(n) for n in range(EXACT_ROWS + 1)] == list(range(EXACT_ROWS + 1))
    sizes = {get_bucket_rows(n) for n in range(1, 2049)}
    assert len(sizes) == 144
    for num_rows in range(EXACT_ROWS + 1, 5000):
        bucket = get_bucket_rows(num_rows)
        assert num_rows <= bucket <= num_rows * 1.0625
        assert get_bucket_rows(bucket) == bucket


def test_warm_up_runs_each_weight_shape_once_per_row_count() -> None:
    model = TinyLM().eval()
    assert packed_linear.warm_up(model, 8) == 0, "nothing packed, nothing to warm"
    pack_linear_weights(model)
    assert packed_linear.warm_up(model, 8) == 2 * 8  # up and down; the tied head is not packed
    assert packed_linear.warm_up(model, 8) == 0, "warmed once per model (a replica woken in the same process)"
    assert packed_linear.warm_up(model, 9) == 2 * 9, "more rows than before: warmed again"
