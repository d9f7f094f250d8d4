"""The gateway's calls to other services (the scheduler, a worker) over NATS, with their
failures as the HTTP errors a client gets.

A service's own error keeps its status; no responder, or none in time, is a 503 whose
``Retry-After`` says when trying again makes sense: a scheduler is restarted by its
supervisor within seconds, a worker that went away leaves others (or a replacement) at once.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from shoal.services.gateway.errors import Unavailable, error_for_status
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import SchedulerCommand, SchedulerReply, scheduler_reply_decoder
from shoal.shared.micro import ServiceCallError, ServiceError, ServiceUnavailable, request_json

SCHEDULER_RETRY_AFTER_S = 5.0
WORKER_RETRY_AFTER_S = 1.0


async def ask_scheduler(bus: Bus, verb: str, command: SchedulerCommand, *, timeout_s: float) -> SchedulerReply:
    """The scheduler's reply to `command` (it may say not ok: the caller decides what that means)."""
    try:
        return await request_json(bus.nc, subjects.scheduler_subject(verb), command, scheduler_reply_decoder,
                                  timeout_s=timeout_s)
    except ServiceUnavailable as exc:
        raise Unavailable("no scheduler is running", retry_after_s=SCHEDULER_RETRY_AFTER_S) from exc
    except ServiceError as exc:
        raise error_for_status(exc.code, exc.description) from exc
    except ServiceCallError as exc:
        raise Unavailable(f"the scheduler did not answer: {exc}", retry_after_s=SCHEDULER_RETRY_AFTER_S) from exc


async def ask_worker(bus: Bus, replica_id: str, verb: str, command: Struct, decoder: msgspec.json.Decoder[Any], *,
                     timeout_s: float) -> Any:
    """Replica `replica_id`'s worker's reply to `command`."""
    try:
        return await request_json(bus.nc, subjects.worker_subject(replica_id, verb), command, decoder,
                                  timeout_s=timeout_s)
    except ServiceError as exc:
        raise error_for_status(exc.code, exc.description) from exc
    except ServiceCallError as exc:  # the replica went away meanwhile: the client may retry at once
        raise Unavailable(f"replica {replica_id} did not answer: {exc}", retry_after_s=WORKER_RETRY_AFTER_S) from exc
