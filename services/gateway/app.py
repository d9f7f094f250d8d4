"""The gateway's aiohttp application: OpenAI API, Ollama's API, admin API, dashboard, health, metrics.

Stateless: run several behind a load balancer; each has its own gateway id,
reply subscription and KV watchers. Every long-lived resource (the NATS
connection, the reply router, the watchers) is created and torn down in
`cleanup_ctx`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from shoal.services.gateway import (
    openapi,
    routes_admin,
    routes_anthropic,
    routes_anthropic_batches,
    routes_batches,
    routes_ollama,
    routes_ollama_models,
    routes_openai,
    routes_rerank,
    routes_responses,
    routes_sessions,
    routes_tokenize,
    routes_ui,
)
from shoal.services.gateway.auth import auth_middleware, check_admin_exposure
from shoal.services.gateway.batch_runner import BatchRunner, self_headers, self_url
from shoal.services.gateway.batch_store import batch_store_on
from shoal.services.gateway.cluster import ClusterView
from shoal.services.gateway.cors import CorsPolicy
from shoal.services.gateway.dispatch import Dispatcher
from shoal.services.gateway.errors import error_middleware
from shoal.services.gateway.file_store import open_file_store, open_records_bucket
from shoal.services.gateway.live import LiveFeeds
from shoal.services.gateway.request_ids import request_id_middleware
from shoal.services.gateway.response_store import ResponseStore
from shoal.services.gateway.router import ReplyRouter
from shoal.services.gateway.session_routes import SessionRoutes
from shoal.services.gateway.state import GATEWAY, GatewayState
from shoal.shared.bus import connect
from shoal.shared.config import GatewayConfig, NatsConfig, SessionConfig
from shoal.shared.metrics import CONTENT_TYPE, Registry
from shoal.shared.version import SHOAL_VERSION

log = structlog.get_logger(__name__)

async def healthz(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    healthy = state.bus.nc.is_connected
    return web.json_response({"status": "ok" if healthy else "nats disconnected"}, status=200 if healthy else 503)


async def version(request: web.Request) -> web.Response:
    """vLLM's ``/version``: which Shoal answers (open, as its health is)."""
    return web.json_response({"version": SHOAL_VERSION})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    state.metrics.gauge("shoal_gateway_reply_inboxes", REPLY_INBOXES_HELP).set(state.router.num_waiting)
    body = state.metrics.render()
    return web.Response(body=body.encode(), headers={"Content-Type": CONTENT_TYPE})


async def stop_batches(app: web.Application) -> None:
    """``on_shutdown``: let this gateway's batches go (their requests to it end), before aiohttp
    waits for open handlers and while NATS is still connected."""
    gateway = app.get(GATEWAY)
    if gateway is not None:
        await gateway.batch_runner.stop()


DEFAULT_SESSION_TTL_S = SessionConfig().idle_timeout_s
REPLY_INBOXES_HELP = "Requests this gateway waits for replies to (0 when idle: more is a leak)"


