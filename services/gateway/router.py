"""One reply subscription per gateway, routing token chunks to waiting requests by id.

Workers publish to ``shoal.reply.<gateway>.<request>``; the gateway subscribes
once to ``shoal.reply.<gateway>.>`` and hands each decoded reply to the queue
of the request named by the subject's last token. Replies for requests nobody
waits for any more (finished, timed out, disconnected) are dropped.
"""

from __future__ import annotations

import asyncio

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shoal.shared import subjects
from shoal.shared.messages import Reply, reply_decoder

log = structlog.get_logger(__name__)


class ReplyRouter:
    def __init__(self, nc: NATS, gateway_id: str) -> None:
        self._nc = nc
        self.gateway_id = gateway_id
        self._queues: dict[str, asyncio.Queue[Reply]] = {}
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

    def open(self, request_id: str) -> asyncio.Queue[Reply]:
        """Start collecting replies for `request_id` (before publishing the request)."""
        assert request_id not in self._queues, f"request id {request_id} is already waiting for replies"
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self._queues)

    async def _on_reply(self, msg: Msg) -> None:
        request_id = msg.subject[self._prefix_len :]
        queue = self._queues.get(request_id)
        if queue is None:
            return
        try:
            reply = reply_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.error("reply_malformed", request_id=request_id, error=str(exc))
            return
        queue.put_nowait(reply)
