"""A worker whose CUDA context is poisoned exits, its node agent starts it again, and the
request it held runs to completion as its next attempt. Real node agent, scheduler, `shoal
worker` processes and nats-server; there being no GPU, the CUDA error is injected into the
worker process at start (a `sitecustomize` on its PYTHONPATH makes the first real forward
pass raise torch's device-side-assert error, once per test)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shoal.shared.nats_server import EmbeddedNatsServer
from tests.integration.test_warm_restore import MODEL, _complete, _ready, one_node_cluster

FAULT = '''
import os
from pathlib import Path

MARKER = Path(os.environ["SHOAL_TEST_FAULT_MARKER"])


def _arm() -> None:
    from shoal.services.worker.engine import paged_engine

    original_init = paged_engine.PagedEngine.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)  # the warm-up pass runs unharmed
        execute = self._runner.execute

        def failing(step):
            if not MARKER.exists():
                MARKER.write_text(str(os.getpid()))
                raise RuntimeError(
                    "CUDA error: device-side assert triggered\\nCUDA kernel errors might be asynchronously "
                    "reported at some other API call"
                )
            return execute(step)

        self._runner.execute = failing

    paged_engine.PagedEngine.__init__ = init


if os.environ.get("SHOAL_TEST_FAULT_MARKER"):  # set only for the workers this test's agent spawns
    _arm()
'''


async def test_a_worker_killed_by_a_device_assert_is_restarted_and_its_request_completes(
    nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault_dir = tmp_path / "fault"
    fault_dir.mkdir()
    (fault_dir / "sitecustomize.py").write_text(FAULT)
    marker = tmp_path / "fault-fired"
    monkeypatch.setenv("PYTHONPATH", str(fault_dir))
    monkeypatch.setenv("SHOAL_TEST_FAULT_MARKER", str(marker))
    async with one_node_cluster(nats_server.url, demo_models_root, tmp_path / "node-a") as (bus, scheduler):
        assert (await scheduler.scale(MODEL, 1)).ok
        (first,) = (await _ready(bus, 1)).values()
        final = await asyncio.wait_for(_complete(bus, "through-a-restart"), 120)
        assert marker.exists(), "the injected device-side assert fired"
        assert int(marker.read_text()) == first.pid, "in the first worker"
        assert final.completion_tokens == 6 and final.attempt == 2
        (after,) = (await _ready(bus, 1)).values()
        assert after.replica_id == first.replica_id and after.pid != first.pid, "restarted in place"
        log = (tmp_path / "node-a" / f"{first.replica_id}.log").read_text()
        assert "device-side assert triggered" in log and "worker_device_error" in log
