"""The placement knobs in shoal.toml, the measured-figure rule, and `shoal status` using them."""

from __future__ import annotations

import io

import pytest

from shoal.cli.inspection import render_status
from shoal.shared.config import ConfigError, load_config
from shoal.shared.messages import ModelSpec
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.memory_figure import next_measured_figure

GiB = 1 << 30


def test_every_knob_can_be_set_in_the_config_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "shoal.toml"
    path.write_text(
        "[scheduler.placement]\n"
        "gpu_fraction_factor = 2.0\nfraction_threshold = 0.9\nmin_available_gpu_fraction = 0.0\n"
        "unknown_extra_gpus = 0\nmin_gpu_memory_fraction = 0.05\nmax_gpu_memory_fraction = 0.95\n"
        "warm_cache_fraction = 0.25\n"
    )
    config = load_config(path, environ={}).scheduler.placement
    assert (config.gpu_fraction_factor, config.fraction_threshold, config.min_available_gpu_fraction) == (2.0, 0.9, 0.0)
    assert (config.unknown_extra_gpus, config.min_gpu_memory_fraction, config.max_gpu_memory_fraction) == (0, 0.05, 0.95)
    assert config.warm_cache_fraction == 0.25
    assert config.clamp_gpu_memory_fraction(0.99) == 0.95


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("unknown_extra_gpus = -1", "unknown_extra_gpus must be >= 0, got -1 - at `$.scheduler.placement`"),
        ("warm_cache_fraction = 1.5", "warm_cache_fraction must be in [0, 1], got 1.5 - at `$.scheduler.placement`"),
        ("min_gpu_memory_fraction = 0.5\nmax_gpu_memory_fraction = 0.4",
         "min_gpu_memory_fraction and max_gpu_memory_fraction need 0 < min <= max <= 1"),
        ("gpu_fraction_factor = 0.5", "gpu_fraction_factor must be >= 1.0, got 0.5 - at `$.scheduler.placement`"),
        ("fraction_treshold = 0.5", "unknown field `fraction_treshold`"),
    ],
)
def test_a_bad_knob_is_an_error_naming_it(tmp_path, section: str, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "shoal.toml"
    path.write_text(f"[scheduler.placement]\n{section}\n")
    with pytest.raises(ConfigError, match="invalid configuration") as excinfo:
        load_config(path, environ={})
    assert message in str(excinfo.value)


def test_a_create_sets_the_measured_figure_and_a_restore_only_raises_it() -> None:
    assert next_measured_figure(None, 3 * GiB, restored=False) == 3 * GiB
    assert next_measured_figure(4 * GiB, 3 * GiB, restored=False) == 3 * GiB, "a new replica is the reference"
    assert next_measured_figure(4 * GiB, 3 * GiB, restored=True) == 4 * GiB, "one low restore reading is ignored"
    assert next_measured_figure(4 * GiB, 5 * GiB, restored=True) == 5 * GiB
    assert next_measured_figure(None, 2 * GiB, restored=True) == 2 * GiB
    assert next_measured_figure(4 * GiB, None, restored=False) == 4 * GiB
    assert next_measured_figure(4 * GiB, 0, restored=True) == 4 * GiB


def test_status_shows_memory_figures_with_the_configured_factor() -> None:
    models = [ModelSpec(key="m", path="m", weight_bytes=GiB, desired_replicas=1)]
    default, configured = io.StringIO(), io.StringIO()
    render_status({}, {}, [], models, default)
    render_status({}, {}, [], models, configured,
                  config=PlacementConfig(gpu_fraction_factor=2.0))
    assert "memory=3.00 GiB (factor)" in default.getvalue()
    assert "memory=2.00 GiB (factor)" in configured.getvalue()


def test_status_shows_a_failing_models_failures_backoff_and_last_error() -> None:
    failing = ModelSpec(key="broken", path="broken", num_failures=3, hold_until=1_000_030.0,
                        last_error="worker exited with code 1:\n  OSError: truncated safetensors file " + "x" * 300)
    out = io.StringIO()
    render_status({}, {}, [], [failing, ModelSpec(key="fine", path="fine")], out, now=1_000_000.0)
    lines = out.getvalue().splitlines()
    (line,) = [text for text in lines if "failing:" in text]
    assert line.strip().startswith("failing: 3 in a row, placement held 30 s more; last error: worker exited with "
                                   "code 1: OSError: truncated safetensors file")
    assert len(line) < 240 and line.endswith("...")
