"""A replica's own queue: the session turns gateways send to this replica (session affinity).

A gateway sends a returning turn of a chat session to ``shoal.infer.<model>.<replica>`` when
this replica holds the session's KV (docs/sessions.md, "Session affinity"). Only this replica
pulls that subject, through its own durable consumer (``replica-<id>``); its filter does not
overlap the model's shared ``shoal.infer.<model>``, as a work-queue stream requires.

What arrives there is taken at once, ahead of the shared queue and without waiting for a
free slot (the gateway sent it here because this replica was not saturated, and the turn's
KV is here; the engine queues it). While the replica does not serve (its barrier is up
before a park, or it stops) whatever arrives is moved to the model's shared subject, where
any replica takes it and recomputes. A stopping replica moves what is left, then deletes its
consumer. What a replica that died left there, a gateway moves (services/gateway/dispatch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shoal.services.worker.pulling import pull_arrivals
from shoal.shared import subjects
from shoal.shared.bus import MOVED_ATTEMPT_OFFSET, ensure_replica_consumer
from shoal.shared.messages import encode_msgpack, request_decoder

log = structlog.get_logger(__name__)

FETCH_TIMEOUT_S = 1.0
"""A fetch waits this long for a turn; the loop notices a stop within it."""
DELETE_TIMEOUT_S = 1.0


async def move_to_shared(js: JetStreamContext, msg: Msg) -> bool:
    """Publish the request `msg` holds on its model's shared subject (numbering its attempts
    after the first replica's: `MOVED_ATTEMPT_OFFSET`) and ack `msg`; False, and `msg` left for
    redelivery, if the publish failed. A message that is not a request is termed."""
    try:
        request = request_decoder.decode(msg.data)
    except msgspec.DecodeError as exc:
        log.error("request_malformed", error=str(exc), subject=msg.subject)
        await msg.term()
        return True
    moved = msgspec.structs.replace(request, attempt_offset=MOVED_ATTEMPT_OFFSET)
    headers = dict(msg.headers or {})
    headers[subjects.HDR_MSG_ID] = request.request_id + subjects.MOVED_MSG_ID_SUFFIX
    try:
        await js.publish(subjects.infer_subject(request.model), encode_msgpack(moved), headers=headers, timeout=5.0)
    except (TimeoutError, nats.errors.Error) as exc:
        log.warning("request_move_failed", request_id=request.request_id, error=str(exc))
        return False
    await msg.ack()
    log.info("request_moved_to_shared_queue", request_id=request.request_id, model=request.model)
    return True


class ReplicaQueue:
    """Pulls one replica's own subject until its worker stops (see the module doc).

    Args:
        start: runs a request message this replica takes (the worker's `_handle`, as a task).
        is_serving: whether the replica takes requests now (else what arrives is moved).
        stopping: set when the worker stops: the loop moves what is left and ends.
    """

    def __init__(self, js: JetStreamContext, model: str, replica_id: str, *, ack_wait_s: float, max_fetch: int,
                 start: Callable[[Msg], None], is_serving: Callable[[], bool], stopping: asyncio.Event) -> None:
        self._js = js
        self._model = model
        self._replica_id = replica_id
        self._ack_wait_s = ack_wait_s
        self._max_fetch = max_fetch
        self._start = start
        self._is_serving = is_serving
        self._stopping = stopping
        self.done = asyncio.Event()
        """Set once the loop ended (and a stopping replica's consumer is gone)."""

    async def run(self) -> None:
        try:
            name = await ensure_replica_consumer(self._js, self._model, self._replica_id, ack_wait_s=self._ack_wait_s)
            pull = await self._js.pull_subscribe_bind(durable=name, stream=subjects.REQUESTS_STREAM)
            try:
                await self._pull_until_stopped(pull)
            finally:
                with contextlib.suppress(nats.errors.Error):
                    await pull.unsubscribe()
            if self._stopping.is_set():
                await self._delete_consumer(name)
        finally:
            self.done.set()

    async def _pull_until_stopped(self, pull: JetStreamContext.PullSubscription) -> None:
        """Take or move every turn that arrives; once stopping, end at the first empty fetch
        (a fetch lasts `FETCH_TIMEOUT_S`, so no earlier pull request is still open)."""
        while True:
            num_arrived = 0
            moving: list[Awaitable[bool]] = []
            try:
                async for msg in pull_arrivals(pull, self._max_fetch, FETCH_TIMEOUT_S):
                    num_arrived += 1
                    if self._is_serving():
                        self._start(msg)
                    else:
                        moving.append(move_to_shared(self._js, msg))
            except nats.errors.ConnectionClosedError:
                return
            await asyncio.gather(*moving)
            if num_arrived == 0 and self._stopping.is_set():
                return

    async def _delete_consumer(self, name: str) -> None:
        # A locked-down bus does not let workers delete consumers (one could delete its model's
        # shared one): the request times out, and the server deletes this one once inactive.
        try:
            await asyncio.wait_for(self._js.delete_consumer(subjects.REQUESTS_STREAM, name), DELETE_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error) as exc:  # the server deletes it once inactive
            log.debug("replica_consumer_not_deleted", consumer=name, error=str(exc))
