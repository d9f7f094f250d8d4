"""Running Shoal's services: each alone (`shoal gateway`, ...) or all together (`shoal up`).

`shoal up` starts an embedded nats-server (unless given a NATS URL), makes the
demo models if the models root lacks them, then runs the scheduler, one node
agent with virtual GPUs and the gateway in one process (workers are child
processes of the node agent). SIGINT/SIGTERM stops everything it started: no
worker or nats-server process is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import structlog

from shoal.services.gateway.app import start_gateway
from shoal.services.node_agent.agent import NodeAgent
from shoal.services.node_agent.gpus import discover_gpus
from shoal.services.scheduler.service import SchedulerService
from shoal.shared.bus import connect
from shoal.shared.config import ShoalConfig
from shoal.shared.gc_freeze import freeze_startup_objects
from shoal.shared.messages import ModelSpec, now
from shoal.shared.metrics import Registry
from shoal.shared.nats_connect import redacted_url
from shoal.shared.nats_server import EmbeddedNatsServer

log = structlog.get_logger(__name__)

NATS_URL_FILE = "nats.url"


def stop_signals() -> asyncio.Event:
    """An event SIGINT or SIGTERM sets from now on (instead of ending the process)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def model_specs(config: ShoalConfig) -> list[ModelSpec]:
    """The configured models, plus the demo models when `demo_models` is on."""
    models = list(config.models)
    if config.demo_models:
        from shoal.cli.demo_models import demo_model_configs

        configured = {m.key for m in models}
        models += [m for m in demo_model_configs(Path(config.node.models_root)) if m.key not in configured]
    registered_at = now()
    return [ModelSpec.from_settings(m, source="config", registered_at=registered_at) for m in models]


def ensure_demo_models(config: ShoalConfig) -> None:
    if config.demo_models:
        from shoal.cli.demo_models import make_demo_models

        make_demo_models(Path(config.node.models_root))


def service_logs(service: str) -> contextlib.AbstractContextManager[object]:
    """Log lines of what starts inside, and of the tasks it starts, say `service` (under `shoal
    up` the process's own name is ``up``, which says nothing about the line)."""
    return structlog.contextvars.bound_contextvars(service=service)


@contextlib.asynccontextmanager
async def scheduler_running(config: ShoalConfig, nats_url: str, registry: Registry) -> AsyncIterator[SchedulerService]:
    bus = await connect(nats_url, "scheduler", nats_config=config.nats, role="scheduler")
    scheduler = SchedulerService(bus, config.scheduler, metrics=registry)
    try:
        with service_logs("scheduler"):
            await scheduler.start(model_specs(config))
        yield scheduler
    finally:
        await scheduler.stop()
        await bus.close()


@contextlib.asynccontextmanager
async def node_agent_running(config: ShoalConfig, nats_url: str, registry: Registry) -> AsyncIterator[NodeAgent]:
    node = msgspec.structs.replace(config.node, node_id=config.node.node_id_or_default(),
                                   models_root=str(Path(config.node.models_root).resolve()))
    bus = await connect(nats_url, f"node-agent-{node.node_id}", nats_config=config.nats, role="node-agent")
    agent = NodeAgent(bus, discover_gpus(node.gpus), node, config.worker, config.logging, nats_url=nats_url,
                      nats_config=config.nats, log_dir=Path(config.state_dir).resolve() / "logs", metrics=registry)
    try:
        with service_logs("node-agent"):
            await agent.start()
        yield agent
    finally:
        await agent.stop()
        await bus.close()


@contextlib.asynccontextmanager
async def gateway_running(config: ShoalConfig, nats_url: str, registry: Registry) -> AsyncIterator[None]:
    with service_logs("gateway"):
        runner = await start_gateway(config.gateway, nats_url, registry, nats_config=config.nats,
                                     session_ttl_s=config.worker.sessions.idle_timeout_s)
    try:
        yield
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def metrics_serving(registry: Registry, host: str, port: int | None) -> AsyncIterator[None]:
    """``GET /metrics`` for a service that has no gateway of its own (None: don't serve)."""
    if port is None:
        yield
        return
    from aiohttp import web

    from shoal.shared.metrics import CONTENT_TYPE

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=registry.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    try:
        yield
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def nats_for(config: ShoalConfig) -> Iterator[str]:
    """The configured NATS URL, or an embedded server's for as long as the block runs."""
    if config.nats.url:
        yield config.nats.url
        return
    state_dir = Path(config.state_dir).resolve()
    store = Path(config.nats.store_dir) if config.nats.store_dir else state_dir / "jetstream"
    server = EmbeddedNatsServer(store_dir=store, max_payload_bytes=config.nats.max_payload_bytes)
    server.start()
    url_file = state_dir / NATS_URL_FILE
    try:
        url_file.write_text(server.url + "\n")
        log.info("nats_started", url=server.url, store=str(store))
        yield server.url
    finally:
        url_file.unlink(missing_ok=True)
        server.stop()


async def run_up(config: ShoalConfig, nats_url: str) -> None:
    registry = Registry()
    async with contextlib.AsyncExitStack() as stack:
        # The node agent first: the scheduler asks node agents to inspect models as it registers them.
        await stack.enter_async_context(node_agent_running(config, nats_url, registry))
        await stack.enter_async_context(scheduler_running(config, nats_url, registry))
        await stack.enter_async_context(gateway_running(config, nats_url, registry))
        freeze_startup_objects()
        stop = stop_signals()  # before the ready line: a signal right after it must stop Shoal gracefully
        url = f"http://{config.gateway.host}:{config.gateway.port}/v1"
        print(f"Shoal is up: OpenAI API at {url}  (NATS {redacted_url(nats_url)}; Ctrl-C stops everything)",
              flush=True)
        await stop.wait()
        print("Shoal is stopping...", file=sys.stderr, flush=True)
