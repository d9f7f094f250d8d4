"""The reconciler: every ``scheduler.reconcile_interval_s``, repair what crashes and failed
node steps leave behind, and refill models short of HOT replicas where there is room.

    lapsed reservations with no replica record     removed (a scheduler died mid-commit)
    GPUs holding more than their total            logged (records.find_over_committed)
    a ``failed`` record                           freed and counted (failures.py)
    a ``stopping`` (held) record                  freed once its node agent confirms the
                                                  worker stopped, or the node is gone
    a live record on a node that is gone          failed: freed, counted, replaced
    a model with fewer HOT replicas than desired  `ensure(..., allow_evictions=False)`,
                                                  unless it backs off after failures
    a serving replica idle for its model's        put to sleep (parked WARM, or COLD by its
      ``sleep.idle_timeout_s``                    ``sleep.level``); its desired count drops

Refills never evict: a pressure eviction keeps its victim's desired count, and the model
comes back when room returns or a request asks (docs/placement.md, departure 10).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from shoal.services.scheduler import records
from shoal.services.scheduler.executor import STOP_TIMEOUT_S, send_node_command
from shoal.services.scheduler.failures import FailureHandler
from shoal.services.scheduler.store import ClusterStore, StoredCluster
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import ReplicaRecord, StopReplica
from shoal.shared.micro import ServiceCallError
from shoal.shared.placement.fairness import is_idle

log = structlog.get_logger(__name__)

Refill = Callable[[str, int], Awaitable[object]]
"""ensure(model, num_replicas) without evictions."""
SleepIdle = Callable[[list[ReplicaRecord]], Awaitable[object]]
"""Puts these idle replicas to sleep (one pass)."""


class Reconciler:
    def __init__(
        self,
        bus: Bus,
        store: ClusterStore,
        failures: FailureHandler,
        *,
        refill: Refill,
        sleep_idle: SleepIdle,
        interval_s: float,
        clock: Callable[[], float],
    ) -> None:
        """Args:
        refill: places a model's missing replicas where no eviction is needed.
        interval_s: time between two rounds of `run`.
        """
        self._bus = bus
        self._store = store
        self._failures = failures
        self._refill = refill
        self._sleep_idle = sleep_idle
        self._interval_s = interval_s
        self._clock = clock

    async def run(self) -> None:
        """Reconcile every `interval_s` until cancelled; a round that fails is logged."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconcile_failed")

    async def reconcile(self) -> None:
        """One round (see the module doc)."""
        snapshot = await self._store.snapshot()
        await self._store.remove_lapsed_reservations(snapshot)
        for key, excess_bytes in records.find_over_committed(v.value for v in snapshot.gpus.values()).items():
            log.warning("gpu_over_committed", gpu=key, excess_bytes=excess_bytes)
        for entry in snapshot.replicas.values():
            record = entry.value
            if record.state == "failed":
                await self._failures.on_replica_failed(record.model, record.replica_id, record.error or "failed")
            elif record.state == "stopping":
                await self.reap_held_replica(record, node_alive=record.node_id in snapshot.nodes)
            elif record.node_id not in snapshot.nodes and record.is_active:
                await self._failures.on_replica_failed(record.model, record.replica_id,
                                                       f"node {record.node_id} is gone")
        if idle := self._find_idle(snapshot):
            await self._sleep_idle(idle)
        for model_entry in snapshot.models.values():
            spec = model_entry.value
            hot = [r for r in snapshot.replicas_of(spec.key) if r.level == "HOT" and r.is_active]
            if len(hot) < spec.desired_replicas and not spec.is_held(self._clock()):
                await self._refill(spec.key, spec.desired_replicas)

    def _find_idle(self, snapshot: StoredCluster) -> list[ReplicaRecord]:
        """Serving replicas with no request for their model's idle timeout (none in flight). The
        idle clock runs from the later of its last request and its start of serving; only
        requests reach a worker, so health checks and metrics never keep it awake."""
        now = self._clock()
        serving_since: dict[str, float] = {}
        for gpu_entry in snapshot.gpus.values():
            for occupant in gpu_entry.value.occupants:
                if occupant.state == "serving":
                    serving_since[occupant.replica_id] = max(occupant.since,
                                                             serving_since.get(occupant.replica_id, 0.0))
        idle = []
        for entry in snapshot.replicas.values():
            record = entry.value
            spec_entry = snapshot.models.get(subjects.model_token(record.model))
            if spec_entry is None or not record.serving or record.replica_id not in serving_since:
                continue
            last_accessed = max(record.last_request_at, serving_since[record.replica_id])
            if is_idle(last_accessed=last_accessed, num_in_flight=record.num_in_flight,
                       idle_timeout_s=spec_entry.value.sleep.idle_timeout_s, now=now):
                idle.append(record)
        return idle

    async def reap_held_replica(self, record: ReplicaRecord, *, node_alive: bool) -> bool:
        """Free a replica held after a failed to_cache or stop (``stopping``) once its node
        agent confirms the worker is stopped (or the node is gone); until then its memory
        stays accounted. Memory first, then the record (`ClusterStore.free_replica`).
        Returns True when it was freed (by this call)."""
        if node_alive:
            try:
                await send_node_command(self._bus, record.node_id, "stop",
                                        StopReplica(record.replica_id, "held after a failed node step"),
                                        STOP_TIMEOUT_S)
            except ServiceCallError as exc:
                log.warning("held_replica_not_stopped", model=record.model, replica=record.replica_id,
                            node=record.node_id, error=str(exc))
                return False
        freed = await self._store.free_replica(record.model, record.replica_id, error=record.error or "held")
        if freed is None:
            return False
        log.info("held_replica_freed", model=record.model, replica=record.replica_id, node=record.node_id)
        return True
