"""The native forward's helper threads: after a pass they look for the next one for ~2 ms
(a decode step comes that soon), unless told the next work is not theirs — a pass run on one
thread, or `rest_threads` from an engine with nothing to run — and then they sleep at once,
leaving their core to the event loop, NATS and the gateway."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shoal.kernels import cpu_kernels
from shoal.kernels.cpu_model import PackedLinear, ThreadStats, get_thread_stats, rest_threads

native = cpu_kernels.try_load()
pytestmark = pytest.mark.skipif(native is None, reason="the native CPU library is not built here")

WAIT_S = 5.0
"""Longest wait for a helper to end an idle wait: its window is ~2 ms, but a loaded machine
may keep it off a core for a while."""


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(512, 256, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def linear(weight: torch.Tensor) -> PackedLinear:
    assert native is not None
    return PackedLinear(native, weight, None)


@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    return torch.randn(64, 256, generator=torch.Generator().manual_seed(1))


def _stats() -> ThreadStats:
    assert native is not None
    return get_thread_stats(native)


def _num_idle_ends(stats: ThreadStats) -> int:
    return stats.num_idle_told + stats.num_idle_timed_out


def _wait_for_idle_ends(before: ThreadStats, count: int) -> ThreadStats:
    """The stats once `count` more idle waits ended after `before`."""
    give_up_at = time.monotonic() + WAIT_S
    while True:
        stats = _stats()
        if _num_idle_ends(stats) >= _num_idle_ends(before) + count:
            return stats
        assert time.monotonic() < give_up_at, f"helpers did not go to sleep: {before} -> {stats}"
        time.sleep(0.0005)


def _wait_until_settled(before: ThreadStats) -> ThreadStats:
    """The stats once every helper ended an idle wait after `before` and nothing changed for
    50 ms (the helpers are asleep)."""
    stats = _wait_for_idle_ends(before, _stats().num_helpers)
    while True:
        time.sleep(0.05)
        now = _stats()
        if now == stats:
            return now
        stats = now


def _shared_pass(linear: PackedLinear, rows: torch.Tensor) -> ThreadStats:
    """One product on two threads; returns the stats from just before it."""
    before = _stats()
    linear.forward(rows, num_threads=2)
    return before


@pytest.fixture
def helpers_asleep(linear: PackedLinear, rows: torch.Tensor) -> int:
    """Helpers started and asleep; returns how many there are."""
    before = _shared_pass(linear, rows)
    num_helpers = _stats().num_helpers
    assert num_helpers >= 1
    _wait_for_idle_ends(before, num_helpers)
    return num_helpers


def test_untold_helpers_look_for_the_next_pass_then_sleep(helpers_asleep: int, linear: PackedLinear,
                                                          rows: torch.Tensor) -> None:
    before = _shared_pass(linear, rows)
    after = _wait_for_idle_ends(before, helpers_asleep)
    assert after.num_shared_programs == before.num_shared_programs + 1
    assert after.num_idle_timed_out == before.num_idle_timed_out + helpers_asleep
    assert after.num_idle_told == before.num_idle_told


def test_rest_threads_sends_idle_helpers_to_sleep(helpers_asleep: int, linear: PackedLinear,
                                                  rows: torch.Tensor) -> None:
    assert native is not None

    def rest() -> torch.Tensor:
        assert native is not None
        rest_threads(native)
        return torch.empty(0)

    _assert_told_after(rest, helpers_asleep, linear, rows)


def test_a_pass_on_one_thread_sends_idle_helpers_to_sleep(helpers_asleep: int, linear: PackedLinear,
                                                          rows: torch.Tensor) -> None:
    alone = _assert_told_after(lambda: linear.forward(rows, num_threads=1), helpers_asleep, linear, rows)
    torch.testing.assert_close(alone, linear.forward(rows, num_threads=2), rtol=0, atol=0)


def _assert_told_after(tell: Callable[[], torch.Tensor], num_helpers: int, linear: PackedLinear,
                       rows: torch.Tensor) -> torch.Tensor:
    """A shared pass, then `tell` right after it: the helpers go to sleep told, not after their
    ~2 ms look. Up to 3 tries: only this thread kept off the CPU for 2 ms between the pass
    and `tell` lets them time out first."""
    for _ in range(3):
        before = _shared_pass(linear, rows)
        result = tell()
        after = _wait_for_idle_ends(before, num_helpers)
        assert _num_idle_ends(after) == _num_idle_ends(before) + num_helpers
        assert after.num_shared_programs == before.num_shared_programs + 1  # `tell` posted nothing
        if after.num_idle_told > before.num_idle_told:
            return result
    raise AssertionError(f"helpers timed out instead of resting, 3 times: {before} -> {after}")


def test_a_rested_helper_wakes_for_the_next_shared_pass(helpers_asleep: int, linear: PackedLinear,
                                                       weight: torch.Tensor, rows: torch.Tensor) -> None:
    """After a rest the helpers sleep on the futex: each pass wakes them again (counted: each
    ends one more idle wait) and the products stay right."""
    assert native is not None
    for _ in range(3):
        before = _stats()
        torch.testing.assert_close(linear.forward(rows, num_threads=2), rows @ weight.T, rtol=1e-4, atol=1e-4)
        rest_threads(native)
        after = _wait_for_idle_ends(before, helpers_asleep)
        assert after.num_shared_programs == before.num_shared_programs + 1


def test_helpers_are_named(helpers_asleep: int) -> None:
    names = [Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in os.listdir("/proc/self/task")]
    # At least this library's (a test that builds another variant of it loads its own).
    assert sum(name.startswith("shoal-fwd-") for name in names) >= helpers_asleep


async def test_an_engine_with_nothing_to_run_rests_its_helpers(demo_models_root: Path) -> None:
    """Every pass on two threads (prefill and decode alike), so only the engine itself can
    tell the helpers to rest: it does when its last request is done."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shoal.services.worker.engine.factory import build_paged_engine
    from shoal.services.worker.generation import GenerationRequest
    from shoal.services.worker.loader import LoadedModel
    from shoal.shared.config import WorkerConfig
    from shoal.shared.messages import SamplingParams

    model_dir = demo_models_root / "demo" / "llama-5m"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = LoadedModel(model, AutoTokenizer.from_pretrained(model_dir), torch.device("cpu"), torch.float32, 0,
                         int(model.config.max_position_embeddings), 0)
    engine = build_paged_engine(loaded, WorkerConfig(cpu_threads=2), kv_cache_tokens=1024)
    try:
        assert engine.forward == "native"
        told = []
        for number in range(3):
            before = _stats()
            request = GenerationRequest(f"r{number}", list(range(10, 40)), SamplingParams(max_tokens=4, ignore_eos=True),
                                        frozenset(), 1024)
            outputs = [output async for output in engine.generate(request)]
            assert outputs[-1].finished and outputs[-1].num_completion_tokens == 4
            after = _wait_until_settled(before)
            assert after.num_shared_programs >= before.num_shared_programs + 4  # prefill and 3 decode passes
            told.append(after.num_idle_told - before.num_idle_told)
        # Rest comes microseconds after the last pass, long before a helper's ~2 ms look ends
        # (only the step thread kept off the CPU for that long lets one time out first).
        assert sum(told) >= 1, told
    finally:
        await engine.close()

