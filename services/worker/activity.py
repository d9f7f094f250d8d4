"""A replica's activity in the cluster state: when a request last started or finished on it,
and how many it runs, written to its record in ``shoal_replicas``.

Placement's "least recently used" and the idle timeout read these (scheduler/records.py).
Batched: at most one KV write per replica per `interval_s`, and none while nothing changed,
whatever the request rate.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import structlog

from shoal.shared import subjects
from shoal.shared.bus import Bus, cas_update
from shoal.shared.messages import ReplicaRecord
from shoal.shared.periodic import sleep_or_stop

log = structlog.get_logger(__name__)

Activity = tuple[float, int]
"""(last request start or finish, requests in flight)."""


class ActivityReporter:
    """Writes one replica's `Activity` to its record, at most once per `interval_s`."""

    def __init__(self, bus: Bus, model: str, replica_id: str, read: Callable[[], Activity],
                 *, interval_s: float = 1.0) -> None:
        self._bus = bus
        self._key = subjects.replica_kv_key(model, replica_id)
        self._read = read
        self._interval_s = interval_s
        self._written: Activity = (0.0, 0)
        self.num_writes = 0

    async def run(self) -> None:
        """Until cancelled; a failed write (NATS reconnecting) is retried at the next tick."""
        while True:
            await sleep_or_stop(self._interval_s)
            try:
                await self.flush()
            except Exception as exc:
                log.warning("activity_not_written", error=str(exc))

    async def flush(self) -> None:
        activity = self._read()
        if activity == self._written:
            return
        last_request_at, num_in_flight = activity

        def mutate(current: ReplicaRecord | None) -> ReplicaRecord | None:
            if current is None or current.state in ("failed", "stopping"):
                return None
            return msgspec.structs.replace(current, last_request_at=max(current.last_request_at, last_request_at),
                                           num_in_flight=num_in_flight)

        await cas_update(self._bus.replicas, self._key, mutate)
        self._written = activity
        self.num_writes += 1
