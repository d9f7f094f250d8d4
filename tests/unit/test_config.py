from __future__ import annotations

from pathlib import Path

import pytest

from shoal.shared.config import (
    ConfigError,
    SessionConfig,
    load_config,
    parse_bytes,
    parse_gpu_spec,
)
from shoal.shared.kv_cache.session_settings import SessionSettings
from shoal.shared.messages import ModelSpec
from shoal.shared.model_settings import ModelSettings, resolve_model_dir


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
        ("[[models]]\nkey = \"m\"\npath = \"m\"\ndtype = \"int3\"\n", "models[0].dtype"),
        ("[[models]]\nkey = \"m\"\npath = \"m\"\nmemory_override_bytes = \"lots\"\n",
         "not a byte size: 'lots' (examples: 512MiB, 16GiB, 80GB, 1073741824) - at `$.models[0].memory_override_bytes`"),
        ("[node]\ncpu_ram_bytes = -1\n", "cpu_ram_bytes >= 0"),
        ("[[models]]\nkey = \"m\"\npath = \"m\"\n[models.fairness]\nmin_runtim_s = 3\n",
         "unknown field `min_runtim_s` - at `$.models[0].fairness` (model 'm')"),
        ("[[models]]\nkey = \"a\"\npath = \"a\"\n[[models]]\nkey = \"chat\"\npath = \"c\"\n"
         "[models.sleep]\ndrain_timeout_s = \"long\"\n", "at `$.models[1].sleep.drain_timeout_s` (model 'chat')"),
        ("[[models]]\nkey = \"m\"\npath = \"m\"\n[models.sleep]\nlevel = \"frozen\"\n", "models[0].sleep.level"),
        ("[[models]]\nkey = \"m\"\npath = \"m\"\n[models.sleep]\nidle_timeout_s = -1\n", "idle_timeout_s"),
        ("[[models]]\nkey = \"m\"\npath = \"m\"\ntool_call_parser = \"granite\"\n",
         "models[0].tool_call_parser"),
        ("[[models]]\nkey = \"m\"\npath = \"m\"\nreasoning_parser = \"think\"\n",
         "models[0].reasoning_parser"),
        ("[gateway]\nresponses_ttl_s = 0\n", "responses_ttl_s"),
        ("[gateway]\nfiles_ttl_s = 0\n", "files_ttl_s"),
        ("[gateway]\nmax_file_bytes = 2048\nfiles_max_bytes = 1024\n", "files_max_bytes at least max_file_bytes"),
        ("[gateway]\nbatch_concurrency = 0\n", "batch_concurrency and max_running_batches must be >= 1"),
        ("[gateway]\nbatch_save_interval_s = 0.5\n", "gateway.batch_save_interval_s must be a number >= 1"),
        ("[gateway]\ncors_origins = [\"localhost:3000\"]\n", "gateway.cors_origins: 'localhost:3000' is not an origin"),
        ("[gateway]\ncors_origins = [\"http://a.example/app\"]\n", "is not an origin"),
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
            "SHOAL_GATEWAY_CORS_ORIGINS": "http://localhost:3000,https://chat.example.com",
        },
    )
    assert config.scheduler.placement.fraction_threshold == 0.7
    assert config.scheduler.reconcile_interval_s == 2.5
    assert config.gateway.admin_api_keys == ["a", "b"]
    assert config.gateway.cors_origins == ["http://localhost:3000", "https://chat.example.com"]


def test_unknown_nested_env_override_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown field `no_such_knob` - at `\$\.scheduler\.placement`"):
        load_config(None, environ={"SHOAL_SCHEDULER_PLACEMENT_NO_SUCH_KNOB": "1"})


def test_every_bytes_setting_takes_a_size_string_in_the_file_and_the_environment(tmp_path: Path) -> None:
    path = _write(tmp_path, '[node]\ncpu_ram_bytes = "64GiB"\n[[models]]\nkey = "m"\npath = "m"\n'
                            'memory_override_bytes = "24GiB"\n')
    config = load_config(path, environ={"SHOAL_WORKER_RUNTIME_OVERHEAD_BYTES": "256MiB"})
    assert config.node.cpu_ram_bytes == 64 * 2**30
    assert config.models[0].memory_override_bytes == 24 * 2**30
    assert config.worker.runtime_overhead_bytes == 256 * 2**20


