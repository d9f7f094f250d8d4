"""Deployment files: compose.yaml validated by `docker-compose config`, the Dockerfile by its text.

No Docker engine runs on these machines; `docker-compose config` (Debian's docker-compose
package, v1.29) parses and validates the file without one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from shoal.shared.nats_permissions import ADMIN_USER, ROLES, password_variable, render_users, user_name
from shoal.shared.nats_server import find_nats_server_binary

REPO_ROOT = Path(__file__).resolve().parents[2]
NATS_NODES = ("nats-1", "nats-2", "nats-3")
CLUSTER_URL = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"
SECRETS = {"SHOAL_ADMIN_API_KEYS": "test-admin-key", **{password_variable(role): f"pw-{role}" for role in ROLES},
           "SHOAL_NATS_ADMIN_PASSWORD": "pw-admin"}
"""What scripts/compose_env.sh writes to .env: compose refuses to start without each."""
SCHEDULER_METRICS_PORT = 9101
NODE_AGENT_METRICS_PORT = 9102
GRAFANA_DIR = REPO_ROOT / "docs" / "grafana"


def _metrics_args(port: int) -> list[str]:
    return ["--metrics-port", str(port), "--metrics-host", "0.0.0.0"]


def _compose_config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("the docker-compose binary is not installed (Debian package: docker-compose)")
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    return subprocess.run([binary, "-f", "compose.yaml", "config"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60, env={**clean, **env})


@pytest.fixture(scope="module")
def compose_config() -> dict[str, Any]:
    """The compose file as `docker-compose config` resolves it, with its secrets set."""
    result = _compose_config(SECRETS)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert isinstance(config, dict)
    return config


def _argv(service: dict[str, Any]) -> list[str]:
    """A service's command as an argument list (compose accepts a string or a list)."""
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else command


def test_compose_names_the_services_the_demo_models_job_and_the_monitoring_profile(
    compose_config: dict[str, Any]
) -> None:
    services = compose_config["services"]
    assert set(services) == {*NATS_NODES, "gateway", "scheduler", "node-agent", "demo-models", "prometheus",
                             "grafana"}
    profiled = {name for name, service in services.items() if service.get("profiles")}
    assert profiled == {"prometheus", "grafana"}, "a plain `docker compose up` starts Shoal alone"
    assert all(services[name]["profiles"] == ["monitoring"] for name in profiled)


def test_nats_runs_a_three_node_jetstream_cluster_with_shoals_users(compose_config: dict[str, Any]) -> None:
    for name in NATS_NODES:
        nats = compose_config["services"][name]
        assert nats["image"] == "nats:2.10-alpine"
        assert _argv(nats) == ["-c", "/etc/nats/nats.conf", "--name", name]
        assert f"{name}-data:/data:rw" in nats["volumes"] and f"{name}-data" in compose_config["volumes"]
        assert _mounts(nats)["/etc/nats"] == str(REPO_ROOT / "deploy" / "nats")
        assert nats["environment"] == {password_variable(role): f"pw-{role}" for role in ROLES} | {
            "SHOAL_NATS_ADMIN_PASSWORD": "pw-admin"}
    config = (REPO_ROOT / "deploy" / "nats" / "nats.conf").read_text()
    assert "routes: [\n    nats://nats-1:6222\n    nats://nats-2:6222\n    nats://nats-3:6222\n  ]" in config
    assert "include ./shoal-users.conf" in config and "max_payload: 8MB" in config
    assert (REPO_ROOT / "deploy" / "nats" / "shoal-users.conf").read_text() == render_users()


def test_the_nats_config_compose_ships_is_valid_for_nats_server(tmp_path: Path) -> None:
    """`nats-server -t` parses it (with the passwords in its environment, as compose gives them)."""
    result = subprocess.run([find_nats_server_binary(), "-t", "-c", str(REPO_ROOT / "deploy" / "nats" / "nats.conf")],
                            capture_output=True, text=True, timeout=30, env={**os.environ, **SECRETS})
    assert result.returncode == 0 and "is valid" in result.stderr + result.stdout, result.stderr


