"""Which replica holds each chat session's KV: the ``shoal_sessions`` KV bucket.

Several gateways may serve one client's turns (behind a load balancer), so the map lives in
NATS, not in a gateway: key ``<model token>.<session id>``, value `SessionRoute` (JSON, the
replica the last turn's final reply named). A gateway reads it when a turn arrives and writes
it when the turn's final reply comes; a write is one KV put, so two gateways finishing turns
of one session at once leave the later one, which is what the replicas do too.

Bounded and expired by the bucket itself: a memory-stored bucket whose entries live
`ttl_s` after their last write (the worker's session idle time: a route outliving its KV
would only send the turn to a replica that recomputes), at most `SESSION_ROUTES_MAX_BYTES`
(some 200,000 sessions). When it is full, a new route is not recorded (its turns go to any
replica) until older ones expire. Routes are soft state: a lost one costs a recompute,
never a wrong answer, so every failure here is logged and the request goes on.
"""

from __future__ import annotations

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import StorageType

from shoal.shared import subjects
from shoal.shared.bus import TypedBucket, ensure_expiring_bucket
from shoal.shared.messages import SessionRoute, now, session_route_decoder

log = structlog.get_logger(__name__)

SESSION_ROUTES_MAX_BYTES = 64 * 1024**2
"""The bucket's size bound (a route takes some 300 bytes with its key and headers)."""


class SessionRoutes:
    """The ``shoal_sessions`` bucket (see the module doc)."""

    def __init__(self, js: JetStreamContext, ttl_s: float) -> None:
        self._js = js
        self.ttl_s = ttl_s
        self._bucket: TypedBucket[SessionRoute] | None = None

    async def start(self) -> None:
        """Create the bucket, or open it as another gateway created it."""
        kv = await ensure_expiring_bucket(
            self._js, subjects.SESSIONS_BUCKET,
            "Shoal chat sessions: <model token>.<session id> -> the replica holding its KV",
            ttl_s=self.ttl_s, max_bytes=SESSION_ROUTES_MAX_BYTES, storage=StorageType.MEMORY)
        self._bucket = TypedBucket(kv, session_route_decoder, subjects.SESSIONS_BUCKET, self._js)

    @property
    def bucket(self) -> TypedBucket[SessionRoute]:
        assert self._bucket is not None, "SessionRoutes.start() was not awaited"
        return self._bucket

    async def get_replica(self, model: str, session_id: str) -> str | None:
        """The replica holding `session_id`'s KV for `model`; None if unknown (or unreadable)."""
        key = subjects.session_route_key(model, session_id)
        try:
            entry = await self.bucket.get(key)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("session_route_unreadable", key=key, error=str(exc))
            return None
        return entry.value.replica_id if entry is not None else None

    async def put(self, model: str, session_id: str, replica_id: str) -> None:
        """Record that `replica_id` holds the session now (restarts the route's TTL)."""
        key = subjects.session_route_key(model, session_id)
        try:
            await self.bucket.put(key, SessionRoute(replica_id=replica_id, updated_at=now()))
        except (TimeoutError, nats.errors.Error) as exc:  # full, or NATS away: turns go anywhere
            log.warning("session_route_not_recorded", key=key, error=str(exc))

    async def delete(self, model: str, session_id: str) -> bool:
        """Forget the session's route; False if there was none."""
        key = subjects.session_route_key(model, session_id)
        if await self.bucket.get(key) is None:
            return False
        await self.bucket.delete(key)
        return True
