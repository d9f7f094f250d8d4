"""Fixtures shared by the unit tests."""

from __future__ import annotations

import fcntl
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from shoal.kernels import cpu_build, cpu_kernels
from shoal.kernels.settings import configure, get_settings
from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.paged_engine import PagedEngine


@pytest.fixture(scope="session")
def native(tmp_path_factory: pytest.TempPathFactory) -> cpu_kernels.CpuKernels:
    """The native CPU kernels built by the machine's compiler into a directory of this test run."""
    try:
        compiler = cpu_build.default_compiler()
    except cpu_build.NativeBuildError as error:
        if os.environ.get("CI"):
            raise  # CI must not go without the native path
        pytest.skip(str(error))
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return cpu_kernels.build_and_load(compiler, [tmp_path_factory.mktemp("native-kernels")])
    # Under xdist the workers share this run's directory, and the first one to get there builds
    # (a compile takes seconds of a CPU the other worker's tests need).
    shared = tmp_path_factory.getbasetemp().parent
    with open(shared / "native-kernels.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return cpu_kernels.build_and_load(compiler, [shared / "native-kernels"])


@pytest.fixture
def kernel_settings() -> Iterator[Callable[..., None]]:
    """Changes the kernels' settings for one test: ``kernel_settings(cpu="torch")`` configures
    the settings before the test with those fields replaced; the previous ones are restored
    (`configure`) after it."""
    previous = get_settings()

    def apply(**fields: object) -> None:
        configure(msgspec.structs.replace(previous, **fields))

    yield apply
    configure(previous)


@pytest.fixture
async def small_engine(demo_models_root: Path) -> AsyncIterator[tuple[PagedEngine, Any]]:
    """A paged engine on llama-5m with a small pool (64 blocks of 4 tokens, 4 sequences), and
    the model's tokenizer."""
    model_dir = demo_models_root / "demo" / "llama-5m"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    built = PagedEngine(AutoModelForCausalLM.from_pretrained(model_dir).eval(), tokenizer,
                        config=EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=4))
    yield built, tokenizer
    await built.close()