def create_app(config: GatewayConfig, nats_url: str, registry: Registry | None = None, *,
               nats_config: NatsConfig | None = None,
               session_ttl_s: float = DEFAULT_SESSION_TTL_S) -> web.Application:
    """The gateway's application. Raises ConfigError, before anything starts, for an admin API
    that would be open to the network (`auth.check_admin_exposure`). `session_ttl_s`: how long
    a session's route outlives its last turn (the workers' ``[worker.sessions] idle_timeout_s``:
    they forget its KV then)."""
    exposure_warning = check_admin_exposure(config)
    cors = CorsPolicy(config.cors_origins)
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[request_id_middleware, error_middleware, cors.middleware(), auth_middleware(config)],
    )
    app.on_response_prepare.append(cors.on_prepare)
    registry = registry or Registry()

    async def resources(app: web.Application) -> AsyncIterator[None]:
        gateway_id = config.gateway_id or uuid.uuid4().hex[:12]
        bus = await connect(nats_url, f"gateway-{gateway_id}", nats_config=nats_config, role="gateway")
        router = ReplyRouter(bus.nc, gateway_id)
        await router.start()
        cluster = ClusterView(bus)
        await cluster.start()
        live = LiveFeeds(bus, cluster, registry)
        await live.start()
        session_routes = SessionRoutes(bus.js, session_ttl_s)
        await session_routes.start()
        responses = ResponseStore(bus.js, config.responses_ttl_s)
        await responses.start()
        dispatcher = Dispatcher(bus, router, cluster, config, registry, on_first_token=live.ttft.observe,
                                session_routes=session_routes, worker_stats=live.stats)
        await dispatcher.start()
        records = await open_records_bucket(bus.js, config.files_ttl_s)
        files = await open_file_store(bus.js, config, records)
        batches = batch_store_on(bus.js, records)
        batch_runner = BatchRunner(batches, files, registry, owner=gateway_id, base_url=self_url(config),
                                   headers=self_headers(config), concurrency=config.batch_concurrency,
                                   max_running=config.max_running_batches, request_timeout_s=config.request_timeout_s,
                                   save_every_s=config.batch_save_interval_s)
        batch_runner.start()
        app[GATEWAY] = GatewayState(
            config=config,
            bus=bus,
            router=router,
            cluster=cluster,
            dispatcher=dispatcher,
            session_routes=session_routes,
            responses=responses,
            files=files,
            batches=batches,
            batch_runner=batch_runner,
            metrics=registry,
            requests_total=registry.counter("shoal_gateway_requests_total", "HTTP inference requests",
                                            ["model", "kind", "outcome"]),
            latency=registry.histogram("shoal_gateway_request_duration_seconds", "Inference request latency",
                                       ["model"]),
            live=live,
        )
        log.info("gateway_started", gateway=gateway_id, max_payload_bytes=bus.nc.max_payload)
        if config.max_body_bytes > bus.nc.max_payload:
            log.warning("body_limit_above_nats_payload", max_body_bytes=config.max_body_bytes,
                        max_payload_bytes=bus.nc.max_payload,
                        detail="requests larger than the NATS server's max_payload get 413; raise the "
                               "server's max_payload or lower gateway.max_body_bytes so they agree")
        if exposure_warning is not None:
            log.warning("admin_api_open", host=config.host, port=config.port, detail=exposure_warning)
        yield
        await dispatcher.stop()
        await live.stop()
        await cluster.stop()
        await router.stop()
        await bus.close()

    app.cleanup_ctx.append(resources)
    app.on_shutdown.append(routes_ui.end_event_streams)  # before aiohttp waits for open handlers
    app.on_shutdown.append(stop_batches)
    app.router.add_routes(routes_openai.routes)
    app.router.add_routes(routes_anthropic.routes)
    app.router.add_routes(routes_ollama.routes)
    app.router.add_routes(routes_ollama_models.routes)
    app.router.add_routes(routes_responses.routes)
    app.router.add_routes(routes_tokenize.routes)
    app.router.add_routes(routes_rerank.routes)
    app.router.add_routes(routes_batches.routes)
    app.router.add_routes(routes_anthropic_batches.routes)
    app.router.add_routes(routes_admin.routes)
    app.router.add_routes(routes_sessions.routes)
    routes_ui.add_routes(app)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/health", healthz)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    openapi.add_routes(app)
    return app


async def start_gateway(config: GatewayConfig, nats_url: str, registry: Registry | None = None, *,
                        nats_config: NatsConfig | None = None,
                        session_ttl_s: float = DEFAULT_SESSION_TTL_S) -> web.AppRunner:
    """Start serving on config.host:config.port; returns the runner (call `cleanup()` to stop)."""
    runner = web.AppRunner(create_app(config, nats_url, registry, nats_config=nats_config,
                                      session_ttl_s=session_ttl_s),
                           handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    await site.start()
    return runner
