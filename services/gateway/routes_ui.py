"""The live dashboard: ``/ui`` (a page and its static files) and the data it reads.

    GET /ui                  the page (index.html; no data in it)
    GET /ui/static/<file>    its script and style sheet (package data: no build step, no CDN)
    GET /ui/api/state        nodes, GPUs, replicas, models and their history (JSON);
                             ``?since=<unix time>``: only history points after it; a
                             point leaves out the models that were idle in it
    GET /ui/api/events       SHOAL_EVENTS as server-sent events: the last events, then live
                             ones; each with ``id: <stream sequence>`` (send it back as
                             ``Last-Event-ID`` or ``?after=`` to resume)

The page and its files are open; /ui/api takes the keys of /v1 (auth.py). The page asks
for a key when the gateway wants one and keeps it in the tab's sessionStorage; it sends
it as ``Authorization: Bearer`` (fetch, never a URL). Its admin actions call /admin with
the same key and appear only when that key may use /admin.
"""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path

from aiohttp import web

from shoal.services.gateway.auth import may_use_admin, presented_key
from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.sse import SseStream
from shoal.services.gateway.state import GATEWAY
from shoal.services.gateway.ui_state import build_state

UI_DIR = Path(str(resources.files("shoal.services.gateway") / "ui"))
EVENTS_KEEPALIVE_S = 15.0
PAGE_HEADERS = {
    # Everything comes from this gateway; no inline script: model names and event messages
    # are shown as text, and a policy makes sure nothing else runs if one ever were not.
    "Content-Security-Policy": ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_routes(app: web.Application) -> None:
    app.router.add_get("/ui", page)
    app.router.add_get("/ui/", page)
    app.router.add_static("/ui/static/", UI_DIR, show_index=False, follow_symlinks=False)
    app.router.add_get("/ui/api/state", state)
    app.router.add_get("/ui/api/events", events)


async def page(_: web.Request) -> web.FileResponse:
    return web.FileResponse(UI_DIR / "index.html", headers=PAGE_HEADERS)


def _float_param(request: web.Request, name: str) -> float | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise BadRequest(f"{name} must be a number (unix time), got {raw[:40]!r}", param=name) from None


async def state(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    since = _float_param(request, "since")
    live = gateway.live
    document = build_state(
        gateway.cluster,
        live.get_worker_stats(),
        get_in_flight=gateway.dispatcher.get_num_in_flight,
        history=live.history.get_since(since),
        history_window_s=live.history.window_s,
        gateway_id=gateway.router.gateway_id,
        admin=may_use_admin(gateway.config, presented_key(request.headers, gateway.config.admin_api_keys)),
        at=time.time(),
    )
    return json_response(document, headers={"Cache-Control": "no-store"})


def _after(request: web.Request) -> int:
    raw = request.headers.get("Last-Event-ID") or request.query.get("after") or "0"
    if not raw.isdigit():
        raise BadRequest(f"Last-Event-ID / after must be an event id (a stream sequence), got {raw[:40]!r}",
                         param="after")
    return int(raw)


async def events(request: web.Request) -> web.StreamResponse:
    feed = request.app[GATEWAY].live.events
    after = _after(request)
    listener, backlog = feed.listen(after)
    sse = SseStream(request, keepalive_s=EVENTS_KEEPALIVE_S, describe=lambda _: "no new events")
    try:
        async with sse.keeping_alive():
            await sse.comment("SHOAL_EVENTS")  # commits the response: the client knows it is connected
            for seq, data in backlog:
                await sse.send(data, event_id=seq)
            while (item := await listener.queue.get()) is not None:
                await sse.send(item[1], event_id=item[0])
        await sse.close()
    except ConnectionError:
        pass  # the client left
    finally:
        feed.forget(listener)
    return sse.response


async def end_event_streams(app: web.Application) -> None:
    """``on_shutdown``: end the open event streams, so stopping the gateway does not wait for them."""
    gateway = app.get(GATEWAY)
    if gateway is not None:
        gateway.live.events.close_listeners()
