"""The reconciler: every ``scheduler.reconcile_interval_s``, repair what crashes, partitions
and failed node steps leave behind, and refill models short of HOT replicas where there is room.

    lapsed reservations no record backs           removed (a scheduler died mid-commit)
    GPUs holding more than their total            logged (records.find_over_committed)
    a ``failed`` record                           freed and counted (failures.py)
    a ``stopping`` (held) or ``lost`` record      freed once its node agent confirms the worker
                                                  stopped; kept (memory counted) while its node
                                                  is unreachable
    a record on a node whose heartbeats lapsed    ``lost``: memory still counted, not serving
      (missing ``node_lost_after_s`` while this     (a replacement is placed where there is room)
      scheduler stayed connected)
    a record of a model no longer registered      stopped on its node, then freed
    a ``pending`` / ``draining`` record whose     its node step sent again, derived from the
      plan's scheduler is gone (or dropped the      record (`records.get_stalled_step`): create,
      step), older than                             from_cache, to_cache or stop
      ``scheduler.stalled_step_s``
    a model with fewer HOT replicas than desired  `ensure(..., allow_evictions=False)`,
                                                  unless it backs off after failures
    a serving replica idle for its model's        put to sleep (parked WARM, or COLD by its
      ``sleep.idle_timeout_s``                    ``sleep.level``); its desired count drops

Refills never evict: a pressure eviction keeps its victim's desired count, and the model
comes back when room returns or a request asks (docs/placement.md, departure 10).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from shoal.services.scheduler import records
from shoal.services.scheduler.executor import (
    CACHE_TIMEOUT_S,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    send_node_command,
)
from shoal.services.scheduler.failures import FailureHandler
from shoal.services.scheduler.liveness import get_live_scheduler_ids
from shoal.services.scheduler.step_graph import FREEING_OPS
from shoal.services.scheduler.store import ClusterStore, StoredCluster
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import (
    CacheReplica,
    CreateReplica,
    ModelSpec,
    ReplicaRecord,
    RestoreReplica,
    StopReplica,
)
from shoal.shared.micro import ServiceCallError
from shoal.shared.periodic import sleep_or_stop
from shoal.shared.placement.fairness import is_idle
from shoal.shared.placement.replicas import DeltaOp

log = structlog.get_logger(__name__)

Refill = Callable[[str, int], Awaitable[object]]
"""ensure(model, num_replicas) without evictions."""
SleepIdle = Callable[[list[ReplicaRecord]], Awaitable[object]]
"""Puts these idle replicas to sleep (one pass)."""
HasStep = Callable[[str], bool]
"""Whether this scheduler still runs a node step of a replica."""


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
        scheduler_id: str = "",
        has_step: HasStep = lambda _: False,
        stalled_step_s: float = 60.0,
        node_lost_after_s: float = 10.0,
    ) -> None:
        """Args:
        refill: places a model's missing replicas where no eviction is needed.
        interval_s: time between two rounds of `run`.
        scheduler_id: this scheduler (its own stalled steps are re-sent once it has dropped them).
        has_step: whether this scheduler still runs a node step of a replica.
        stalled_step_s: a pending or draining record this old, whose scheduler is gone, has its
            node step sent again.
        node_lost_after_s: a node missing from ``shoal_nodes`` this long, counted while this
            scheduler stays connected, has its replicas marked ``lost`` (after a NATS outage
            every heartbeat lapsed at once: the agents get the time to heartbeat again).
        """
        self._bus = bus
        self._store = store
        self._failures = failures
        self._refill = refill
        self._sleep_idle = sleep_idle
        self._interval_s = interval_s
        self._clock = clock
        self._scheduler_id = scheduler_id
        self._has_step = has_step
        self._stalled_step_s = stalled_step_s
        self._node_lost_after_s = node_lost_after_s
        self._missing_since: dict[str, float] = {}
        """Node id -> when this scheduler first saw its heartbeat record missing."""
        self._num_reconnects = -1
        self._repairs: dict[str, asyncio.Task[None]] = {}
        """Replica id -> the background repair running for it (one at a time)."""

    async def run(self) -> None:
        """Reconcile every `interval_s` until cancelled; a round that fails is logged."""
        try:
            while True:
                await sleep_or_stop(self._interval_s)
                try:
                    await self.reconcile()
                except Exception:
                    log.exception("reconcile_failed")
        finally:
            for task in self._repairs.values():
                task.cancel()

    async def reconcile(self) -> None:
        """One round (see the module doc)."""
        snapshot = await self._store.snapshot()
        await self._store.remove_lapsed_reservations(snapshot)
        for key, excess_bytes in records.find_over_committed(v.value for v in snapshot.gpus.values()).items():
            log.warning("gpu_over_committed", gpu=key, excess_bytes=excess_bytes)
        live_schedulers: set[str] | None = None
        missing_for = self._track_missing_nodes(snapshot)
        for entry in snapshot.replicas.values():
            record = entry.value
            node_alive = record.node_id in snapshot.nodes
            if record.replica_id in self._repairs:
                continue
            if record.state == "failed":
                await self._failures.on_replica_failed(record.model, record.replica_id, record.error or "failed")
            elif record.state in ("stopping", "lost"):
                if node_alive:  # gone nodes: kept, memory counted, until the agent confirms
                    self._repair(record, self.reap_held_replica(record, node_alive=True))
            elif not node_alive:
                if missing_for[record.node_id] >= self._node_lost_after_s and await self._store.mark_lost(record, f"node {record.node_id} stopped heartbeating"):
                    log.warning("replica_lost", model=record.model, replica=record.replica_id, node=record.node_id)
            elif subjects.model_token(record.model) not in snapshot.models \
                    and await self._store.get_model(record.model) is None:  # (snapshots read specs first)
                self._repair(record, self.reap_held_replica(record, node_alive=True,
                                                            reason="its model is no longer registered"))
            elif (op := records.get_stalled_step(record)) is not None \
                    and self._clock() - record.updated_at > self._stalled_step_s:
                if live_schedulers is None:
                    live_schedulers = await get_live_scheduler_ids(self._bus.nc)
                if self._owner_dropped(record, live_schedulers):
                    spec_entry = snapshot.models.get(subjects.model_token(record.model))
                    self._repair(record, self._resend_step(record, op, spec_entry.value if spec_entry else None))
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

    def _track_missing_nodes(self, snapshot: StoredCluster) -> dict[str, float]:
        """How long each node some replica record names has been missing from ``shoal_nodes``,
        as this scheduler saw it; a reconnect of its own connection starts every count again."""
        num_reconnects = self._bus.nc.stats.get("reconnects", 0)
        if num_reconnects != self._num_reconnects:
            self._num_reconnects = num_reconnects
            self._missing_since.clear()
        stamp = self._clock()
        missing = {e.value.node_id for e in snapshot.replicas.values()} - snapshot.nodes.keys()
        self._missing_since = {node_id: self._missing_since.get(node_id, stamp) for node_id in missing}
        return {node_id: stamp - since for node_id, since in self._missing_since.items()}

    def _owner_dropped(self, record: ReplicaRecord, live_schedulers: set[str] | None) -> bool:
        """Whether the scheduler whose plan left `record` waiting for a node step no longer runs
        that step: it is gone, or it is this one and has dropped it (stopped, cancelled)."""
        if live_schedulers is None:
            return False  # NATS is reconnecting: nobody can be judged dead
        if record.scheduler_id == self._scheduler_id:
            return not self._has_step(record.replica_id)
        return record.scheduler_id not in live_schedulers

    def _repair(self, record: ReplicaRecord, work: Coroutine[Any, Any, object]) -> None:
        """Run `work` for `record` in the background (a stop may take a drain's time), one at a time."""
        task = asyncio.create_task(self._run_repair(record, work))
        self._repairs[record.replica_id] = task
        task.add_done_callback(lambda _: self._repairs.pop(record.replica_id, None))

    @staticmethod
    async def _run_repair(record: ReplicaRecord, work: Coroutine[Any, Any, object]) -> None:
        try:
            await work
        except Exception:
            log.exception("repair_failed", model=record.model, replica=record.replica_id)

    async def _resend_step(self, record: ReplicaRecord, op: DeltaOp, spec: ModelSpec | None) -> None:
        """Send again the node step a record still waits for (its plan's scheduler dropped it)."""
        log.warning("stalled_step_resent", op=op, model=record.model, replica=record.replica_id,
                    node=record.node_id, scheduler=record.scheduler_id)
        try:
            match op:
                case "create":
                    if spec is None:
                        raise ServiceCallError(f"model {record.model} is no longer registered")
                    await send_node_command(self._bus, record.node_id, "create", CreateReplica(record, spec),
                                            START_TIMEOUT_S)
                case "from_cache":
                    await send_node_command(self._bus, record.node_id, "from_cache", RestoreReplica(record),
                                            CACHE_TIMEOUT_S)
                case "to_cache":
                    await send_node_command(self._bus, record.node_id, "to_cache", CacheReplica(record.replica_id, record.weights_dropped),
                                            CACHE_TIMEOUT_S)
                case "delete":
                    await send_node_command(self._bus, record.node_id, "stop",
                                            StopReplica(record.replica_id, "evicted"), STOP_TIMEOUT_S)
        except ServiceCallError as exc:
            error = f"{op} on node {record.node_id} (sent again) failed: {exc}"
            log.error("stalled_step_failed", op=op, replica=record.replica_id, error=str(exc))
            if op in FREEING_OPS:
                await self._store.hold_replica(record, error)
            else:
                await self._failures.stop_then_free(record, error)

    async def reap_held_replica(self, record: ReplicaRecord, *, node_alive: bool,
                                reason: str = "held after a failed node step") -> bool:
        """Free a replica held after a failed to_cache or stop (``stopping``), or ``lost`` with
        its node, once its node agent confirms the worker is stopped; until then (and while
        its node is unreachable) its memory stays accounted. Memory first, then the record
        (`ClusterStore.free_replica`). Returns True when it was freed (by this call)."""
        if not node_alive:
            return False
        try:
            await send_node_command(self._bus, record.node_id, "stop", StopReplica(record.replica_id, reason),
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
