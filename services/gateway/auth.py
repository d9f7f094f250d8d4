"""API keys at the gateway's edge: who may use /v1, the dashboard's data, and /admin.

A key comes as ``Authorization: Bearer <key>`` or (Anthropic's clients) ``x-api-key: <key>``.
``gateway.api_keys`` guard /v1 and /ui/api (the dashboard's data); ``gateway.admin_api_keys``
guard /admin and also work wherever an API key does. With no keys at all everything is
open; a gateway whose open admin API would listen beyond loopback refuses to start unless
``gateway.insecure_open_admin`` is set (then it warns). Health,
/metrics and the dashboard's page and static files are always open: they hold no secret.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from shoal.services.gateway.errors import Forbidden, Unauthorized
from shoal.shared.config import ConfigError, GatewayConfig

OPEN_PATHS = ("/", "/healthz", "/health", "/version", "/api/version", "/metrics", "/ui", "/ui/", "/openapi.json")
"""Open to all: probes (``/`` is Ollama clients'), scrapers, the API's description, and the dashboard's page (it holds no
data: what it shows comes from /ui/api, which takes the keys of /v1)."""
OPEN_PREFIXES = ("/ui/static/",)


def _key_matches(presented: str, keys: list[str]) -> bool:
    # Bytes: compare_digest refuses str with non-ASCII characters (a 500 for a stray header).
    given = presented.encode("utf-8", "surrogateescape")
    return any(hmac.compare_digest(given, key.encode()) for key in keys)


def bearer_token(header: str) -> str:
    """The key of an ``Authorization: Bearer <key>`` header ("" if none); the scheme is
    case-insensitive (RFC 9110), so ``bearer`` works too."""
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def presented_key(headers: Mapping[str, str], keys: list[str] | None = None) -> str:
    """The API key a request presents ("" if none): ``Authorization: Bearer <key>``, or
    ``x-api-key: <key>`` as Anthropic's clients send it. A request may send both (a client
    with a token of its own for a proxy): the one among `keys`, if either is."""
    bearer = bearer_token(headers.get("Authorization", ""))
    header_key = headers.get("x-api-key", "").strip()
    if bearer and header_key and keys is not None and not _key_matches(bearer, keys):
        return header_key
    return bearer or header_key


def is_loopback(host: str) -> bool:
    """Whether `host` (a listen address) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, "" or "0.0.0.0"-like: assume it is reachable


def is_admin_open_to_network(config: GatewayConfig) -> bool:
    """Whether /admin takes requests with no key from other machines with this config."""
    # Keys guard it (admin routes are off with only api_keys), or only this machine sees it.
    return not (config.admin_api_keys or config.api_keys or is_loopback(config.host))


def check_admin_exposure(config: GatewayConfig) -> str | None:
    """Refuse (ConfigError) a gateway whose admin API would be open to the network, unless
    `GatewayConfig.insecure_open_admin` says so; then return the warning to log (else None)."""
    if not is_admin_open_to_network(config):
        return None
    exposure = (f"the admin API (/admin: register and remove models, scale, evict) would be open to anyone who "
                f"can reach {config.host}:{config.port}")
    if not config.insecure_open_admin:
        raise ConfigError(f"{exposure}; set gateway.admin_api_keys (SHOAL_GATEWAY_ADMIN_API_KEYS=key1,key2), "
                          f"listen on 127.0.0.1, or accept it with gateway.insecure_open_admin = true "
                          f"(--insecure-open-admin)")
    return f"{exposure} (gateway.insecure_open_admin is set)"


def check_admin(config: GatewayConfig, presented: str) -> None:
    """Raise Unauthorized or Forbidden unless the key `presented` ("" if none) may use /admin."""
    if config.admin_api_keys:
        if not presented:
            raise Unauthorized("admin routes need an admin key: Authorization: Bearer <key>")
        if not _key_matches(presented, config.admin_api_keys):
            raise Forbidden("this key may not use admin routes")
    elif config.api_keys:
        raise Forbidden("admin routes are disabled: configure gateway.admin_api_keys")


def may_use_admin(config: GatewayConfig, presented: str) -> bool:
    """Whether the key `presented` may use /admin (the dashboard shows its admin actions then)."""
    try:
        check_admin(config, presented)
    except (Unauthorized, Forbidden):
        return False
    return True


def auth_middleware(config: GatewayConfig) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Bearer keys: `api_keys` guard /v1 and the dashboard's data (/ui/api), `admin_api_keys`
    guard /admin (see GatewayConfig); an admin key works wherever a key of `api_keys` does."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        if request.path in OPEN_PATHS or request.path.startswith(OPEN_PREFIXES):
            return await handler(request)
        keys = config.api_keys + config.admin_api_keys
        if request.path.startswith("/admin"):
            check_admin(config, presented_key(request.headers, config.admin_api_keys))
        elif config.api_keys and not _key_matches(presented_key(request.headers, keys), keys):
            raise Unauthorized("missing or invalid API key: send Authorization: Bearer <key> (or x-api-key: <key>)",
                               code="invalid_api_key")
        return await handler(request)

    return middleware
