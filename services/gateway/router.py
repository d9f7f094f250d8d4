"""One reply subscription per gateway, routing token chunks to waiting requests by id.

Workers publish to ``shoal.reply.<gateway>.<request>``; the gateway subscribes
once to ``shoal.reply.<gateway>.>`` and hands each decoded reply to the queue
of the request named by the subject's last token. Replies for requests nobody
waits for any more (finished, timed out, disconnected) are dropped. A reply sent as a
request (a worker's final or error reply) is confirmed on receipt, whoever waits for it,
so the worker stops resending it.

Besides replies, an inbox takes *signals* about its request from the gateway itself
(`ReplicaDied`, `DeliveriesExhausted`), so its one reader sees everything in order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TypeAlias

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shoal.shared import subjects
from shoal.shared.messages import Reply, reply_decoder

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ReplicaDied:
    """The replica with this id failed (its record turned ``failed``)."""

    replica_id: str


@dataclass(frozen=True)
class DeliveriesExhausted:
    """JetStream gave up on the request's message (its max-deliveries advisory)."""

    num_deliveries: int


InboxItem: TypeAlias = Reply | ReplicaDied | DeliveriesExhausted


class ReplyInbox:
    """The replies of one request, in arrival order, for its one reader.

    Cheaper on the hot path than `asyncio.Queue` with `asyncio.wait_for` (a task per
    wait on Python 3.11): waiting is one future and one timer, and a reply already
    there is taken without waiting at all.
    """

    def __init__(self) -> None:
        self._replies: deque[InboxItem] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, reply: InboxItem) -> None:
        self._replies.append(reply)
        if self._waiter is not None:
            _wake(self._waiter)

    async def get(self, timeout_s: float) -> InboxItem | None:
        """The next reply, or None when none arrived within `timeout_s`."""
        if not self._replies:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self._replies.popleft() if self._replies else None


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ReplyRouter:
    def __init__(self, nc: NATS, gateway_id: str) -> None:
        self._nc = nc
        self.gateway_id = gateway_id
        self._inboxes: dict[str, ReplyInbox] = {}
        self._subscription: Subscription | None = None
        self._prefix_len = len(subjects.reply_subject(gateway_id, ""))

    async def start(self) -> None:
        self._subscription = await self._nc.subscribe(
            subjects.reply_wildcard(self.gateway_id), cb=self._on_reply, pending_msgs_limit=1_000_000
        )

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()

    def reply_subject(self, request_id: str) -> str:
        return subjects.reply_subject(self.gateway_id, request_id)

    def open(self, request_id: str) -> ReplyInbox:
        """Start collecting replies for `request_id` (before publishing the request)."""
        assert request_id not in self._inboxes, f"request id {request_id} is already waiting for replies"
        inbox = self._inboxes[request_id] = ReplyInbox()
        return inbox

    def close(self, request_id: str) -> None:
        self._inboxes.pop(request_id, None)

    def signal(self, request_id: str, item: ReplicaDied | DeliveriesExhausted) -> None:
        """Hand `item` to the request's reader, in order with its replies (if it still waits)."""
        inbox = self._inboxes.get(request_id)
        if inbox is not None:
            inbox.put(item)

    @property
    def num_waiting(self) -> int:
        return len(self._inboxes)

    async def _on_reply(self, msg: Msg) -> None:
        request_id = msg.subject[self._prefix_len :]
        if msg.reply:
            try:
                await msg.respond(b"")
            except Exception as exc:  # the worker resends it, or gives up
                log.debug("reply_not_confirmed", request_id=request_id, error=str(exc))
        inbox = self._inboxes.get(request_id)
        if inbox is None:
            return
        try:
            reply = reply_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.error("reply_malformed", request_id=request_id, error=str(exc))
            return
        inbox.put(reply)
