from __future__ import annotations

from pathlib import Path

import pytest

from shoal.shared.config import (
    ConfigError,
    load_config,
    parse_bytes,
    parse_gpu_spec,
    resolve_model_dir,
)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "shoal.toml"
    path.write_text(text)
    return path


def test_defaults_load_without_a_file() -> None:
    config = load_config(None, environ={})
    assert config.gateway.port == 8000
    assert config.node.gpus == "virtual:2x16GiB"
    assert config.scheduler.placement.gpu_fraction_factor == 3.0


def test_file_then_env_then_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, '[gateway]\nport = 9001\nhost = "0.0.0.0"\n[[models]]\nkey = "org/m"\npath = "m"\n')
    config = load_config(path, environ={"SHOAL_GATEWAY_PORT": "9002", "SHOAL_NATS_URL": "nats://x:1"})
    assert config.gateway.port == 9002 and config.gateway.host == "0.0.0.0"
    assert config.nats.url == "nats://x:1"
    assert [m.key for m in config.models] == ["org/m"]
    assert load_config(path, environ={}, overrides={"gateway": {"port": 9003}}).gateway.port == 9003


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[gateway]\nport = \"eighty\"\n", "gateway.port"),
        ("[gateway]\nport = 70000\n", "65535"),
        ("[gatewy]\nport = 1\n", "gatewy"),
        ("[node]\ngpus = \"virtual:two\"\n", "virtual:<count>x<size>"),
        ("[[models]]\nkey = \"m\"\npath = \"../escape\"\n", "models root"),
        ("[[models]]\nkey = \"m\"\npath = \"/abs\"\n", "relative"),
        ("[[models]]\nkey = \"a\"\npath = \"a\"\n[[models]]\nkey = \"a\"\npath = \"b\"\n", "duplicate"),
        ("[worker]\nengine = \"vllm\"\n", "worker.engine"),
        ("not toml = = 1", "not valid TOML"),
    ],
)
def test_bad_config_errors_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(_write(tmp_path, text), environ={})
    assert needle in str(excinfo.value)


def test_bad_env_override_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.port"):
        load_config(None, environ={"SHOAL_GATEWAY_PORT": "abc"})


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml", environ={})


def test_byte_sizes_and_gpu_specs() -> None:
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_gpu_spec("virtual:2x16GiB") == ("virtual", 2, 16 * 2**30)
    assert parse_gpu_spec("nvml") == ("nvml", 0, 0)
    for bad in ("virtual:0x1GiB", "virtual:2x", "cuda", "virtual:2x-1"):
        with pytest.raises(ConfigError):
            parse_gpu_spec(bad)


def test_model_dirs_stay_under_the_models_root(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "ok").mkdir(parents=True)
    assert resolve_model_dir(root, "ok") == (root / "ok").resolve()
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(ValueError, match="outside the models root"):
        resolve_model_dir(root, "link")
    with pytest.raises(ValueError):
        resolve_model_dir(root, "../outside")


def test_env_overrides_reach_nested_sections() -> None:
    config = load_config(
        None,
        environ={
            "SHOAL_SCHEDULER_PLACEMENT_FRACTION_THRESHOLD": "0.7",
            "SHOAL_SCHEDULER_RECONCILE_INTERVAL_S": "2.5",
            "SHOAL_GATEWAY_ADMIN_API_KEYS": "a,b",
        },
    )
    assert config.scheduler.placement.fraction_threshold == 0.7
    assert config.scheduler.reconcile_interval_s == 2.5
    assert config.gateway.admin_api_keys == ["a", "b"]


def test_unknown_nested_env_override_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown field `no_such_knob` - at `\$\.scheduler\.placement`"):
        load_config(None, environ={"SHOAL_SCHEDULER_PLACEMENT_NO_SUCH_KNOB": "1"})
