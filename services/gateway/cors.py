"""Cross-origin requests from browsers (CORS), for the web pages `gateway.cors_origins` names.

A page's script calling the gateway from another origin (a chat UI on ``localhost:3000``, the
`openai` or `ollama` JavaScript library in a browser) is allowed only if its origin is listed
(``*``: any). Browsers ask first with an ``OPTIONS`` preflight, without credentials: it is
answered here, before keys are checked. Every response to a listed origin, streams included,
names it in ``Access-Control-Allow-Origin`` and exposes Shoal's own headers. An origin not
listed gets no CORS headers: the browser then keeps the answer from the page.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from shoal.services.gateway.request_ids import REPLICA_HEADER, REQUEST_ID_HEADER

ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
EXPOSED_HEADERS = f"{REQUEST_ID_HEADER}, {REPLICA_HEADER}, Retry-After"
PREFLIGHT_MAX_AGE_S = 600


class CorsPolicy:
    def __init__(self, origins: list[str]) -> None:
        """`origins`: lower-case origins (`GatewayConfig.cors_origins`); ``scheme://host:*`` takes
        any port, ``*`` any origin."""
        self._any = "*" in origins
        self._exact = frozenset(origin for origin in origins if not origin.endswith(":*"))
        self._any_port = tuple(origin.removesuffix("*") for origin in origins if origin.endswith(":*"))
        self._configured = bool(origins)

    def allows(self, origin: str | None) -> bool:
        if origin is None:
            return False
        origin = origin.lower()
        return (self._any or origin in self._exact
                or any(origin.startswith(prefix) and origin[len(prefix):].isdigit() for prefix in self._any_port))

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        """Answers preflights of listed origins; everything else goes on."""

        @web.middleware
        async def preflight(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                            ) -> web.StreamResponse:
            origin = request.headers.get(hdrs.ORIGIN)
            if (request.method != hdrs.METH_OPTIONS or hdrs.ACCESS_CONTROL_REQUEST_METHOD not in request.headers
                    or not self.allows(origin)):
                return await handler(request)
            headers = {
                hdrs.ACCESS_CONTROL_ALLOW_METHODS: ALLOWED_METHODS,
                hdrs.ACCESS_CONTROL_ALLOW_HEADERS: request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS, ""),
                hdrs.ACCESS_CONTROL_MAX_AGE: str(PREFLIGHT_MAX_AGE_S),
            }
            return web.Response(status=204, headers=headers)  # the origin headers: `on_prepare`

        return preflight

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Name a listed origin on every response to it (aiohttp's ``on_response_prepare``);
        with origins listed one by one, every response varies by ``Origin`` (for caches)."""
        if self._configured and not self._any:
            response.headers.add(hdrs.VARY, hdrs.ORIGIN)
        origin = request.headers.get(hdrs.ORIGIN)
        if not self.allows(origin):
            return
        assert origin is not None
        response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = "*" if self._any else origin
        response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = EXPOSED_HEADERS
