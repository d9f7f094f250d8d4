"""Deployment files: compose.yaml validated by `docker-compose config`, the Dockerfile by its text.

No Docker engine runs on these machines; `docker-compose config` (Debian's docker-compose
package, v1.29) parses and validates the file without one.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
NATS_URL_ARGS = ["--nats-url", "nats://nats:4222"]


@pytest.fixture(scope="module")
def compose_config() -> dict[str, Any]:
    """The compose file as `docker-compose config` resolves it."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("the docker-compose binary is not installed (Debian package: docker-compose)")
    result = subprocess.run(
        [binary, "-f", "compose.yaml", "config"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert isinstance(config, dict)
    return config


def _argv(service: dict[str, Any]) -> list[str]:
    """A service's command as an argument list (compose accepts a string or a list)."""
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else command


def test_compose_names_the_four_services_and_the_demo_models_job(compose_config: dict[str, Any]) -> None:
    assert set(compose_config["services"]) == {"nats", "gateway", "scheduler", "node-agent", "demo-models"}


def test_nats_runs_jetstream_on_a_volume(compose_config: dict[str, Any]) -> None:
    nats = compose_config["services"]["nats"]
    assert nats["image"] == "nats:2.10-alpine"
    assert _argv(nats) == ["-js", "-sd", "/data", "-m", "8222"]
    assert "nats-data:/data:rw" in nats["volumes"]
    assert "nats-data" in compose_config["volumes"]


def test_service_commands_are_the_cli_contract(compose_config: dict[str, Any]) -> None:
    services = compose_config["services"]
    gateway_args = ["--host", "0.0.0.0", "--port", "8000"]
    assert _argv(services["gateway"]) == ["gateway", *NATS_URL_ARGS, *gateway_args]
    assert _argv(services["scheduler"]) == ["scheduler", *NATS_URL_ARGS]
    assert _argv(services["node-agent"]) == [
        "node-agent",
        *NATS_URL_ARGS,
        "--node-id",
        "node-a",
        "--gpus",
        "nvml",
        "--models-root",
        "/models",
    ]
    for name in ("gateway", "scheduler", "node-agent"):
        assert services[name]["build"]["context"] == str(REPO_ROOT)
        assert services[name]["depends_on"]["nats"] == {"condition": "service_healthy"}
    assert set(services["gateway"]["depends_on"]) == set(services["node-agent"]["depends_on"]) == {"nats"}


def test_gateway_is_published_on_loopback_with_keys_from_the_environment(compose_config: dict[str, Any]) -> None:
    gateway = compose_config["services"]["gateway"]
    assert gateway["ports"] == ["127.0.0.1:8000:8000/tcp"], "no open admin API on the network by default"
    assert set(gateway["environment"]) == {"SHOAL_GATEWAY_ADMIN_API_KEYS", "SHOAL_GATEWAY_API_KEYS"}
    assert "SHOAL_ADMIN_API_KEYS" in (REPO_ROOT / "compose.yaml").read_text()


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
