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


@pytest.fixture(scope="session")
def demo_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo models, made once per test session (or taken from $SHOAL_TEST_MODELS_ROOT)."""
    import os

    from shoal.cli.demo_models import make_demo_models

    given = os.environ.get("SHOAL_TEST_MODELS_ROOT")
    root = Path(given) if given else tmp_path_factory.mktemp("models")
    make_demo_models(root)
    return root
