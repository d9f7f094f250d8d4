"""Which schedulers are alive now: the ``shoal-scheduler`` micro service instances that answer
a ping (what ``nats micro ls`` shows). A repair that would race with a live scheduler's own
work (re-sending a node step it may still be running) waits while that scheduler lives."""

from __future__ import annotations

import asyncio
import json

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = structlog.get_logger(__name__)

PING_SUBJECT = "$SRV.PING.shoal-scheduler"
PING_WAIT_S = 0.3
"""How long pongs are gathered (instances answer within milliseconds on a healthy bus)."""


async def get_live_scheduler_ids(nc: NATS, wait_s: float = PING_WAIT_S) -> set[str] | None:
    """The ``scheduler_id`` of every scheduler that answers a ping within `wait_s`; None when
    the ping could not be sent (NATS reconnecting: nobody can be judged dead)."""
    found: set[str] = set()

    async def on_pong(msg: Msg) -> None:
        try:
            metadata = json.loads(msg.data).get("metadata") or {}
        except (ValueError, AttributeError):
            return
        if isinstance(metadata, dict) and isinstance(metadata.get("scheduler_id"), str):
            found.add(metadata["scheduler_id"])

    inbox = nc.new_inbox()
    try:
        subscription = await nc.subscribe(inbox, cb=on_pong)
        try:
            await nc.publish(PING_SUBJECT, b"", reply=inbox)
            await asyncio.sleep(wait_s)
        finally:
            await subscription.unsubscribe()
    except nats.errors.Error as exc:
        log.warning("scheduler_ping_failed", error=str(exc))
        return None
    return found
