"""The placement commands: ensure, scale, evict, each one placement pass, and their replies.

    ensure   at least N HOT replicas (the gateway, for a model with none on its way;
             the reconciler, for a model short of its desired count)
    scale    exactly N replicas (desired count N)
    evict    one replica (desired count - 1) or all of a model's (desired 0)

What each does to the planner is here; the pass itself (snapshot, plan, commit, node
steps) is passes.py, the decision shared/placement/planner.py.
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.services.scheduler import backoff, records
from shoal.services.scheduler.passes import PassOutcome, PlacementPasses
from shoal.services.scheduler.registry import ModelRegistry
from shoal.services.scheduler.store import ClusterStore
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import ModelSpec, SchedulerReply, SchedulerStatus
from shoal.shared.micro import RequestError
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.memory_figure import UnknownModelMemory
from shoal.shared.placement.planner import ClusterPlanner


class PlacementCommands:
    """ensure / scale / evict for one scheduler."""

    def __init__(
        self,
        bus: Bus,
        store: ClusterStore,
        registry: ModelRegistry,
        passes: PlacementPasses,
        *,
        policy_config: PlacementConfig,
        clock: Callable[[], float],
    ) -> None:
        self._bus = bus
        self._store = store
        self._registry = registry
        self._passes = passes
        self._policy_config = policy_config
        self._clock = clock

    async def ensure(self, model: str, min_replicas: int = 1, *, allow_evictions: bool = True) -> SchedulerReply:
        """At least `min_replicas` HOT replicas (the gateway's call for a model with none).

        `allow_evictions=False` (the reconciler refilling a model short of replicas) places
        only where there is room without evicting and keeps the desired count. Refused
        (status ``failing``) while the model backs off after failures (backoff.py)."""
        spec = await self._registry.inspect(await self._registry.require(model))
        if (held := backoff.get_held_reply(spec, self._clock())) is not None:
            return held
        try:
            records.build_demand(spec, config=self._policy_config)
        except UnknownModelMemory as exc:
            return await self._reply(model, "cant_accommodate", f"{model}: {exc}; no node agent could inspect it")

        def operate(planner: ClusterPlanner, specs: dict[str, ModelSpec]) -> None:
            current = specs[model]
            desired = max(current.desired_replicas, min_replicas)
            planner.ensure(records.build_demand(current, config=self._policy_config, desired_replicas=desired),
                           allow_evictions=allow_evictions)

        return await self._placement_reply(model, await self._passes.run(operate))

    async def scale(self, model: str, num_replicas: int) -> SchedulerReply:
        """Exactly `num_replicas` replicas (extra ones removed, missing ones placed)."""
        if num_replicas < 0:
            raise RequestError(400, "replicas must be >= 0")
        await self._registry.inspect(await self._registry.require(model))

        def operate(planner: ClusterPlanner, specs: dict[str, ModelSpec]) -> None:
            planner.scale_down(model, num_replicas)
            if num_replicas:
                planner.ensure(records.build_demand(specs[model], config=self._policy_config,
                                                    desired_replicas=num_replicas))

        return await self._placement_reply(model, await self._passes.run(operate))

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
        ok = status not in ("cant_accommodate", "contended", "failing")
        return SchedulerReply(ok=ok, status=status, message=message, model=spec, replicas=replicas, **extra)
