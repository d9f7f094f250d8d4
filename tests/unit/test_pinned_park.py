"""The wake's repointing (`pinned_park.point_at`), on the CPU: a model's tensors laid out in one
buffer as a park lays them (`lay_out`), then pointed at a copy of that buffer as a wake points
them at the device's. On CUDA the same functions run around the side-stream copy
(tests/gpu/test_park_restore_cuda.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.services.worker.pinned_park import PinnedWeights, SlotViews, _contiguous_strides, lay_out, point_at

PROMPT = torch.tensor([[5, 17, 29, 3, 41, 8]])


def _parked(model: torch.nn.Module) -> PinnedWeights:
    """What `park_to_pinned_host` makes of a CUDA model, in ordinary host memory."""
    tensors = [*model.parameters(), *model.buffers()]
    slots, num_bytes = lay_out(tensors)
    host = torch.empty(num_bytes, dtype=torch.uint8)
    views = SlotViews(host)
    with torch.no_grad():
        for slot in slots:
            view = views(slot)
            view.copy_(slot.tensor)
            slot.tensor.data = view
    return PinnedWeights(host, slots, holds_every_tensor=True)


@pytest.mark.parametrize("key", ["demo/llama-5m", "demo/qwen2-25m"])
def test_every_tensor_points_at_its_slice_of_the_copy_and_the_model_answers_as_before(
    demo_models_root: Path, key: str
) -> None:
    model = AutoModelForCausalLM.from_pretrained(demo_models_root / key, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = model(PROMPT).logits
    parked = _parked(model)
    target = parked.host.clone()

    assert point_at(parked, target)

    for slot in parked.slots:
        assert slot.tensor.data_ptr() == target.data_ptr() + slot.offset
        assert slot.tensor.shape == slot.shape and slot.tensor.is_contiguous()
    parked.host.zero_()  # nothing reads the old buffer any more
    with torch.inference_mode():
        assert torch.equal(model(PROMPT).logits, expected)


def test_a_tensor_no_longer_on_the_host_buffer_is_left_alone_and_the_wake_is_incomplete(
    demo_models_root: Path,
) -> None:
    model = AutoModelForCausalLM.from_pretrained(demo_models_root / "demo/llama-5m", dtype=torch.float32)
    parked = _parked(model)
    reloaded = parked.slots[0].tensor
    reloaded.data = reloaded.data.clone()  # a cold sleep's reload puts it elsewhere
    target = parked.host.clone()

    assert not point_at(parked, target)

    assert reloaded.data_ptr() != target.data_ptr() + parked.slots[0].offset
    assert all(slot.tensor.data_ptr() == target.data_ptr() + slot.offset for slot in parked.slots[1:])


def test_a_park_that_did_not_hold_every_tensor_is_incomplete(demo_models_root: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(demo_models_root / "demo/llama-5m", dtype=torch.float32)
    parked = _parked(model)
    parked.holds_every_tensor = False  # the parameters were dropped before the park (cold sleep)

    assert not point_at(parked, parked.host.clone())


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 0, 4), (1, 3, 1, 2)])
def test_contiguous_strides_are_torchs(shape: tuple[int, ...]) -> None:
    assert _contiguous_strides(torch.Size(shape)) == torch.empty(shape).stride()
