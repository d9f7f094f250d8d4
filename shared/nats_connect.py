"""How a Shoal process opens its NATS connection: servers, credentials, TLS, inbox prefix.

One place turns `NatsConfig` into nats-py's `connect` arguments, so every service and
worker authenticates the same way. Secrets go from the config object straight to the
connection: never onto a command line, never into a log line (`redacted_url` for what is
logged).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from shoal.shared.config import ConfigError, NatsConfig
from shoal.shared.nats_permissions import Role, inbox_prefix


def redacted_url(url: str) -> str:
    """`url` (one URL or a comma-separated list) with any user info replaced by ``***``."""
    parts = []
    for one in url.split(","):
        split = urlsplit(one.strip())
        if split.username is None and split.password is None:
            parts.append(one.strip())
            continue
        host = split.hostname or ""
        netloc = f"***@{host}" + (f":{split.port}" if split.port else "")
        parts.append(urlunsplit(split._replace(netloc=netloc)))
    return ",".join(parts)


def tls_context(nats: NatsConfig) -> ssl.SSLContext | None:
    """The client TLS context `nats` asks for (server verified; a client certificate for
    mutual TLS), or None without TLS. Raises ConfigError for a file that cannot be read."""
    if not nats.uses_tls:
        return None
    try:
        context = ssl.create_default_context(cafile=nats.tls_ca_file or None)
        if nats.tls_cert_file:
            context.load_cert_chain(nats.tls_cert_file, nats.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"nats TLS files cannot be used: {exc}") from exc
    return context


def connect_options(nats: NatsConfig, role: Role | None) -> dict[str, Any]:
    """nats-py `connect` keyword arguments for `nats`'s credentials and TLS, and `role`'s
    inbox prefix (the permissions let each role read only its own inboxes)."""
    options: dict[str, Any] = {"inbox_prefix": inbox_prefix(role).encode()}
    if nats.user:
        options["user"] = nats.user
        options["password"] = nats.password
    elif nats.token:
        options["token"] = nats.token
    elif nats.nkey_seed_file:
        _require_file(nats.nkey_seed_file, "nkey_seed_file")
        options["nkeys_seed"] = nats.nkey_seed_file
    elif nats.creds_file:
        _require_file(nats.creds_file, "creds_file")
        options["user_credentials"] = nats.creds_file
    if (context := tls_context(nats)) is not None:
        options["tls"] = context
    return options


def _require_file(path: str, name: str) -> None:
    if not Path(path).is_file():
        raise ConfigError(f"nats.{name}: {path} is not a readable file")
