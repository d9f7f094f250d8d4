"""A CUDA error that poisons the context ends the engine; other errors fail only their pass.

There is no GPU here: the error is raised where a real one surfaces (the forward pass, or
the next pass's input upload), with the message torch gives it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.services.worker.device_errors import is_fatal_device_error
from shoal.services.worker.engine.paged_engine import EngineConfig, PagedEngine
from shoal.services.worker.generation import EngineFailed, GenerationOutput, GenerationRequest
from shoal.shared.messages import SamplingParams
from tests.token_echo import TokenEcho

DEVICE_ASSERT = (
    "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported at some "
    "other API call, so the stacktrace below might be incorrect."
)


def test_sticky_cuda_errors_are_fatal_and_others_are_not() -> None:
    assert is_fatal_device_error(RuntimeError(DEVICE_ASSERT))
    assert is_fatal_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_fatal_device_error(RuntimeError("CUDA error: unspecified launch failure"))
    wrapped = ValueError("sampling failed")
    wrapped.__cause__ = RuntimeError(DEVICE_ASSERT)
    assert is_fatal_device_error(wrapped)
    assert not is_fatal_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_fatal_device_error(RuntimeError("shape '[1, 2]' is invalid for input of size 3"))
    assert not is_fatal_device_error(RuntimeError("CUDA error: invalid argument"))


def _engine(models_root: Path) -> PagedEngine:
    model = AutoModelForCausalLM.from_pretrained(models_root / "demo" / "llama-5m").eval()
    return PagedEngine(model, TokenEcho(), config=EngineConfig(num_blocks=64, block_size=4))


def _request(request_id: str, max_tokens: int = 50) -> GenerationRequest:
    return GenerationRequest(
        request_id, list(range(10, 30)), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )


async def _run(engine: PagedEngine, request: GenerationRequest) -> list[GenerationOutput]:
    return [output async for output in engine.generate(request)]


def _fail_passes_after(engine: PagedEngine, num_passes: int, error: Exception) -> None:
    """Fault injection: the runner's passes raise `error` after `num_passes` good ones."""
    execute = engine._runner.execute
    count = 0

    def failing(step: Any) -> torch.Tensor:
        nonlocal count
        count += 1
        if count > num_passes:
            raise error
        return execute(step)

    engine._runner.execute = failing  # type: ignore[method-assign]


async def test_a_device_side_assert_ends_every_request_and_the_engine(demo_models_root: Path) -> None:
    engine = _engine(demo_models_root)
    _fail_passes_after(engine, 3, RuntimeError(DEVICE_ASSERT))
    results = await asyncio.gather(*(_run(engine, _request(f"r{i}")) for i in range(3)), return_exceptions=True)
    assert all(isinstance(result, EngineFailed) for result in results), results
    assert isinstance(results[0], EngineFailed) and "device-side assert triggered" in str(results[0])
    assert engine.fatal_error is not None
    with pytest.raises(EngineFailed):  # later requests are refused the same way: nothing runs here again
        await _run(engine, _request("late"))
    await asyncio.to_thread(engine._thread.join, 5.0)
    assert not engine._thread.is_alive(), "the step thread stops"
    await engine.close()


async def test_an_ordinary_pass_failure_fails_its_requests_and_the_engine_serves_on(
    demo_models_root: Path,
) -> None:
    engine = _engine(demo_models_root)
    _fail_passes_after(engine, 0, RuntimeError("CUDA out of memory"))
    outputs = await _run(engine, _request("first"))
    assert outputs[-1].finish_reason == "error"
    engine._runner.execute = type(engine._runner).execute.__get__(engine._runner)  # type: ignore[method-assign]
    outputs = await _run(engine, _request("second", max_tokens=3))
    assert outputs[-1].finish_reason == "length" and engine.fatal_error is None
    await engine.close()


async def test_the_hf_engine_ends_the_same_way(demo_models_root: Path) -> None:
    from transformers import AutoTokenizer

    from shoal.services.worker.hf_engine import HFGenerateEngine

    path = demo_models_root / "demo" / "llama-5m"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    engine = HFGenerateEngine(model, AutoTokenizer.from_pretrained(path), 2048)

    def poisoned(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(DEVICE_ASSERT)

    model.generate = poisoned  # type: ignore[method-assign]
    with pytest.raises(EngineFailed, match="device-side assert"):
        await _run(engine, _request("r"))  # type: ignore[arg-type]
    with pytest.raises(EngineFailed):
        await _run(engine, _request("later"))  # type: ignore[arg-type]
