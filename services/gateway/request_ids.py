"""Every HTTP request gets an id first: bound for logging, sent back in ``X-Request-Id``.

The id is made here, never taken from the client: it names the request's reply
subject and is its JetStream de-duplication id, so it must be unique and a
valid subject token.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from shoal.services.gateway.errors import ANTHROPIC_PREFIX, ANTHROPIC_REQUEST_ID_HEADER

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = web.RequestKey("request_id", str)
REPLICA_HEADER = "X-Shoal-Replica"
"""Which replica answered a non-streamed request (debugging, and the replica-spread tests)."""


@web.middleware
async def request_id_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Outermost middleware: every log line of the request carries `request_id`, every
    response (errors included) the ``X-Request-Id`` header (and Anthropic's ``request-id``
    under ``/v1/messages``). Streams set the header
    themselves before they start."""
    request_id = uuid.uuid4().hex
    structlog.contextvars.clear_contextvars()  # keep-alive: a connection serves many requests
    # `service` too: under `shoal up` the process is not only the gateway (cli/launcher.py).
    structlog.contextvars.bind_contextvars(service="gateway", request_id=request_id)
    request[REQUEST_ID] = request_id
    response = await handler(request)
    if not response.prepared:
        response.headers[REQUEST_ID_HEADER] = request_id
        if request.path.startswith(ANTHROPIC_PREFIX):
            response.headers[ANTHROPIC_REQUEST_ID_HEADER] = request_id
    return response