def test_compose_refuses_to_start_without_its_secrets() -> None:
    for missing in SECRETS:
        result = _compose_config({k: v for k, v in SECRETS.items() if k != missing})
        assert result.returncode != 0 and missing in result.stderr and "compose_env.sh" in result.stderr


def test_service_commands_are_the_cli_contract(compose_config: dict[str, Any]) -> None:
    services = compose_config["services"]
    gateway_args = ["--host", "0.0.0.0", "--port", "8000"]
    assert _argv(services["gateway"]) == ["gateway", *gateway_args]
    assert _argv(services["scheduler"]) == ["scheduler", *_metrics_args(SCHEDULER_METRICS_PORT)]
    assert _argv(services["node-agent"]) == [
        "node-agent",
        "--node-id",
        "node-a",
        "--gpus",
        "nvml",
        "--models-root",
        "/models",
        *_metrics_args(NODE_AGENT_METRICS_PORT),
    ]
    for name in ("scheduler", "node-agent"):
        assert "ports" not in services[name], "their /metrics stay inside the compose network"
    for name in ("gateway", "scheduler", "node-agent"):
        assert services[name]["build"]["context"] == str(REPO_ROOT)
        assert {services[name]["depends_on"][node]["condition"] for node in NATS_NODES} == {"service_healthy"}
    assert set(services["gateway"]["depends_on"]) == set(services["node-agent"]["depends_on"]) == set(NATS_NODES)


def test_every_service_connects_to_the_whole_cluster_as_its_own_user(compose_config: dict[str, Any]) -> None:
    services = compose_config["services"]
    for name, role in (("gateway", "gateway"), ("scheduler", "scheduler"), ("node-agent", "node-agent")):
        env = services[name]["environment"]
        assert env["SHOAL_NATS_URL"] == CLUSTER_URL and env["SHOAL_NATS_REPLICAS"] == "3"
        assert (env["SHOAL_NATS_USER"], env["SHOAL_NATS_PASSWORD"]) == (user_name(role), f"pw-{role}")
        assert not any("--nats-url" in arg for arg in _argv(services[name])), "nothing about NATS on argv"
    node_env = services["node-agent"]["environment"]
    assert (node_env["SHOAL_NATS_WORKERS_USER"], node_env["SHOAL_NATS_WORKERS_PASSWORD"]) == (
        user_name("worker"), "pw-worker")
    assert ADMIN_USER in render_users()


def test_gateway_is_published_on_loopback_with_keys_from_the_environment(compose_config: dict[str, Any]) -> None:
    gateway = compose_config["services"]["gateway"]
    assert gateway["ports"] == ["127.0.0.1:8000:8000/tcp"], "no open admin API on the network by default"
    assert gateway["environment"]["SHOAL_GATEWAY_ADMIN_API_KEYS"] == "test-admin-key"
    assert gateway["environment"]["SHOAL_GATEWAY_API_KEYS"] == ""


def test_compose_env_script_writes_every_secret_once(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "compose_env.sh"
    script.write_text((REPO_ROOT / "scripts" / "compose_env.sh").read_text())
    subprocess.run(["bash", str(script)], check=True, capture_output=True, timeout=30)
    written = dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines())
    assert set(written) == set(SECRETS) and len(set(written.values())) == len(SECRETS)
    assert all(len(value) == 48 for value in written.values())
    assert (tmp_path / ".env").stat().st_mode & 0o077 == 0, "only its owner may read it"
    before = (tmp_path / ".env").read_text()
    subprocess.run(["bash", str(script)], check=True, capture_output=True, timeout=30)
    assert (tmp_path / ".env").read_text() == before, "an existing .env is kept"


def test_scheduler_sees_the_models_so_they_get_registered(compose_config: dict[str, Any]) -> None:
    services = compose_config["services"]
    scheduler = services["scheduler"]
    assert "models:/models:ro" in scheduler["volumes"]
    assert scheduler["environment"]["SHOAL_NODE_MODELS_ROOT"] == "/models"
    assert scheduler["depends_on"]["demo-models"] == {"condition": "service_completed_successfully"}
    demo = services["demo-models"]
    assert _argv(demo) == ["demo-models", "--models-root", "/models"]
    assert "models:/models:rw" in demo["volumes"] and demo["restart"] == "no"


