"""JSON request/reply over NATS micro services, with typed errors on both sides.

Servers register endpoints with `add_json_endpoint`: the request is decoded
with the endpoint's decoder (malformed -> error 400), the handler's exceptions
are mapped to micro error codes (never a raw repr to the caller; a model name
that no model can have is a 400), and the
reply Struct is JSON-encoded. Clients call `request_json`, which raises
`ServiceUnavailable`, `ServiceTimeout` or `ServiceError` instead of returning
error bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.micro.request import Request
from nats.micro.service import Service

from shoal.shared.errors import ShoalError
from shoal.shared.messages import encode_json
from shoal.shared.subjects import InvalidModelKey, InvalidModelToken

log = structlog.get_logger(__name__)

C = TypeVar("C")
R = TypeVar("R", bound=msgspec.Struct)

ERROR_CODE_HEADER = "Nats-Service-Error-Code"
ERROR_HEADER = "Nats-Service-Error"


class ServiceCallError(ShoalError, RuntimeError):
    """Base of every failure of a micro-service call."""


class ServiceUnavailable(ServiceCallError):
    """No instance of the service is listening."""


class ServiceTimeout(ServiceCallError):
    """The service did not answer in time."""


class ServiceError(ServiceCallError):
    """The service answered with an error (`code` is an HTTP-like status)."""

    def __init__(self, code: int, description: str) -> None:
        super().__init__(f"{code}: {description}")
        self.code = code
        self.description = description


class RequestError(ShoalError):
    """Raised by a handler to answer with `code` and a message the caller may show."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


MAX_CONCURRENT_REQUESTS = 64
"""Requests one endpoint handles at once; more wait for a slot (nats-py calls a
subscription's handler one message at a time, so each request runs in its own task)."""


async def add_json_endpoint(
    service: Service,
    name: str,
    subject: str,
    decode: Callable[[bytes], C],
    handle: Callable[[C], Awaitable[msgspec.Struct]],
    *,
    max_concurrent: int = MAX_CONCURRENT_REQUESTS,
) -> None:
    """Serve `subject`: decode -> `handle` -> JSON reply, errors as micro error codes.

    Requests are handled concurrently, at most `max_concurrent` at a time: a slow one (a
    restore that takes minutes) never holds up the next (another model's cold start)."""
    slots = asyncio.Semaphore(max_concurrent)
    running: set[asyncio.Task[None]] = set()

    async def handler(request: Request) -> None:
        await slots.acquire()  # backpressure: the subscription waits while every slot is busy
        task = asyncio.create_task(process(request))
        running.add(task)
        task.add_done_callback(finished)

    def finished(task: asyncio.Task[None]) -> None:
        running.discard(task)
        slots.release()

    async def process(request: Request) -> None:
        try:
            command = decode(request.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("request_malformed", endpoint=name, error=str(exc))
            await request.respond_error("400", f"malformed request: {exc}")
            return
        try:
            reply = await handle(command)
        except RequestError as exc:
            await request.respond_error(str(exc.code), str(exc))
            return
        except (InvalidModelKey, InvalidModelToken) as exc:  # a model name no model can have
            await request.respond_error("400", str(exc))
            return
        except Exception:
            log.exception("handler_failed", endpoint=name)
            await request.respond_error("500", f"{name} failed; see the service's log")
            return
        await request.respond(encode_json(reply))

    await service.add_endpoint(name=name, subject=subject, handler=handler)


async def request_json(
    nc: NATS,
    subject: str,
    message: msgspec.Struct,
    decoder: msgspec.json.Decoder[R],
    *,
    timeout_s: float = 10.0,
) -> R:
    """Send `message` as JSON to a micro endpoint and decode its reply."""
    try:
        response = await nc.request(subject, encode_json(message), timeout=timeout_s)
    except nats.errors.NoRespondersError as exc:
        raise ServiceUnavailable(f"nothing serves {subject}") from exc
    except nats.errors.TimeoutError as exc:
        raise ServiceTimeout(f"{subject} did not answer within {timeout_s}s") from exc
    headers = response.headers or {}
    if ERROR_CODE_HEADER in headers:
        try:
            code = int(headers[ERROR_CODE_HEADER])
        except ValueError:
            code = 500
        raise ServiceError(code, headers.get(ERROR_HEADER, ""))
    try:
        return decoder.decode(response.data)
    except msgspec.DecodeError as exc:
        raise ServiceError(502, f"{subject} answered with malformed data: {exc}") from exc
