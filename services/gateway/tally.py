"""Every inference request's count in ``shoal_gateway_requests_total`` and its latency in
``shoal_gateway_request_duration_seconds``, whichever API it came in by."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import structlog

from shoal.services.gateway.errors import ApiError, request_outcome
from shoal.services.gateway.openai_api import decode_body, model_named_in
from shoal.services.gateway.state import GatewayState
from shoal.shared.subjects import MAX_MODEL_KEY_CHARS

log = structlog.get_logger(__name__)


class Tally:
    """One request's labels as they become known: ``model`` is empty unless the request named a
    registered model (clients must not be able to mint label values)."""

    def __init__(self, state: GatewayState) -> None:
        self._state = state
        self.model = ""
        self.outcome = "500"
        """"ok", a status (of an error, or of one sent in a stream after its 200), "no_capacity"
        (`request_outcome`), or "cancelled"."""
        self.started: float | None = None

    def name_model(self, model: str | None) -> None:
        """The model the request names (bound for logging whether or not it is served)."""
        if model is None:
            return
        structlog.contextvars.bind_contextvars(model=model[:MAX_MODEL_KEY_CHARS])  # a body may send megabytes
        self.model = model if self._state.cluster.get_model(model) is not None else ""

    def decode(self, raw: bytes, schema: type[Any]) -> Any:
        """`raw` decoded as `schema` (a 400 if it is not one), its model named either way."""
        try:
            body = decode_body(raw, schema)
        except ApiError:
            self.name_model(model_named_in(raw))
            raise
        self.name_model(body.model)
        return body

    def start(self) -> None:
        """Admitted: its latency counts from now."""
        self.started = time.monotonic()


@contextlib.contextmanager
def tallied(state: GatewayState, kind: str) -> Iterator[Tally]:
    """Count the request when it ends, and log it (``request_answered``, with its request id,
    model, outcome and seconds since it came: the access log an operator follows a request by)."""
    tally = Tally(state)
    came = time.monotonic()
    try:
        yield tally
    except ApiError as exc:
        tally.outcome = request_outcome(exc)
        raise
    except asyncio.CancelledError:
        tally.outcome = "cancelled"  # the client went away
        raise
    finally:
        state.requests_total.inc(model=tally.model, kind=kind, outcome=tally.outcome)
        log.info("request_answered", kind=kind, model=tally.model, outcome=tally.outcome,
                 seconds=round(time.monotonic() - came, 3))
        if tally.started is not None:
            state.latency.observe(time.monotonic() - tally.started, model=tally.model)
