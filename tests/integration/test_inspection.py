"""`shoal inspect` against a real nats-server."""

from __future__ import annotations

import io
import subprocess
import sys

from shoal.cli.inspection import inspect, ping_services
from shoal.shared.bus import Bus
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
