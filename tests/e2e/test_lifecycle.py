"""Starting and stopping `shoal up`: SIGTERM leaves no process behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import start_shoal_up

pytestmark = pytest.mark.e2e


def complete_once(v1: str) -> None:
    """One short completion, so that a worker is serving."""
    body = json.dumps({"model": "demo/llama-5m", "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(v1 + "/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=240) as response:
        assert response.status == 200


def test_sigterm_stops_workers_and_nats(demo_models_root: Path, tmp_path: Path) -> None:
    shoal = start_shoal_up(demo_models_root, tmp_path / "state")
    try:
        complete_once(shoal.v1)
        running = shoal.leftovers()
        assert any("nats-server" in cmd for _, cmd in running), "nats-server should run while shoal is up"
        # A worker forked by the fork server is named by it; one spawned directly (the server not
        # ready yet) runs `python -m shoal.services.worker`, as does the server.
        workers = [cmd for _, cmd in running if cmd.startswith("shoal worker ") or "shoal.services.worker" in cmd]
        assert any(cmd.startswith("shoal worker ") or "shoal.services.worker" in cmd.split() for cmd in workers), \
            "a worker should serve the model"
        assert not any(shoal.nats_url in cmd for cmd in workers), "a worker's launch never shows on a command line"
    finally:
        code = shoal.stop()
    assert code == 0
    assert shoal.leftovers() == []


def test_sigterm_right_after_the_ready_line_is_a_graceful_stop(demo_models_root: Path, tmp_path: Path) -> None:
    """A supervisor may stop Shoal the moment it says it is up: the signal handlers are in
    place before that line (they came after it, and such a SIGTERM killed the process)."""
    shoal = start_shoal_up(demo_models_root, tmp_path / "state")
    assert shoal.stop() == 0
    assert shoal.leftovers() == []


def test_sigkill_of_shoal_up_still_takes_workers_and_nats_down(demo_models_root: Path, tmp_path: Path) -> None:
    shoal = start_shoal_up(demo_models_root, tmp_path / "state")
    try:
        complete_once(shoal.v1)
        assert len(shoal.leftovers()) >= 2
    finally:
        shoal.process.kill()
        shoal.process.wait()
    deadline = time.monotonic() + 60
    while shoal.leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert shoal.leftovers() == [], "children must die with `shoal up` (parent-death signal)"


def test_status_and_inspect_show_the_cluster(demo_models_root: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    shoal = start_shoal_up(demo_models_root, state)
    try:
        status = subprocess.run([sys.executable, "-m", "shoal.cli.main", "status", "--state-dir", str(state)],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "GPUs (2):" in status.stdout and "demo/llama-5m" in status.stdout
        inspected = subprocess.run([sys.executable, "-m", "shoal.cli.main", "inspect", "--nats-url",
                                    shoal.nats_url], capture_output=True, text=True, timeout=60)
        assert inspected.returncode == 0, inspected.stderr
        for name in ("SHOAL_REQUESTS", "SHOAL_EVENTS", "shoal_models", "shoal_gpus", "shoal_replicas",
                     "shoal_nodes", "shoal-scheduler", "shoal-node-agent"):
            assert name in inspected.stdout
    finally:
        shoal.stop()
