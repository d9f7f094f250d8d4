"""`shoal gateway` on a non-loopback address with an open admin API: refused at start unless
``--insecure-open-admin`` (issue 11) says the operator means it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shoal.cli.main import build_parser, config_from_args


def test_a_gateway_open_to_the_network_is_refused_naming_the_flag() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    # Refused before any connection: nothing listens on port 1.
    done = subprocess.run([sys.executable, "-m", "shoal.cli.main", "gateway", "--host", "0.0.0.0",
                           "--nats-url", "nats://127.0.0.1:1"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done
    assert "admin API" in done.stderr and "--insecure-open-admin" in done.stderr, done.stderr
    assert "SHOAL_GATEWAY_ADMIN_API_KEYS" in done.stderr


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_the_insecure_flag_reaches_the_gateways_config(command: str) -> None:
    parser = build_parser()
    flagged = config_from_args(parser.parse_args([command, "--host", "0.0.0.0", "--insecure-open-admin"]))
    assert flagged.gateway.insecure_open_admin and flagged.gateway.host == "0.0.0.0"
    assert not config_from_args(parser.parse_args([command, "--host", "0.0.0.0"])).gateway.insecure_open_admin
