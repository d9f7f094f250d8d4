"""`shoal inspect` against a real nats-server."""

from __future__ import annotations

import io

from shoal.cli.inspection import inspect, ping_services
from shoal.shared.bus import Bus


async def test_inspect_with_no_shoal_service_running(bus: Bus) -> None:
    # Nothing answers $SRV.PING: nats-server sends an empty "503 no responders" status.
    assert await ping_services(bus) == []
    out = io.StringIO()
    await inspect(bus, out)
    text = out.getvalue()
    assert "KV bucket shoal_gpus" in text
    assert text.rstrip().endswith("Micro services (nats micro ls):")