def test_a_model_spec_is_derived_from_the_models_settings() -> None:
    """One declaration: every setting of a [[models]] entry reaches the spec unchanged, and
    the spec adds only what the cluster learns."""
    config = load_config(None, environ={}, overrides={"models": [{
        "key": "org/m", "path": "m", "dtype": "bfloat16", "max_model_len": 512, "kv_cache_tokens": 100,
        "memory_override_bytes": "1GiB", "num_gpus": 2, "min_replicas": 3, "max_queue": 9,
        "tool_call_parser": "llama3_json", "reasoning_parser": "qwen3", "grammar_after_reasoning": False, "fairness": {"popular": True, "min_runtime_s": 30}, "sleep": {"idle_timeout_s": 120, "level": "cold"},
    }]})
    settings = config.models[0]
    spec = ModelSpec.from_settings(settings, source="config", registered_at=12.0)
    for name in ModelSettings.__struct_fields__:
        assert getattr(spec, name) == getattr(settings, name), name
    assert (spec.desired_replicas, spec.source, spec.registered_at) == (3, "config", 12.0)
    assert set(ModelSpec.__struct_fields__) >= set(ModelSettings.__struct_fields__)


def test_kernel_settings_are_worker_settings_and_the_old_variables_say_where_they_went() -> None:
    config = load_config(None, environ={"SHOAL_WORKER_KERNELS_CPU_ATTENTION": "torch"})
    assert config.worker.kernels.cpu_attention == "torch"
    with pytest.raises(ConfigError, match=r"SHOAL_CPU_ATTENTION is no longer read: set SHOAL_WORKER_KERNELS_CPU_ATTENTION"):
        load_config(None, environ={"SHOAL_CPU_ATTENTION": "torch"})
    with pytest.raises(ConfigError, match=r"cpu_attention"):
        load_config(None, environ={"SHOAL_WORKER_KERNELS_CPU_ATTENTION": "fast"})


def test_the_session_cache_is_on_by_default_and_declared_once() -> None:
    """``[worker.sessions]`` is the engine's `SessionSettings` (one declaration) plus `enabled`,
    with a worker's host pool; a bare engine's settings keep theirs."""
    sessions = load_config(None, environ={}).worker.sessions
    assert isinstance(sessions, SessionSettings) and sessions.enabled
    assert sessions.host_pool_bytes == 256 * 2**20 and SessionSettings().host_pool_bytes == 0
    assert set(SessionConfig.__struct_fields__) == {*SessionSettings.__struct_fields__, "enabled"}
    for name in set(SessionSettings.__struct_fields__) - {"host_pool_bytes"}:
        assert getattr(sessions, name) == getattr(SessionSettings(), name), name


def test_session_settings_from_the_file_and_the_environment(tmp_path: Path) -> None:
    path = _write(tmp_path, '[worker.sessions]\nhost_pool_bytes = "1GiB"\nidle_timeout_s = 60\n'
                            '[worker.sessions.cost_model]\nseconds_per_token = 1e-5\nseconds_per_token_pair = 1e-8\n')
    config = load_config(path, environ={"SHOAL_WORKER_SESSIONS_ENABLED": "false",
                                        "SHOAL_WORKER_SESSIONS_GPU_FRACTION": "0.5"})
    sessions = config.worker.sessions
    assert (sessions.host_pool_bytes, sessions.idle_timeout_s, sessions.gpu_fraction) == (2**30, 60.0, 0.5)
    assert not sessions.enabled and sessions.cost_model is not None
    assert sessions.cost_model.seconds_per_token == 1e-5


@pytest.mark.parametrize("environ, needle", [
    ({"SHOAL_WORKER_SESSIONS_GPU_FRACTION": "1.5"}, r"gpu_fraction .* within \[0, 1\] - at `\$\.worker\.sessions`"),
    ({"SHOAL_WORKER_SESSIONS_IDLE_TIMEOUT_S": "0"}, r"idle_timeout_s and min_idle_s must be positive"),
    ({"SHOAL_WORKER_SESSIONS_HOST_POOL_BYTES": "lots"}, r"not a byte size: 'lots'"),
    ({"SHOAL_WORKER_SESSIONS_CHUNKS": "4"}, r"unknown field `chunks` - at `\$\.worker\.sessions`"),
])
def test_bad_session_settings_name_the_key(environ: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(None, environ=environ)
