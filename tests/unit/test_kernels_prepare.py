"""`ops.prepare`: a server builds its KV kernels at startup, and refuses to start without them."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from shoal.kernels import ops
from shoal.kernels.cuda_ext import KernelBuildError


class Loader:
    """An injected extension loader that counts its calls and fails or succeeds as told."""

    def __init__(self, error: KernelBuildError | None = None) -> None:
        self.error = error
        self.num_calls = 0

    def __call__(self) -> ModuleType:
        self.num_calls += 1
        if self.error is not None:
            raise self.error
        return ModuleType("shoal_kv_ops")


def test_cuda_builds_the_kernels_up_front() -> None:
    load = Loader()
    assert ops.prepare(torch.device("cuda", 0), load=load, use_cuda_kernels=True) == "cuda"
    assert load.num_calls == 1


def test_a_failed_build_fails_startup_with_the_compilers_message() -> None:
    load = Loader(KernelBuildError("building Shoal's CUDA kernels failed: nvcc: not found"))
    with pytest.raises(KernelBuildError, match="nvcc: not found"):
        ops.prepare(torch.device("cuda"), load=load, use_cuda_kernels=True)
    assert load.num_calls == 1


def test_the_reference_path_is_an_explicit_choice_and_builds_nothing() -> None:
    load = Loader(KernelBuildError("must not be called"))
    assert ops.prepare(torch.device("cuda"), load=load, use_cuda_kernels=False) == "reference"
    assert load.num_calls == 0


def test_the_cpu_needs_no_kernels() -> None:
    load = Loader(KernelBuildError("must not be called"))
    assert ops.prepare(torch.device("cpu"), load=load, use_cuda_kernels=True) == "cpu"
    assert load.num_calls == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the real loader where CUDA is absent")
def test_the_real_loader_refuses_a_machine_without_cuda() -> None:
    with pytest.raises(KernelBuildError, match="CUDA is not available"):
        ops.prepare(torch.device("cuda"), use_cuda_kernels=True)


def test_the_configured_cuda_setting_decides_when_not_passed(kernel_settings) -> None:
    kernel_settings(cuda="reference")
    assert ops.prepare(torch.device("cuda"), load=Loader(KernelBuildError("must not be called"))) == "reference"
    kernel_settings(cuda="kernels")
    load = Loader()
    assert ops.prepare(torch.device("cuda"), load=load) == "cuda"
    assert load.num_calls == 1
