"""OpenAI-style errors at the HTTP edge.

Handlers raise `ApiError` subclasses; the error middleware turns them (and
aiohttp's own HTTP errors, and anything unexpected) into
``{"error": {"message", "type", "code", "param"}}`` with the right status; under Ollama's
``/api/`` into Ollama's ``{"error": "<message>"}``, under Anthropic's ``/v1/messages`` into
``{"type": "error", "error": {"type", "message"}}``: the form each API's clients read.
No traceback ever reaches a client; every error is logged with the request id.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import msgspec
import structlog
from aiohttp import web

from shoal.shared.errors import ShoalError

log = structlog.get_logger(__name__)


class ApiError(ShoalError):
    status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s


CAPACITY_CODES = frozenset({"no_victim", "contended"})
"""A 503 for memory short right now (nobody may be preempted yet, or placements collided): the
client retries after its Retry-After. Capacity, not a server failure."""


def request_outcome(error: ApiError) -> str:
    """`error`'s outcome in ``shoal_gateway_requests_total``: its status, or ``no_capacity`` for a
    capacity 503 (`CAPACITY_CODES`), which the page alert on server errors must not count
    (``ShoalNoVictimForWakes`` tickets it)."""
    return "no_capacity" if error.code in CAPACITY_CODES else str(error.status)


class BadRequest(ApiError):
    status = 400
    error_type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    error_type = "authentication_error"


class Forbidden(ApiError):
    status = 403
    error_type = "permission_error"


class NotFound(ApiError):
    status = 404
    error_type = "not_found_error"


class MethodNotAllowed(ApiError):
    status = 405
    error_type = "invalid_request_error"


class PayloadTooLarge(ApiError):
    status = 413
    error_type = "invalid_request_error"


class TooManyRequests(ApiError):
    status = 429
    error_type = "rate_limit_error"


class NotImplementedHere(ApiError):
    status = 501
    error_type = "not_implemented"


class Unavailable(ApiError):
    status = 503
    error_type = "service_unavailable"


class DeadlineExceeded(ApiError):
    status = 504
    error_type = "timeout"


_BY_STATUS: dict[int, type[ApiError]] = {
    cls.status: cls
    for cls in (BadRequest, Unauthorized, Forbidden, NotFound, MethodNotAllowed, PayloadTooLarge, TooManyRequests,
                NotImplementedHere, Unavailable, DeadlineExceeded)
}


def error_for_status(status: int, message: str, *, code: str | None = None) -> ApiError:
    """The ApiError a worker's or scheduler's status maps to (other 4xx: invalid request; 5xx: server)."""
    cls = _BY_STATUS.get(status)
    if cls is not None:
        return cls(message, code=code)
    error = (BadRequest if 400 <= status < 500 else ApiError)(message, code=code)
    error.status = status if 400 <= status < 600 else 500
    return error


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorEnvelope(msgspec.Struct):
    """Every error response's body (OpenAI's)."""

    error: ErrorBody


_encoder = msgspec.json.Encoder()


class OllamaError(msgspec.Struct):
    """Every error response's body under Ollama's ``/api/``, and a stream's failing line."""

    error: str


class AnthropicErrorBody(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct, tag="error", tag_field="type", omit_defaults=True):
    """Every error response's body under Anthropic's ``/v1/messages``, and a stream's ``error`` event."""

    error: AnthropicErrorBody
    request_id: str | None = None


SHOULD_RETRY_HEADER = "x-should-retry"
"""Read by the openai and anthropic clients before their automatic retries."""
OLLAMA_PREFIX = "/api/"
ANTHROPIC_PREFIX = "/v1/messages"
ANTHROPIC_REQUEST_ID_HEADER = "request-id"
"""Where Anthropic's clients read a response's request id (the SDK's ``_request_id``)."""
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error"}
"""Anthropic's error types by status (other 4xx: invalid request; other 5xx: ``api_error``)."""


def anthropic_error(error: ApiError, request_id: str | None = None) -> AnthropicError:
    status = error.status
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return AnthropicError(AnthropicErrorBody(kind, error.message), request_id)


def error_payload(error: ApiError, path: str = "", request_id: str | None = None) -> bytes:
    """`error`'s body in the form of the API `path` belongs to: Ollama's, Anthropic's or OpenAI's."""
    if path.startswith(OLLAMA_PREFIX):
        return _encoder.encode(OllamaError(error.message))
    if path.startswith(ANTHROPIC_PREFIX):
        return _encoder.encode(anthropic_error(error, request_id))
    body = ErrorBody(error.message, error.error_type, error.code, error.param)
    return _encoder.encode(ErrorEnvelope(body))


def error_response(error: ApiError, path: str = "") -> web.Response:
    """`error` as the response to a request for `path` (see `error_payload`)."""
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))  # never before the block ends
    if error.status == DeadlineExceeded.status:
        # The openai and anthropic clients retry every 5xx (twice, by default) unless told not
        # to: a request that ran out its deadline would only queue again on a server already behind.
        headers[SHOULD_RETRY_HEADER] = "false"
    anthropic = path.startswith(ANTHROPIC_PREFIX)
    request_id = structlog.contextvars.get_contextvars().get("request_id") if anthropic else None
    return web.Response(status=error.status,
                        body=error_payload(error, path, request_id), content_type="application/json",
                        headers=headers)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        log.info("request_error", status=exc.status, error=exc.message, path=request.path)
        return error_response(exc, request.path)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"no route for {request.method} {request.path}", 405: f"{request.method} is not allowed on "
                   f"{request.path}", 413: "request body too large"}.get(exc.status, exc.reason)
        log.info("request_error", status=exc.status, error=message, path=request.path)
        return error_response(error_for_status(exc.status, message), request.path)
    except Exception:
        log.exception("request_crashed", path=request.path)
        return error_response(ApiError("internal error; the gateway logged the details"), request.path)
