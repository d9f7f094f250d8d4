"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os

import pytest

from shoal.kernels import cpu_build, cpu_kernels


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
