"""Every way `[nats]` authenticates, against a real nats-server: a token, an NKey seed, mutual
TLS (certificates made at test time, none committed). User/password: the cluster test and
tests/e2e/test_secrets.py."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import nkeys
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


async def test_token_authentication(tmp_path: Path) -> None:
    token = os.urandom(16).hex()
    with EmbeddedNatsServer(store_dir=tmp_path / "js", extra_config=f'authorization {{ token: "{token}" }}') as server:
        bus = await connect(server.url, "token-client", nats_config=NatsConfig(token=token))
        await bus.close()
        with pytest.raises(BusError, match="refused"):
            await connect(server.url, "wrong-token", nats_config=NatsConfig(token="not-" + token))


async def test_nkey_seed_authentication(tmp_path: Path) -> None:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public_key = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(seed)
    seed_file.chmod(0o600)
    config = f'authorization {{ users = [ {{ nkey: "{public_key}" }} ] }}'
    with EmbeddedNatsServer(store_dir=tmp_path / "js", extra_config=config) as server:
        bus = await connect(server.url, "nkey-client", nats_config=NatsConfig(nkey_seed_file=str(seed_file)))
        try:
            assert bus.nc.is_connected
        finally:
            await bus.close()
        other = tmp_path / "other.nk"
        other.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        with pytest.raises(BusError, match="refused"):
            await connect(server.url, "unknown-nkey", nats_config=NatsConfig(nkey_seed_file=str(other)))
