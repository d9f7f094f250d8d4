"""`shoal up` against a nats-server that requires a user and a password: the secret reaches
every process that needs it (the services, a worker), and shows in no command line, no
worker's environment and no log line."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import openai

from shoal.shared.nats_server import EmbeddedNatsServer
from tests.e2e.conftest import start_shoal_up

MODEL = "demo/llama-5m"


def _proc_files(name: str) -> dict[int, bytes]:
    """pid -> /proc/<pid>/<name> of every process this user may read."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = (entry / name).read_bytes()
            except OSError:
                continue
    return found


def test_nats_credentials_reach_every_process_and_leak_nowhere(demo_models_root: Path, tmp_path: Path) -> None:
    password = "pw-" + secrets.token_hex(16)
    api_key = "key-" + secrets.token_hex(16)
    server = EmbeddedNatsServer(
        store_dir=tmp_path / "nats",
        extra_config='authorization { user: "shoal", password: $SHOAL_TEST_NATS_PASSWORD }',
        env={**os.environ, "SHOAL_TEST_NATS_PASSWORD": password},
    )
    server.start()
    shoal = None
    try:
        shoal = start_shoal_up(demo_models_root, tmp_path / "state", "--log-level", "debug", env={
            "SHOAL_NATS_URL": server.url, "SHOAL_NATS_USER": "shoal", "SHOAL_NATS_PASSWORD": password,
            "SHOAL_GATEWAY_API_KEYS": api_key,
        })
        client = openai.OpenAI(base_url=shoal.v1, api_key=api_key, max_retries=0, timeout=180)
        completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
        assert completion.usage is not None and completion.usage.completion_tokens == 4  # a worker served it

        command_lines = _proc_files("cmdline")
        # Forked workers (named "shoal worker ...") have the fork server's environment (setproctitle
        # reuses their copy of its memory for the name); spawned ones (the server not ready yet) and
        # the server run `python -m shoal.services.worker[.forkserver]`.
        forked = [pid for pid, cmdline in command_lines.items() if cmdline.startswith(b"shoal worker ")]
        workers = [pid for pid, cmdline in command_lines.items() if b"shoal.services.worker" in cmdline]
        assert forked or workers, "a worker process serves the model"
        assert not forked or workers, "the fork server of the forked workers runs"
        for secret in (password, api_key):
            leaked = [pid for pid, cmdline in command_lines.items() if secret.encode() in cmdline]
            assert not leaked, f"a secret shows in the command line of {leaked}"
            environments = _proc_files("environ")
            assert not [pid for pid in workers if secret.encode() in environments.get(pid, b"")], \
                "a worker's environment holds a secret (it gets what it needs on stdin)"
        shoal.stop()
        logs = "".join(shoal.log_lines) + "".join(p.read_text() for p in (tmp_path / "state" / "logs").glob("*.log"))
        assert '"worker_ready"' in logs and "request_done" in logs, "the logs are the ones of this run"
        assert password not in logs and api_key not in logs
        assert password not in server.log_text
    finally:
        if shoal is not None:
            shoal.stop()
        server.stop()


def test_a_wrong_password_stops_a_service_with_a_clear_error(tmp_path: Path) -> None:
    password = "pw-" + secrets.token_hex(16)
    server = EmbeddedNatsServer(
        store_dir=tmp_path / "nats", extra_config='authorization { user: "shoal", password: $SHOAL_TEST_NATS_PASSWORD }',
        env={**os.environ, "SHOAL_TEST_NATS_PASSWORD": password})
    server.start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "shoal.cli.main", "scheduler"],
            env={**os.environ, "SHOAL_NATS_URL": server.url, "SHOAL_NATS_USER": "shoal", "SHOAL_DEMO_MODELS": "false",
                 "SHOAL_NATS_PASSWORD": "wrong-" + password},
            capture_output=True, text=True, timeout=60)
        assert result.returncode == 1
        assert "authorization" in result.stderr.lower() and password not in result.stderr
    finally:
        server.stop()
