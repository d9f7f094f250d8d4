"""The placement commands: ensure, scale, evict, each one placement pass, and their replies.

    ensure   at least N HOT replicas (the gateway, for a model with none on its way:
             what fits is placed, the rest is woken fairly by wakes.py; the reconciler,
             for a model short of its desired count: only what fits)
    scale    exactly N replicas (desired count N)
    evict    one replica (desired count - 1) or all of a model's (desired 0)

What each does to the planner is here; the pass itself (snapshot, plan, commit, node
steps) is passes.py, the decision shared/placement/planner.py.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from shoal.services.scheduler import backoff, records
from shoal.services.scheduler.passes import PassOutcome, PlacementPasses
from shoal.services.scheduler.registry import ModelRegistry, registered_in
from shoal.services.scheduler.store import ClusterStore
from shoal.services.scheduler.wakes import WakeCoordinator
from shoal.shared import subjects
from shoal.shared.bus import Bus, publish_event
from shoal.shared.messages import (
    FAILED_STATUSES,
    Event,
    ModelSpec,
    ReplicaRecord,
    SchedulerReply,
    SchedulerStatus,
)
from shoal.shared.metrics import Registry
from shoal.shared.micro import RequestError
from shoal.shared.model_settings import MAX_REPLICAS
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.memory_figure import UnknownModelMemory
from shoal.shared.placement.planner import ClusterPlanner

OPERATOR_INTEREST_S = 300.0
"""How long a scale-up that needs preemption stays wanted without anyone asking again."""


log = structlog.get_logger(__name__)


class PlacementCommands:
    """ensure / scale / evict for one scheduler."""

    def __init__(
        self,
        bus: Bus,
        store: ClusterStore,
        registry: ModelRegistry,
        passes: PlacementPasses,
        wakes: WakeCoordinator,
        *,
        policy_config: PlacementConfig,
        metrics: Registry,
        clock: Callable[[], float],
    ) -> None:
        self._bus = bus
        self._store = store
        self._registry = registry
        self._passes = passes
        self._wakes = wakes
        self._policy_config = policy_config
        self._clock = clock
        self._sleeps = metrics.counter("shoal_scheduler_sleeps_total", "Replicas put to sleep, by reason",
                                       ["model", "reason"])

    async def ensure(self, model: str, min_replicas: int = 1, *, allow_evictions: bool = True) -> SchedulerReply:
        """At least `min_replicas` HOT replicas (the gateway's call for a model with none).

        What fits without evicting is placed now. With `allow_evictions` (a request waits),
        the rest is woken by fair preemption in the background (wakes.py): the reply says
        ``waking`` (the gateway asks again every second while requests wait: that keeps the
        wake alive) or ``no_victim`` with why and when to retry. Without (the reconciler
        refilling a model short of replicas) it stops at what fits and keeps the desired
        count. Refused (``failing``) while the model backs off after failures (backoff.py)."""
        if not 0 <= min_replicas <= MAX_REPLICAS:
            raise RequestError(400, f"min_replicas must be in 0..{MAX_REPLICAS}")
        spec = await self._registry.inspect(await self._registry.require(model))
        if (held := backoff.get_held_reply(spec, self._clock())) is not None:
            return held
        try:
            records.build_demand(spec, config=self._policy_config)
        except UnknownModelMemory as exc:
            return await self._reply(model, "cant_accommodate", f"{model}: {exc}; no node agent could inspect it")
        if allow_evictions and self._wakes.phase_of(model) not in (None, "blocked"):
            return await self._wake_reply(spec, min_replicas)  # a heartbeat of the running wake
        # A blocked wake keeping its place only holds its GPUs: memory elsewhere may fit now.

        def operate(planner: ClusterPlanner, specs: dict[str, ModelSpec]) -> None:
            current = registered_in(specs, model)
            desired = max(current.desired_replicas, min_replicas)
            planner.ensure(records.build_demand(current, config=self._policy_config, desired_replicas=desired),
                           allow_evictions=False)

        outcome = await self._passes.run(operate, claimant=model if allow_evictions else None)
        if allow_evictions and outcome.committed and any(u.model == model for u in outcome.plan.unplaced):
            return await self._wake_reply(spec, min_replicas)
        return await self._placement_reply(model, outcome)

    async def _wake_reply(self, spec: ModelSpec, num_replicas: int, *, interest_s: float | None = None
                          ) -> SchedulerReply:
        state, detail, retry_after_s = await self._wakes.request(spec, num_replicas, interest_s=interest_s)
        if state == "blocked":
            return await self._reply(spec.key, "no_victim", detail, retry_after_s=max(1.0, retry_after_s))
        return await self._reply(spec.key, "waking", f"waiting for GPU memory ({detail})")

    async def scale(self, model: str, num_replicas: int) -> SchedulerReply:
        """Exactly `num_replicas` replicas (extra ones removed, missing ones placed)."""
        if not 0 <= num_replicas <= MAX_REPLICAS:
            raise RequestError(400, f"replicas must be in 0..{MAX_REPLICAS}")
        spec = await self._registry.inspect(await self._registry.require(model))

        def operate(planner: ClusterPlanner, specs: dict[str, ModelSpec]) -> None:
            planner.scale_down(model, num_replicas)
            if num_replicas:
                planner.ensure(records.build_demand(registered_in(specs, model), config=self._policy_config,
                                                    desired_replicas=num_replicas), allow_evictions=False)

        outcome = await self._passes.run(operate, claimant=model)
        if num_replicas and outcome.committed and any(u.model == model for u in outcome.plan.unplaced):
            # The rest needs memory others hold: woken fairly, as a request would (an operator's
            # wish stays wanted for OPERATOR_INTEREST_S, with nobody asking again).
            return await self._wake_reply(spec, num_replicas, interest_s=OPERATOR_INTEREST_S)
        return await self._placement_reply(model, outcome)

    async def evict(self, model: str, replica_id: str | None) -> SchedulerReply:
        """Evict one replica (desired count - 1) or every replica of `model` (desired 0)."""
        await self._registry.require(model)
        found = True

        def operate(planner: ClusterPlanner, _: dict[str, ModelSpec]) -> None:
            nonlocal found
            if replica_id is None:
                planner.evict_model(model)
            else:
                found = planner.evict_replica(model, replica_id)

        outcome = await self._passes.run(operate)
        if not found:
            raise RequestError(404, f"replica {replica_id} of {model!r} not found")
        return await self._reply(model, "ok" if outcome.committed else "contended", outcome.message)

    async def sleep_idle(self, idle: list[ReplicaRecord]) -> PassOutcome:
        """Put idle replicas to sleep, one pass: parked WARM, weights kept or (``sleep.level =
        "cold"``) dropped, each model's desired count lowered (the next request wakes it)."""
        levels = {spec.key: spec.sleep.level for spec in
                  (e.value for e in (await self._bus.models.get_all()).values())}

        def operate(planner: ClusterPlanner, _: dict[str, ModelSpec]) -> None:
            for record in idle:
                planner.sleep_replica(record.model, record.replica_id, reason="idle", park=True,
                                      drop_weights=levels.get(record.model, "warm") == "cold")

        outcome = await self._passes.run(operate)
        for record in idle:
            log.info("replica_idle_sleep", model=record.model, replica=record.replica_id)
            self._sleeps.inc(model=record.model, reason="idle")
            await publish_event(self._bus.js, Event("replica_slept", self._clock(), "idle", record.model,
                                                    record.replica_id, record.node_id))
        return outcome

    async def _placement_reply(self, model: str, outcome: PassOutcome) -> SchedulerReply:
        unplaced = [u for u in outcome.plan.unplaced if u.model == model]
        if not outcome.committed:
            return await self._reply(model, "contended", outcome.message, retry_after_s=1.0)
        if unplaced:
            return await self._reply(model, "cant_accommodate", unplaced[0].reason, retry_after_s=5.0)
        not_done = [f"{r.op} of {r.record.replica_id}: {r.outcome} ({r.error})" for r in outcome.steps
                    if r.record.model == model and r.outcome != "done"]
        return await self._reply(model, "placed" if outcome.plan.placements else "ok", "; ".join(not_done))

    async def _reply(self, model: str, status: SchedulerStatus, message: str = "", **extra: float) -> SchedulerReply:
        replicas = [v.value for v in (await self._bus.replicas.get_all(subjects.model_token(model) + ".*")).values()]
        spec = await self._store.get_model(model)
        if status in ("ok", "placed") and any(r.serving for r in replicas):
            status = "serving"
        ok = status not in FAILED_STATUSES
        return SchedulerReply(ok=ok, status=status, message=message, model=spec, replicas=replicas, **extra)
