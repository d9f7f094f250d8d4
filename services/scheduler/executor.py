"""Carrying out a plan's replica delta through the node agents (seed 002's apply()).

A pass commits its plan (GPU keys, replica records) under the scheduler's pass lock and
hands the delta to `NodeSteps.submit`; the node commands run outside the lock, so one
slow to_cache (a worker draining) does not hold up the scheduler's other passes.

Order. Within one delta the steps run one after another as `ReplicaDelta.steps()` lists
them: to_cache, delete, then from_cache, create. Across deltas (passes commit one after
another while earlier steps may still run) each step waits for

    * every earlier step of the same replica (park before restore, create before stop), and
    * a from_cache or create: every earlier to_cache or delete on any of its GPUs
      (memory is given back before it is reused).

That rule is `step_graph.StepGraph` (pure); this module runs it. Dependencies are taken
when a delta is submitted, which happens under the pass lock right after its commit, so
"earlier" is commit order.

Outcomes (`StepResult`):

    done     the node agent carried it out
    failed   to_cache / delete: the worker may still hold its memory. The replica is
               *held*: its record goes back to its recorded allocation with state
               ``stopping`` and its occupants hold their bytes again (pinned: nothing is
               placed on that memory, nothing evicts it); the reconciler frees it once its
               node agent confirms the worker stopped (`reconciler.Reconciler`).
             from_cache / create: returned to the scheduler, which frees and replaces the
               replica (`failures.FailureHandler.on_replica_failed`).
    skipped  a step it waited on did not finish: a from_cache / create whose GPUs were not
               freed is rolled back (reservation released; a new replica's record deleted,
               a restored one's back to WARM) and placed again by a later pass; a step of a
               replica whose earlier step failed is left to that failure's handling.

Holding and resolving a failed step's dependency happen together under the pass lock: a
pass either planned on a snapshot that shows the held memory, or committed before and its
steps wait here and are skipped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import structlog

from shoal.services.scheduler.step_graph import FREEING_OPS, StepGraph
from shoal.services.scheduler.store import ClusterStore
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import (
    CacheReplica,
    CreateReplica,
    ModelSpec,
    NodeCommand,
    ReplicaRecord,
    RestoreReplica,
    StopReplica,
    node_reply_decoder,
)
from shoal.shared.micro import ServiceCallError, request_json
from shoal.shared.placement.replicas import DeltaOp, ReplicaDelta, ReplicaLocation

log = structlog.get_logger(__name__)

STOP_TIMEOUT_S = 90.0
"""A stop: the worker drains (SIGTERM), then is killed after 30 s."""
CACHE_TIMEOUT_S = 150.0
"""to_cache / from_cache: longer than the node agent's own wait on its worker (120 s), so the
agent's answer, not our timeout, says what happened."""
START_TIMEOUT_S = 30.0
"""create: the agent answers once the process is spawned; readiness comes later."""

StepOutcome = Literal["done", "failed", "skipped"]


@dataclass(frozen=True)
class StepResult:
    op: DeltaOp
    record: ReplicaRecord
    """The replica as the plan leaves it (to_cache / delete: as recorded before the plan)."""
    outcome: StepOutcome
    error: str = ""


@dataclass
class _Step:
    step_id: int
    op: DeltaOp
    location: ReplicaLocation
    record: ReplicaRecord
    waits_on_replica: asyncio.Future[bool] | None
    waits_on_gpus: list[asyncio.Future[bool]]
    finished: asyncio.Future[bool]
    """True once carried out; False when failed or skipped (later steps then skip too)."""
    drop_weights: bool = False
    """to_cache: a cold sleep (the plan's record of the replica says so)."""


async def send_node_command(bus: Bus, node_id: str, verb: str, command: NodeCommand, timeout_s: float) -> None:
    """One command to one node agent; raises ServiceCallError when it is not carried out."""
    await request_json(bus.nc, subjects.node_subject(node_id, verb), command, node_reply_decoder,
                       timeout_s=timeout_s)


