"""`KernelSettings` and `configure`: validated values, today's defaults, applied process-wide."""

from __future__ import annotations

import re
import subprocess
import sys

import msgspec
import pytest

from shoal.kernels.settings import KernelSettings, configure, get_settings, on_configure


def test_the_defaults_are_the_kernels_and_the_native_cpu_code() -> None:
    assert KernelSettings() == KernelSettings(
        cuda="kernels", cpu="native", cpu_attention="native", check_cuda_indices=False
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cuda": "cuda"}, "kernels.cuda must be one of 'kernels', 'reference', got 'cuda'"),
        ({"cpu": "fast"}, "kernels.cpu must be one of 'native', 'torch', got 'fast'"),
        ({"cpu_attention": ""}, "kernels.cpu_attention must be one of 'native', 'torch', got ''"),
    ],
)
def test_a_value_outside_its_set_is_refused_with_the_allowed_ones(fields, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        KernelSettings(**fields)
    with pytest.raises(msgspec.ValidationError, match=f"Invalid enum value '{next(iter(fields.values()))}'"):
        msgspec.convert(fields, KernelSettings, strict=False)


def test_check_cuda_indices_is_a_boolean() -> None:
    with pytest.raises(ValueError, match=r"kernels\.check_cuda_indices must be true or false, got 'yes'"):
        KernelSettings(check_cuda_indices="yes")  # type: ignore[arg-type]


def test_the_config_loader_decodes_strings_and_refuses_unknown_fields() -> None:
    """What the config loader does with ``[worker.kernels]`` and ``SHOAL_WORKER_KERNELS_*``."""
    decoded = msgspec.convert(
        {"cuda": "reference", "cpu_attention": "torch", "check_cuda_indices": "true"}, KernelSettings, strict=False
    )
    assert decoded == KernelSettings(cuda="reference", cpu_attention="torch", check_cuda_indices=True)
    assert msgspec.toml.decode(b'cpu = "torch"\n', type=KernelSettings) == KernelSettings(cpu="torch")
    with pytest.raises(msgspec.ValidationError, match="unknown field `kernels`"):
        msgspec.convert({"kernels": "reference"}, KernelSettings, strict=False)


def test_settings_are_frozen_and_configure_takes_only_them() -> None:
    settings = KernelSettings()
    with pytest.raises(AttributeError):
        settings.cpu = "torch"  # type: ignore[misc]
    with pytest.raises(TypeError, match="KernelSettings"):
        configure({"cpu": "torch"})  # type: ignore[arg-type]


def test_configure_replaces_the_settings_and_tells_each_listener(kernel_settings) -> None:
    before = get_settings()
    seen: list[tuple[KernelSettings, KernelSettings]] = []
    stop = on_configure(lambda previous, new: seen.append((previous, new)))
    try:
        kernel_settings(cpu="torch")
        assert get_settings() == msgspec.structs.replace(before, cpu="torch")
        assert seen == [(before, get_settings())]
    finally:
        stop()
    kernel_settings(cpu="native")
    assert len(seen) == 1


def test_the_settings_module_imports_no_torch() -> None:
    """The config loader imports it: it must stay light."""
    code = "import sys, shoal.kernels.settings, shoal.kernels; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
