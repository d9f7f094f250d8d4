"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import msgspec
import pytest

from shoal.kernels import cpu_build, cpu_kernels
from shoal.kernels.settings import configure, get_settings


@pytest.fixture(scope="session")
def native(tmp_path_factory: pytest.TempPathFactory) -> cpu_kernels.CpuKernels:
    """The native CPU kernels built by the machine's compiler into a directory of this test run."""
    try:
        compiler = cpu_build.default_compiler()
    except cpu_build.NativeBuildError as error:
        if os.environ.get("CI"):
            raise  # CI must not go without the native path
        pytest.skip(str(error))
    return cpu_kernels.build_and_load(compiler, [tmp_path_factory.mktemp("native-kernels")])


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