class NodeSteps:
    """Runs deltas against the node agents in the order the module doc gives."""

    def __init__(
        self, bus: Bus, store: ClusterStore, lock: asyncio.Lock, on_failed: Callable[[StepResult], None]
    ) -> None:
        """Args:
        store: writes holds and roll-backs.
        lock: the scheduler's pass lock (a hold is written under it).
        on_failed: told of every from_cache / create that failed (frees and replaces it).
        """
        self._bus = bus
        self._store = store
        self._lock = lock
        self._on_failed = on_failed
        self._graph = StepGraph()
        self._unfinished: dict[int, asyncio.Future[bool]] = {}
        """By step id: the `finished` future of every step the graph still holds."""
        self._tasks: set[asyncio.Task[list[StepResult]]] = set()

    def submit(
        self,
        delta: ReplicaDelta,
        *,
        records_before: Mapping[str, ReplicaRecord],
        records_after: Mapping[str, ReplicaRecord],
        specs: Mapping[str, ModelSpec],
    ) -> asyncio.Task[list[StepResult]]:
        """Take the delta's dependencies now (call right after its commit, under the pass
        lock) and run it in the background; the task's result lists every step's outcome.

        Args:
            records_before: replica records the plan was made on, by id (held replicas go
                back to these).
            records_after: replica records as the plan leaves them, by id (restores and
                creates carry the new allocation).
            specs: model specs by key (a create needs its model's spec).
        """
        steps = [self._register(op, location, records_before, records_after) for op, location in delta.steps()]
        task = asyncio.create_task(self._run(steps, specs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def has_unfinished(self, replica_id: str) -> bool:
        """Whether this scheduler still runs (or waits to run) a step of `replica_id`."""
        return self._graph.has_unfinished(replica_id)

    async def stop(self, grace_s: float = 0.0) -> None:
        """Let the steps still running finish for up to `grace_s`, then cancel them (shutdown).
        A cancelled step leaves its record ``pending`` or ``draining``: any scheduler's
        reconciler sends it again (`reconciler.Reconciler.repair_stalled_steps`)."""
        if self._tasks and grace_s > 0:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _register(
        self,
        op: DeltaOp,
        location: ReplicaLocation,
        records_before: Mapping[str, ReplicaRecord],
        records_after: Mapping[str, ReplicaRecord],
    ) -> _Step:
        records = records_before if op in FREEING_OPS else records_after
        record = records.get(location.replica_id) or ReplicaRecord(
            replica_id=location.replica_id, model=location.model, node_id=location.node_id,
            gpu_bytes=dict(location.gpu_bytes), level=location.level,
        )
        waits = self._graph.add(op, location.replica_id, [(location.node_id, i) for i in location.gpu_bytes])
        finished: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._unfinished[waits.step_id] = finished
        after_replica = self._unfinished[waits.after_replica] if waits.after_replica is not None else None
        after = records_after.get(location.replica_id)
        return _Step(waits.step_id, op, location, record, after_replica,
                     [self._unfinished[i] for i in waits.after_freeing], finished,
                     drop_weights=op == "to_cache" and after is not None and after.weights_dropped)

    def _set_finished(self, step: _Step, carried_out: bool) -> None:
        """Resolve `step` for the steps waiting on it; steps submitted later do not wait on it."""
        step.finished.set_result(carried_out)
        self._graph.forget(step.step_id)
        del self._unfinished[step.step_id]

    async def _run(self, steps: list[_Step], specs: Mapping[str, ModelSpec]) -> list[StepResult]:
        results = []
        try:
            for step in steps:
                try:
                    result = await self._run_step(step, specs)
                except Exception:  # a KV write failed mid-step: treat the step as failed
                    log.exception("replica_step_error", op=step.op, replica=step.record.replica_id)
                    result = StepResult(step.op, step.record, "failed", f"{step.op} did not complete")
                results.append(result)
                if result.outcome == "failed" and step.op not in FREEING_OPS:
                    self._on_failed(result)
        finally:  # cancelled or broken off: whatever waits on these steps skips
            for step in steps:
                if not step.finished.done():
                    self._set_finished(step, False)
        return results

    async def _run_step(self, step: _Step, specs: Mapping[str, ModelSpec]) -> StepResult:
        replica_ok = step.waits_on_replica is None or await step.waits_on_replica
        gpus_ok = all([await f for f in step.waits_on_gpus])
        if not replica_ok:
            log.warning("replica_step_skipped", op=step.op, replica=step.record.replica_id,
                        reason="an earlier step of this replica did not finish")
            return self._finish(step, "skipped", "an earlier step of this replica did not finish")
        if not gpus_ok:
            log.warning("replica_step_skipped", op=step.op, replica=step.record.replica_id,
                        reason="its GPUs were not freed")
            await self._store.roll_back_placement(step.record, created=step.op == "create")
            return self._finish(step, "skipped", "its GPUs were not freed")
        try:
            await self._send(step, specs)
        except ServiceCallError as exc:
            error = f"{step.op} on node {step.location.node_id} failed: {exc}"
            log.error("replica_step_failed", op=step.op, replica=step.record.replica_id,
                      node=step.location.node_id, error=str(exc))
            if step.op in FREEING_OPS:
                async with self._lock:  # with the dependency's resolution: see the module doc
                    await self._store.hold_replica(step.record, error)
                    return self._finish(step, "failed", error)
            return self._finish(step, "failed", error)
        return self._finish(step, "done")

    def _finish(self, step: _Step, outcome: StepOutcome, error: str = "") -> StepResult:
        self._set_finished(step, outcome == "done")
        return StepResult(step.op, step.record, outcome, error)

    async def _send(self, step: _Step, specs: Mapping[str, ModelSpec]) -> None:
        node_id, replica_id, record = step.location.node_id, step.record.replica_id, step.record
        match step.op:
            case "to_cache":
                await send_node_command(self._bus, node_id, "to_cache",
                                        CacheReplica(replica_id, step.drop_weights), CACHE_TIMEOUT_S)
            case "delete":
                await send_node_command(self._bus, node_id, "stop", StopReplica(replica_id, "evicted"),
                                        STOP_TIMEOUT_S)
            case "from_cache":
                await send_node_command(self._bus, node_id, "from_cache", RestoreReplica(record), CACHE_TIMEOUT_S)
            case "create":
                spec = specs.get(record.model)
                if spec is None:
                    raise ServiceCallError(f"model {record.model} is no longer registered")
                await send_node_command(self._bus, node_id, "create", CreateReplica(record, spec), START_TIMEOUT_S)
