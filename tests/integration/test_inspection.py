"""`shoal inspect` against a real nats-server."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from msgspec import structs

from shoal.cli.inspection import inspect, ping_services, status
from shoal.services.gateway.batch_api import BatchCreate
from shoal.services.gateway.batch_store import SavedRun, StoredBatch, new_batch, open_batch_store, started
from shoal.shared.bus import Bus
from shoal.shared.config import GatewayConfig
from shoal.shared.nats_server import EmbeddedNatsServer


async def test_inspect_with_no_shoal_service_running(bus: Bus) -> None:
    # Nothing answers $SRV.PING: nats-server sends an empty "503 no responders" status.
    assert await ping_services(bus) == []
    out = io.StringIO()
    await inspect(bus, out)
    text = out.getvalue()
    assert "KV bucket shoal_gpus" in text
    assert text.rstrip().endswith("Micro services (nats micro ls):")


def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly(nats_server: EmbeddedNatsServer) -> None:
    """``shoal inspect | head``: the reader going away is no error (no "Broken pipe" message,
    exit 0), as other command-line tools behave."""
    process = subprocess.Popen([sys.executable, "-m", "shoal.cli.main", "inspect", "--nats-url", nats_server.url],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    process.stdout.close()  # before it writes: its first write finds the pipe closed
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "Broken pipe" not in stderr and "BrokenPipeError" not in stderr, stderr


async def test_status_shows_the_batches_with_work_left_and_who_runs_them(bus: Bus) -> None:
    out = io.StringIO()
    await status(bus, out)
    assert "Batches" not in out.getvalue(), "no gateway made the bucket: nothing to show, nothing created"
    batches = await open_batch_store(bus.js, GatewayConfig())
    now = time.time()
    waiting, running, ended = (new_batch(BatchCreate(input_file_id="file-0a", endpoint=endpoint,
                                                     completion_window="24h"), now - 60 + n)  # listed oldest first
                               for n, endpoint in enumerate(("/v1/embeddings", "/v1/chat/completions",
                                                             "/v1/completions")))
    for batch in (waiting, running, ended):
        await batches.create(batch)
    await batches.update(running.id, lambda stored: stored and StoredBatch(
        batch=started(stored.batch, now, 40), owner="gw-1", lease_until=now + 20,
        saved=[SavedRun(run="r1", parts=2, answers=12), SavedRun(run="r2", parts=1, answers=3)]))
    await batches.update(ended.id, lambda stored: stored and StoredBatch(
        batch=structs.replace(stored.batch, status="completed")))
    out = io.StringIO()
    await status(bus, out)
    section = out.getvalue().split("Batches with work left (2):\n", 1)[1].splitlines()
    assert waiting.id in section[0] and "validating" in section[0] and "waiting for a gateway" in section[0]
    assert "not started" in section[0]
    assert running.id in section[1] and "in_progress" in section[1] and "0/40 answered (0 refused, 15 saved)" in section[1]
    assert "gateway gw-1 (claim" in section[1] and ended.id not in out.getvalue()
