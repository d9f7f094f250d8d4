"""A real HTTP server on a free local port, for tests of HTTP clients (no mock of HTTP)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve(routes: dict[str, Handler]) -> tuple[web.AppRunner, str]:
    """`routes` (POST path -> handler) served on 127.0.0.1; the runner (clean it up) and base URL."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def serving(routes: dict[str, Handler]) -> AsyncIterator[str]:
    """`serve` for the block; yields the base URL."""
    runner, url = await serve(routes)
    try:
        yield url
    finally:
        await runner.cleanup()
