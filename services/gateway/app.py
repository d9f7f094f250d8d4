"""The gateway's aiohttp application: OpenAI API, admin API, health, metrics.

Stateless: run several behind a load balancer; each has its own gateway id,
reply subscription and KV watchers. Every long-lived resource (the NATS
connection, the reply router, the watchers) is created and torn down in
`cleanup_ctx`.
"""

from __future__ import annotations

import hmac
import ipaddress
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog
from aiohttp import web

from shoal.services.gateway import routes_admin, routes_openai
from shoal.services.gateway.cluster import ClusterView
from shoal.services.gateway.dispatch import Dispatcher
from shoal.services.gateway.errors import Forbidden, Unauthorized, error_middleware
from shoal.services.gateway.request_ids import request_id_middleware
from shoal.services.gateway.router import ReplyRouter
from shoal.services.gateway.state import GATEWAY, GatewayState
from shoal.shared.bus import connect
from shoal.shared.config import GatewayConfig
from shoal.shared.metrics import CONTENT_TYPE, Registry

log = structlog.get_logger(__name__)

OPEN_PATHS = ("/healthz", "/health", "/metrics")


def _key_matches(presented: str, keys: list[str]) -> bool:
    # Bytes: compare_digest refuses str with non-ASCII characters (a 500 for a stray header).
    given = presented.encode("utf-8", "surrogateescape")
    return any(hmac.compare_digest(given, key.encode()) for key in keys)


def bearer_token(header: str) -> str:
    """The key of an ``Authorization: Bearer <key>`` header ("" if none); the scheme is
    case-insensitive (RFC 9110), so ``bearer`` works too."""
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def is_loopback(host: str) -> bool:
    """Whether `host` (a listen address) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, "" or "0.0.0.0"-like: assume it is reachable


def open_admin_warning(config: GatewayConfig) -> str | None:
    """Why the admin API is open to the network with this config, or None if it is not."""
    if config.admin_api_keys or config.api_keys or is_loopback(config.host):
        return None  # keys guard it (admin routes are off with only api_keys), or only this machine sees it
    return (f"the admin API (/admin: register and remove models, scale, evict) is open to anyone who can reach "
            f"{config.host}:{config.port}; set gateway.admin_api_keys (SHOAL_GATEWAY_ADMIN_API_KEYS=key1,key2) "
            f"or listen on 127.0.0.1")


def auth_middleware(config: GatewayConfig) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Bearer keys: `api_keys` guard /v1, `admin_api_keys` guard /admin (see GatewayConfig)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        presented = bearer_token(request.headers.get("Authorization", ""))
        if request.path.startswith("/admin"):
            if config.admin_api_keys:
                if not presented:
                    raise Unauthorized("admin routes need an admin key: Authorization: Bearer <key>")
                if not _key_matches(presented, config.admin_api_keys):
                    raise Forbidden("this key may not use admin routes")
            elif config.api_keys:
                raise Forbidden("admin routes are disabled: configure gateway.admin_api_keys")
        elif config.api_keys and not _key_matches(presented, config.api_keys + config.admin_api_keys):
            raise Unauthorized("missing or invalid API key: send Authorization: Bearer <key>",
                               code="invalid_api_key")
        return await handler(request)

    return middleware


async def healthz(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    healthy = state.bus.nc.is_connected
    return web.json_response({"status": "ok" if healthy else "nats disconnected"}, status=200 if healthy else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[GATEWAY].metrics.render()
    return web.Response(body=body.encode(), headers={"Content-Type": CONTENT_TYPE})


def create_app(config: GatewayConfig, nats_url: str, registry: Registry | None = None) -> web.Application:
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[request_id_middleware, error_middleware, auth_middleware(config)],
    )
    registry = registry or Registry()

    async def resources(app: web.Application) -> AsyncIterator[None]:
        gateway_id = config.gateway_id or uuid.uuid4().hex[:12]
        bus = await connect(nats_url, f"gateway-{gateway_id}")
        router = ReplyRouter(bus.nc, gateway_id)
        await router.start()
        cluster = ClusterView(bus)
        await cluster.start()
        app[GATEWAY] = GatewayState(
            config=config,
            bus=bus,
            router=router,
            cluster=cluster,
            dispatcher=Dispatcher(bus, router, cluster, config, registry),
            metrics=registry,
            requests_total=registry.counter("shoal_gateway_requests_total", "HTTP inference requests",
                                            ["model", "kind", "outcome"]),
            latency=registry.histogram("shoal_gateway_request_duration_seconds", "Inference request latency",
                                       ["model"]),
        )
        log.info("gateway_started", gateway=gateway_id)
        if (warning := open_admin_warning(config)) is not None:
            log.warning("admin_api_open", host=config.host, port=config.port, detail=warning)
        yield
        await cluster.stop()
        await router.stop()
        await bus.close()

    app.cleanup_ctx.append(resources)
    app.router.add_routes(routes_openai.routes)
    app.router.add_routes(routes_admin.routes)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/health", healthz)
    app.router.add_get("/metrics", metrics)
    return app


async def start_gateway(config: GatewayConfig, nats_url: str, registry: Registry | None = None) -> web.AppRunner:
    """Start serving on config.host:config.port; returns the runner (call `cleanup()` to stop)."""
    runner = web.AppRunner(create_app(config, nats_url, registry), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    await site.start()
    return runner