def test_node_agent_reserves_nvidia_gpus_and_mounts_models(compose_config: dict[str, Any]) -> None:
    node_agent = compose_config["services"]["node-agent"]
    devices = node_agent["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "models:/models:rw" in node_agent["volumes"]
    assert node_agent["init"] is True, "an init reaps the workers of a fork server that died"


def test_compose_shows_the_virtual_gpu_alternative() -> None:
    assert "--gpus virtual:2x16GiB" in (REPO_ROOT / "compose.yaml").read_text()


def test_dockerfile_installs_torch_then_shoal_in_each_variant() -> None:
    """The cpu variant (the default) on python:3.11-slim with CPU torch; the cuda variant on a
    CUDA devel image (nvcc) with CUDA torch and the `cuda` extra (ninja), which is what
    building Shoal's KV kernels needs."""
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", dockerfile, re.MULTILINE)
    assert re.search(r"^FROM python:3\.11-slim AS base-cpu$", dockerfile, re.MULTILINE)
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:[0-9.]+-devel-", dockerfile, re.MULTILINE)
    assert re.search(r"^FROM \$\{CUDA_IMAGE\} AS base-cuda$", dockerfile, re.MULTILINE)
    assert re.search(r"^FROM base-\$\{VARIANT\}$", dockerfile, re.MULTILINE)
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", dockerfile, re.MULTILINE)
    lines = dockerfile.splitlines()
    torch_line = next(i for i, line in enumerate(lines) if 'pip install "torch==${TORCH_VERSION}"' in line)
    shoal_line = next(i for i, line in enumerate(lines) if 'pip install ".[cuda]"' in line)
    assert torch_line < shoal_line, "torch first, so pip keeps the wheel of the variant's index"
    assert 'index="https://download.pytorch.org/whl/cpu"' in dockerfile
    assert 'then pip install ".[cuda]"; else pip install .; fi' in lines[shoal_line]


def test_dockerfile_runs_shoal_as_a_non_root_user() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER shoal$", dockerfile, re.MULTILINE)
    assert re.search(r'^ENTRYPOINT \["shoal"\]$', dockerfile, re.MULTILINE)


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path of a service's bind mounts."""
    found = {}
    for volume in service["volumes"]:
        host, container, *_ = volume.split(":") if isinstance(volume, str) else (volume["source"], volume["target"])
        found[container] = host
    return found


def test_monitoring_profile_scrapes_every_shoal_service(compose_config: dict[str, Any]) -> None:
    prometheus = compose_config["services"]["prometheus"]
    config_file = _mounts(prometheus)["/etc/prometheus/prometheus.yml"]
    assert Path(config_file) == GRAFANA_DIR / "prometheus.yml"
    scrape = yaml.safe_load(Path(config_file).read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape["scrape_configs"]}
    assert targets == {
        "shoal-gateway": ["gateway:8000"],
        "shoal-scheduler": [f"scheduler:{SCHEDULER_METRICS_PORT}"],
        "shoal-node-agent": [f"node-agent:{NODE_AGENT_METRICS_PORT}"],
    }
    assert prometheus["ports"] == ["127.0.0.1:9090:9090/tcp"]


def test_monitoring_profile_provisions_grafana_with_the_shoal_dashboard(compose_config: dict[str, Any]) -> None:
    grafana = compose_config["services"]["grafana"]
    mounts = _mounts(grafana)
    assert Path(mounts["/etc/grafana/provisioning"]) == GRAFANA_DIR / "provisioning"
    assert Path(mounts["/etc/grafana/dashboards"]) == GRAFANA_DIR / "dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (GRAFANA_DIR / "dashboards" / Path(home).relative_to("/etc/grafana/dashboards")).is_file()
    provider = yaml.safe_load((GRAFANA_DIR / "provisioning/dashboards/shoal.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"
    (datasource,) = yaml.safe_load((GRAFANA_DIR / "provisioning/datasources/prometheus.yaml").read_text())[
        "datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    dashboard = json.loads((GRAFANA_DIR / "dashboards/shoal.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}
    assert grafana["ports"] == ["127.0.0.1:3000:3000/tcp"]
