"""Fixtures shared by every test: a real nats-server per test, on a free port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from shoal.shared.bus import Bus, connect
from shoal.shared.nats_server import EmbeddedNatsServer


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNatsServer]:
    """A nats-server with JetStream and its own store directory, stopped after the test."""
    server = EmbeddedNatsServer(store_dir=tmp_path / "jetstream")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def bus(nats_server: EmbeddedNatsServer) -> AsyncIterator[Bus]:
    """A connection with Shoal's streams and buckets created."""
    connection = await connect(nats_server.url, "test")
    try:
        yield connection
    finally:
        await connection.close()
