"""Failed replicas: freed once, counted once, replaced unless their model backs off.

Reports of a failure come from the node agent (a worker exited unasked or never became
ready), from a from_cache / create the node did not carry out (`executor.NodeSteps`) and
from the reconciler (a failed record left behind, a node whose heartbeats stopped). One
failure may be reported by several of them; `store.ClusterStore.free_replica` frees it for
exactly one: memory first, then the record. That one counts it on its model's spec
(backoff.py: the failure run, the hold, the never-served rule) and places a replacement
when the model still wants replicas and is not held.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import structlog

from shoal.services.scheduler import backoff
from shoal.services.scheduler.background import BackgroundTasks
from shoal.services.scheduler.executor import STOP_TIMEOUT_S, StepResult, send_node_command
from shoal.services.scheduler.store import ClusterStore
from shoal.shared.bus import Bus
from shoal.shared.messages import ModelSpec, ReplicaRecord, StopReplica
from shoal.shared.micro import ServiceCallError

log = structlog.get_logger(__name__)


class FailureHandler:
    def __init__(
        self,
        bus: Bus,
        store: ClusterStore,
        *,
        replace: Callable[[str, int], Coroutine[Any, Any, object]],
        background: BackgroundTasks,
        clock: Callable[[], float],
    ) -> None:
        """Args:
        replace: places a model's desired replicas again (`commands.PlacementCommands.ensure`).
        background: runs the replacement, which the reporter does not wait for.
        """
        self._bus = bus
        self._store = store
        self._replace = replace
        self._background = background
        self._clock = clock

    async def on_replica_failed(self, model: str, replica_id: str, error: str) -> None:
        """Free a failed replica and count the failure on its model (see the module doc).

        One that served before is replaced (desired count kept); one that never came up is
        removed and the desired count lowered (seed 002), the next request asking again.
        A failure reported twice is counted once."""
        record = await self._store.free_replica(model, replica_id, error=error)
        if record is None:
            log.info("replica_failure_already_handled", model=model, replica=replica_id)
            return
        never_served = record.ready_at is None

        def mutate(current: ModelSpec | None) -> ModelSpec | None:
            if current is None:
                return None
            count = backoff.count_failure(num_failures=current.num_failures,
                                          desired_replicas=current.desired_replicas,
                                          never_served=never_served, now=self._clock())
            return msgspec.structs.replace(current, num_failures=count.num_failures, last_error=error,
                                           desired_replicas=count.desired_replicas, hold_until=count.hold_until)

        spec = await self._store.update_model(model, mutate)
        log.warning("replica_failed", model=model, replica=replica_id, error=error, never_served=never_served,
                    failures=spec.num_failures if spec else None)
        if spec is not None and spec.desired_replicas and not spec.is_held(self._clock()):
            self._background.spawn(self._replace(model, spec.desired_replicas))  # the reporter need not wait

    def on_step_failed(self, result: StepResult) -> None:
        """A from_cache or create the node did not carry out: stop it there, then free and
        replace the replica (`stop_then_free`)."""
        self._background.spawn(self.stop_then_free(result.record, result.error))

    async def stop_then_free(self, record: ReplicaRecord, error: str) -> None:
        """A create or restore that did not complete may still have a worker running (a timeout
        is not a refusal): its node agent stops it first, then the replica is freed, counted and
        replaced. A node that cannot confirm the stop keeps the memory counted: the replica is
        held (``stopping``) and the reconciler frees it once the node confirms."""
        try:
            await send_node_command(self._bus, record.node_id, "stop",
                                    StopReplica(record.replica_id, f"failed: {error}"), STOP_TIMEOUT_S)
        except ServiceCallError as exc:
            log.warning("failed_replica_not_stopped", model=record.model, replica=record.replica_id,
                        node=record.node_id, error=str(exc))
            await self._store.hold_replica(record, error)
            return
        await self.on_replica_failed(record.model, record.replica_id, error)
