"""Mutual TLS with a real nats-server and certificates made at test time (none committed)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.shared.bus import BusError, connect
from shoal.shared.config import NatsConfig
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.nats_setups import Certificates, make_certificates, tls_server_config


@pytest.fixture
def certs(tmp_path: Path) -> Certificates:
    return make_certificates(tmp_path / "certs")


@pytest.fixture
def tls_server(tmp_path: Path, certs: Certificates) -> Iterator[EmbeddedNatsServer]:
    server = EmbeddedNatsServer(store_dir=tmp_path / "js", extra_config=tls_server_config(certs))
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_client_certificate_signed_by_the_ca_connects(tls_server: EmbeddedNatsServer,
                                                              certs: Certificates) -> None:
    config = NatsConfig(tls_ca_file=str(certs.ca_file), tls_cert_file=str(certs.client_cert_file),
                        tls_key_file=str(certs.client_key_file))
    bus = await connect(tls_server.url, "tls-client", nats_config=config)
    try:
        assert bus.nc.is_connected
        info = await bus.js.account_info()
        assert info.streams >= 2  # Shoal's streams were created over the TLS connection
    finally:
        await bus.close()


@pytest.mark.parametrize("what", ["no client certificate", "no CA (the server's is not trusted)"])
async def test_a_client_the_server_cannot_trust_fails_at_once(tls_server: EmbeddedNatsServer, certs: Certificates,
                                                              what: str) -> None:
    """Refused at the handshake: the service stops with an error instead of retrying for ever."""
    if what == "no client certificate":
        config = NatsConfig(tls_ca_file=str(certs.ca_file))
    else:
        config = NatsConfig(tls_cert_file=str(certs.client_cert_file), tls_key_file=str(certs.client_key_file))
    started = time.monotonic()
    with pytest.raises(BusError, match="refused"):
        await connect(tls_server.url, "untrusted", nats_config=config)
    assert time.monotonic() - started < 10.0
