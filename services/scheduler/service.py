"""The scheduler: model registry, desired replica counts, placement passes, reconciliation.

Exposed as the ``shoal-scheduler`` micro service on ``shoal.scheduler.<verb>``
(queue-grouped: run several and each request goes to one of them). Every
change is a placement pass:

    snapshot of the four buckets -> pure policy (ClusterPlanner) -> plan
    -> CAS the specs of the models it touches (serializes schedulers per model)
    -> CAS every GPU key it changes, in key order, rolled back if one no longer fits
    -> replica records                                   (all of that under the pass lock)
    -> node agents: to_cache, delete, from_cache, create  (outside it: executor.NodeSteps)

A lost race anywhere re-reads and re-plans (bounded). Schedulers share nothing
but NATS. A command's reply waits for its own node steps, not for other passes'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from nats.micro import add_service
from nats.micro.service import Service

from shoal.services.scheduler import records
from shoal.services.scheduler.executor import STOP_TIMEOUT_S, NodeSteps, StepResult, send_node_command
from shoal.services.scheduler.registry import merge_registration
from shoal.services.scheduler.store import ClusterStore, StoredCluster
from shoal.shared import subjects
from shoal.shared.bus import Bus, ensure_model_consumer, publish_event
from shoal.shared.config import SchedulerConfig
from shoal.shared.messages import (
    EnsureModel,
    Event,
    EvictReplicas,
    InspectModel,
    ModelSpec,
    RegisterModel,
    RemoveModel,
    ReplicaFailed,
    ReplicaRecord,
    ScaleModel,
    SchedulerCommand,
    SchedulerReply,
    SchedulerStatus,
    StopReplica,
    model_facts_decoder,
    now,
    scheduler_command_decoders,
)
from shoal.shared.metrics import Registry
from shoal.shared.micro import RequestError, ServiceCallError, ServiceError, add_json_endpoint, request_json
from shoal.shared.placement.memory_figure import UnknownModelMemory
from shoal.shared.placement.plan import PlacementPlan
from shoal.shared.placement.planner import ClusterPlanner
from shoal.shared.placement.replicas import build_delta, get_planned_locations
from shoal.shared.placement.snapshot import ClusterSnapshot
from shoal.shared.version import SHOAL_VERSION

log = structlog.get_logger(__name__)

ACTIVE_STATES = ("pending", "loading", "ready", "draining")
MAX_REPLANS = 12
MAX_HOLD_S = 120.0

Operation = Callable[[ClusterPlanner, dict[str, ModelSpec]], object]
"""Changes a pass makes on the planner; whatever it returns is ignored."""


@dataclass(frozen=True)
class PassOutcome:
    plan: PlacementPlan
    committed: bool
    message: str = ""
    steps: tuple[StepResult, ...] = ()
    """What the node agents did with the plan's delta."""


class SchedulerService:
    """See the module doc."""

    def __init__(
        self,
        bus: Bus,
        config: SchedulerConfig,
        *,
        metrics: Registry | None = None,
        clock: Callable[[], float] = now,
        rng: random.Random | None = None,
    ) -> None:
        self._bus = bus
        self._config = config
        self.scheduler_id = config.scheduler_id or f"sched-{uuid.uuid4().hex[:8]}"
        self._clock = clock
        self._rng = rng or random.Random()
        self._policy_config = config.placement
        registry = metrics or Registry()
        self.metrics = registry
        self.cas_conflicts = registry.counter(
            "shoal_scheduler_gpu_cas_conflicts_total", "GPU key updates that lost a CAS race", ["scheduler"]
        )
        spec_conflicts = registry.counter(
            "shoal_scheduler_model_cas_conflicts_total",
            "Placement passes that lost a race for a model spec to another scheduler",
            ["scheduler"],
        )
        self._passes = registry.counter(
            "shoal_scheduler_passes_total", "Placement passes by outcome", ["scheduler", "outcome"]
        )
        self._placed = registry.counter("shoal_scheduler_replicas_placed_total", "Replicas placed", ["scheduler"])
        self.store = ClusterStore(
            bus,
            self.scheduler_id,
            conflicts=self.cas_conflicts,
            spec_conflicts=spec_conflicts,
            reservation_ttl_s=config.reservation_ttl_s,
            clock=clock,
            rng=self._rng,
        )
        self._lock = asyncio.Lock()
        self._steps = NodeSteps(bus, self.store, self._lock, self._on_step_failed)
        self._background: set[asyncio.Task[object]] = set()
        self._service: Service | None = None
        self._reconciler: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, models: Sequence[ModelSpec] = ()) -> None:
        for spec in models:
            await self.register(spec)
        self._service = await add_service(
            self._bus.nc,
            name="shoal-scheduler",
            version=SHOAL_VERSION,
            description="Shoal scheduler: model registry, placement, replicas",
            metadata={"scheduler_id": self.scheduler_id},
        )
        for verb, decoder in scheduler_command_decoders.items():
            await add_json_endpoint(self._service, verb, subjects.scheduler_subject(verb), decoder.decode, self.handle)
        self._reconciler = asyncio.create_task(self._reconcile_loop())
        log.info("scheduler_started", scheduler=self.scheduler_id, models=len(models))

    async def stop(self) -> None:
        if self._reconciler is not None:
            self._reconciler.cancel()
            await asyncio.gather(self._reconciler, return_exceptions=True)
        if self._service is not None:
            await self._service.stop()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._steps.stop()

    async def handle(self, command: SchedulerCommand) -> SchedulerReply:
        match command:
            case EnsureModel(model=model, min_replicas=min_replicas):
                return await self.ensure(model, min_replicas)
            case RegisterModel(spec=spec):
                stored = await self.register(await self._with_checked_files(spec))
                return SchedulerReply(ok=True, status="ok", model=stored)
            case RemoveModel(model=model):
                return await self.remove(model)
            case ScaleModel(model=model, num_replicas=replicas):
                return await self.scale(model, replicas)
            case EvictReplicas(model=model, replica_id=replica_id):
                return await self.evict(model, replica_id)
            case ReplicaFailed(model=model, replica_id=replica_id, error=error):
                await self.on_replica_failed(model, replica_id, error)
                return SchedulerReply(ok=True, status="ok")
        raise RequestError(400, f"unsupported command {type(command).__name__}")

    # ------------------------------------------------------------------ models

    async def register(self, spec: ModelSpec) -> ModelSpec:
        try:
            subjects.validate_model_key(spec.key)
        except subjects.InvalidModelKey as exc:
            raise RequestError(400, str(exc)) from exc
        stored = await self.store.update_model(spec.key, lambda current: merge_registration(current, spec))
        assert stored is not None, "registering a model must leave a spec behind"
        await ensure_model_consumer(self._bus.js, spec.key)
        await publish_event(self._bus.js, Event("model_registered", self._clock(), model=spec.key))
        if stored.desired_replicas:
            await self.ensure(spec.key, stored.desired_replicas)
        elif stored.weight_bytes is None:
            self._spawn(self._inspected(stored))  # sized ahead of its first request
        return stored

    async def remove(self, model: str) -> SchedulerReply:
        await self._require_model(model)
        outcome = await self._run_pass(lambda planner, _: planner.scale_down(model, 0))
        await self._bus.models.delete(subjects.model_token(model))
        await publish_event(self._bus.js, Event("model_removed", self._clock(), model=model))
        return SchedulerReply(ok=outcome.committed, status="ok", message=f"model {model} removed")

    async def _require_model(self, model: str) -> ModelSpec:
        spec = await self.store.get_model(model)
        if spec is None:
            raise RequestError(404, f"model {model!r} is not registered")
        return spec

    async def _inspected(self, spec: ModelSpec) -> ModelSpec:
        """Fill in weight size and config estimate from a node agent (they see the models root)."""
        if spec.weight_bytes is not None:
            return spec
        try:
            facts = await request_json(self._bus.nc, subjects.NODE_INSPECT,
                                       InspectModel(spec.path, spec.dtype, spec.kv_cache_tokens),
                                       model_facts_decoder, timeout_s=30.0)
        except ServiceCallError as exc:
            log.warning("model_inspection_failed", model=spec.key, error=str(exc))
            return spec

        def mutate(current: ModelSpec | None) -> ModelSpec | None:
            if current is None:
                return None
            return msgspec.structs.replace(current, weight_bytes=facts.weight_bytes,
                                           num_parameters=facts.num_parameters,
                                           estimated_bytes=facts.estimated_bytes,
                                           max_model_len=current.max_model_len or facts.max_model_len)

        return await self.store.update_model(spec.key, mutate) or spec

    async def _with_checked_files(self, spec: ModelSpec) -> ModelSpec:
        """A run-time registration: a node agent must be able to read the checkpoint (400 if
        it cannot); its facts come along. With no node agent answering, it is registered unchecked."""
        try:
            facts = await request_json(self._bus.nc, subjects.NODE_INSPECT,
                                       InspectModel(spec.path, spec.dtype, spec.kv_cache_tokens),
                                       model_facts_decoder, timeout_s=30.0)
        except ServiceError as exc:
            if 400 <= exc.code < 500:
                raise RequestError(400, f"model {spec.key!r}: {exc.description}") from exc
            log.warning("model_inspection_failed", model=spec.key, error=str(exc))
            return spec
        except ServiceCallError as exc:
            log.warning("model_inspection_failed", model=spec.key, error=str(exc))
            return spec
        return msgspec.structs.replace(spec, weight_bytes=facts.weight_bytes, num_parameters=facts.num_parameters,
                                       estimated_bytes=facts.estimated_bytes,
                                       max_model_len=spec.max_model_len or facts.max_model_len)

    # ------------------------------------------------------------------ commands

    async def ensure(self, model: str, min_replicas: int = 1, *, allow_evictions: bool = True) -> SchedulerReply:
        """At least `min_replicas` HOT replicas (the gateway's call for a model with none).

        `allow_evictions=False` (the reconciler refilling a model short of replicas) places
        only where there is room without evicting and keeps the desired count."""
        spec = await self._inspected(await self._require_model(model))
        if (held := self._held(spec)) is not None:
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

        return await self._placement_reply(model, await self._run_pass(operate))

    async def scale(self, model: str, replicas: int) -> SchedulerReply:
        if replicas < 0:
            raise RequestError(400, "replicas must be >= 0")
        await self._inspected(await self._require_model(model))

        def operate(planner: ClusterPlanner, specs: dict[str, ModelSpec]) -> None:
            planner.scale_down(model, replicas)
            if replicas:
                planner.ensure(records.build_demand(specs[model], config=self._policy_config, desired_replicas=replicas))

        return await self._placement_reply(model, await self._run_pass(operate))

    async def evict(self, model: str, replica_id: str | None) -> SchedulerReply:
        """Evict one replica (desired count - 1) or every replica of `model` (desired 0)."""
        await self._require_model(model)
        found = True

        def operate(planner: ClusterPlanner, _: dict[str, ModelSpec]) -> None:
            nonlocal found
            if replica_id is None:
                planner.evict_model(model)
            else:
                found = planner.evict_replica(model, replica_id)

        outcome = await self._run_pass(operate)
        if not found:
            raise RequestError(404, f"replica {replica_id} of {model!r} not found")
        return await self._reply(model, "ok" if outcome.committed else "contended", outcome.message)

    async def on_replica_failed(self, model: str, replica_id: str, error: str) -> None:
        """Free a failed replica. One that served before is replaced (desired count kept);
        one that never came up is removed and the desired count lowered (seed 002), the
        next request asking again. Failures in a row back placement off.

        Idempotent: the record is claimed by a CAS delete, so one failure reported twice
        (the node agent, a failed node step, a reconciler) is counted once."""
        record = await self.store.claim_replica(model, replica_id)
        if record is None:
            log.info("replica_failure_already_handled", model=model, replica=replica_id)
            return
        never_served = record.ready_at is None
        await self.store.release_replica(record)

        def mutate(current: ModelSpec | None) -> ModelSpec | None:
            if current is None:
                return None
            failures = current.num_failures + 1
            hold = min(MAX_HOLD_S, 2.0 ** (failures - 2)) if failures > 1 else 0.0
            desired = max(0, current.desired_replicas - 1) if never_served else current.desired_replicas
            return msgspec.structs.replace(current, num_failures=failures, last_error=error,
                                           desired_replicas=desired,
                                           hold_until=self._clock() + hold if hold else None)

        spec = await self.store.update_model(model, mutate)
        log.warning("replica_failed", model=model, replica=replica_id, error=error, never_served=never_served,
                    failures=spec.num_failures if spec else None)
        if spec is not None and spec.desired_replicas and self._held(spec) is None:
            self._spawn(self.ensure(model, spec.desired_replicas))  # the reporter need not wait for it

    def _held(self, spec: ModelSpec) -> SchedulerReply | None:
        """A reply refusing placement while the model is backing off after failures."""
        if spec.hold_until is None or spec.hold_until <= self._clock():
            return None
        retry = spec.hold_until - self._clock()
        return SchedulerReply(ok=False, status="failing", model=spec, retry_after_s=max(1.0, retry),
                              message=f"replicas of {spec.key} keep failing ({spec.num_failures} in a row); "
                                      f"last error: {spec.last_error}")

    # ------------------------------------------------------------------ placement passes

    async def _run_pass(self, operate: Operation) -> PassOutcome:
        """Plan on a fresh snapshot and commit it, re-planning on any lost race, under the
        pass lock; then wait, outside the lock, for the plan's own node steps."""
        async with self._lock:
            outcome, steps = await self._plan_and_commit(operate)
        if steps is None:
            return outcome
        results = await asyncio.shield(steps)  # a caller that gives up does not cancel the steps
        return dataclasses.replace(outcome, steps=tuple(results))

    async def _plan_and_commit(self, operate: Operation) -> tuple[PassOutcome, asyncio.Task[list[StepResult]] | None]:
        for _ in range(MAX_REPLANS):
            snapshot = await self.store.snapshot()
            specs = {v.value.key: v.value for v in snapshot.models.values()}
            planner = ClusterPlanner(self._policy_snapshot(snapshot), config=self._policy_config,
                                     rng=self._rng, clock=self._clock)
            operate(planner, specs)
            plan = planner.finish()
            if plan.is_empty:
                self._passes.inc(scheduler=self.scheduler_id, outcome="no_change")
                return PassOutcome(plan, committed=True), None
            steps = await self._commit(snapshot, plan)
            if steps is not None:
                self._passes.inc(scheduler=self.scheduler_id, outcome="committed")
                return PassOutcome(plan, committed=True), steps
            await asyncio.sleep(self._rng.uniform(0.0, 0.02))
        self._passes.inc(scheduler=self.scheduler_id, outcome="contended")
        return PassOutcome(PlacementPlan(), committed=False, message="placement kept losing races; try again"), None

    def _policy_snapshot(self, snapshot: StoredCluster) -> ClusterSnapshot:
        return records.build_snapshot(
            snapshot.nodes.values(),
            [v.value for v in snapshot.gpus.values()],
            [v.value for v in snapshot.replicas.values()],
            [v.value for v in snapshot.models.values()],
            config=self._policy_config,
            now=self._clock(),
        )

    async def _commit(self, snapshot: StoredCluster, plan: PlacementPlan) -> asyncio.Task[list[StepResult]] | None:
        """Write `plan` (see the module doc) and submit its node steps; None when a race was
        lost and nothing stays written.

        The models the plan touches are leased on their specs first, by CAS from the
        revisions the plan read: a later pass of any scheduler sees the lease (and backs
        off) or a newer revision (and fails its CAS), so no two plans for one model
        interleave. Leases are released, with the plan's desired counts, once the GPU
        keys and replica records are written; the node agents act after that.

        Returns:
            The task running the plan's node steps (`NodeSteps.submit`).
        """
        versioned = {v.value.key: v for v in snapshot.models.values()}
        touched = set(plan.desired_replicas) | {p.model for p in plan.placements} | {e.model for e in plan.evictions}
        touched &= versioned.keys()
        stamp = self._clock()
        if any(self._leased_by_other(versioned[m].value, stamp) for m in touched):
            return None
        lease_until = stamp + self._config.reservation_ttl_s
        leases = {m: (versioned[m].revision, msgspec.structs.replace(
            versioned[m].value, lease_owner=self.scheduler_id, lease_until=lease_until)) for m in touched}
        if not await self.store.commit_specs(leases):
            await self._release_leases(touched, {})
            return None
        replicas = {v.value.replica_id: v.value for v in snapshot.replicas.values()}
        changes = records.plan_to_records(plan, gpus=[v.value for v in snapshot.gpus.values()], replicas=replicas,
                                       scheduler_id=self.scheduler_id,
                                       reservation_ttl_s=self._config.reservation_ttl_s)
        if not await self.store.apply_gpu_changes(dict(changes.gpu_changes), snapshot.gpus):
            await self._release_leases(touched, {})
            return None
        await self.store.write_replicas(changes.replica_puts, changes.replica_delete_keys)
        specs = await self._release_leases(touched, plan.desired_replicas)
        self._placed.inc(len(plan.placements), scheduler=self.scheduler_id)
        await self._record_events(plan)
        recorded = records.get_recorded_locations(replicas.values())
        delta = build_delta(recorded, get_planned_locations(recorded, plan))
        new_records = {**replicas, **{r.replica_id: r for r in changes.replica_puts}}
        all_specs = {**{k: v.value for k, v in versioned.items()}, **specs}
        return self._steps.submit(delta, records_before=replicas, records_after=new_records, specs=all_specs)

    def _on_step_failed(self, result: StepResult) -> None:
        """A from_cache or create the node did not carry out: free and replace the replica."""
        self._spawn(self.on_replica_failed(result.record.model, result.record.replica_id, result.error))

    def _leased_by_other(self, spec: ModelSpec, stamp: float) -> bool:
        return (spec.lease_owner not in (None, self.scheduler_id)
                and spec.lease_until is not None and spec.lease_until > stamp)

    async def _release_leases(self, models: set[str], desired: Mapping[str, int]) -> dict[str, ModelSpec]:
        released: dict[str, ModelSpec] = {}
        for model in sorted(models):

            def mutate(current: ModelSpec | None, model: str = model) -> ModelSpec | None:
                if current is None or current.lease_owner != self.scheduler_id:
                    return None
                return msgspec.structs.replace(current, lease_owner=None, lease_until=None,
                                               desired_replicas=desired.get(model, current.desired_replicas))

            spec = await self.store.update_model(model, mutate)
            if spec is not None:
                released[model] = spec
        return released

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _record_events(self, plan: PlacementPlan) -> None:
        at = self._clock()
        for placement in plan.placements:
            log.info("replica_placed", model=placement.model, replica=placement.replica_id, node=placement.node_id,
                     gpu_bytes=dict(placement.gpu_bytes), memory_source=placement.memory_source,
                     kind=placement.kind, from_level=placement.from_level)
            await publish_event(self._bus.js, Event(
                "replica_placed", at, model=placement.model, replica_id=placement.replica_id,
                node_id=placement.node_id, data={"gpu_bytes": {str(k): v for k, v in placement.gpu_bytes.items()},
                                                 "memory_source": placement.memory_source,
                                                 "from_level": placement.from_level}))
        for eviction in plan.evictions:
            log.info("replica_evicted", model=eviction.model, replica=eviction.replica_id, node=eviction.node_id,
                     to_level=eviction.to_level, reason=eviction.reason)
            await publish_event(self._bus.js, Event(
                "replica_evicted", at, eviction.reason, eviction.model, eviction.replica_id, eviction.node_id,
                data={"to_level": eviction.to_level}))

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
        spec = await self.store.get_model(model)
        if status in ("ok", "placed") and any(r.serving for r in replicas):
            status = "serving"
        ok = status not in ("cant_accommodate", "contended", "failing")
        return SchedulerReply(ok=ok, status=status, message=message, model=spec, replicas=replicas, **extra)

    # ------------------------------------------------------------------ reconciliation

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.reconcile_interval_s)
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconcile_failed")

    async def reconcile(self) -> None:
        """Repair what crashes and failed node steps leave behind, and refill models short of
        HOT replicas where there is room without evicting (pressure evictions keep a
        model's desired count; the model comes back when room returns or a request asks)."""
        snapshot = await self.store.snapshot()
        await self.store.remove_lapsed_reservations(snapshot)
        for key, excess_bytes in records.find_over_committed(v.value for v in snapshot.gpus.values()).items():
            log.warning("gpu_over_committed", gpu=key, excess_bytes=excess_bytes)
        for entry in snapshot.replicas.values():
            record = entry.value
            if record.state == "failed":
                await self.on_replica_failed(record.model, record.replica_id, record.error or "failed")
            elif record.state == "stopping":
                await self.reap_held_replica(record, node_alive=record.node_id in snapshot.nodes)
            elif record.node_id not in snapshot.nodes and record.state in ACTIVE_STATES:
                await self.on_replica_failed(record.model, record.replica_id, f"node {record.node_id} is gone")
        for model_entry in snapshot.models.values():
            spec = model_entry.value
            hot = [r for r in snapshot.replicas_of(spec.key) if r.level == "HOT" and r.state in ACTIVE_STATES]
            if len(hot) < spec.desired_replicas and self._held(spec) is None:
                await self.ensure(spec.key, spec.desired_replicas, allow_evictions=False)

    async def reap_held_replica(self, record: ReplicaRecord, *, node_alive: bool) -> bool:
        """Free a replica held after a failed to_cache or stop (``stopping``) once its node
        agent confirms the worker is stopped (or the node is gone); until then its memory
        stays accounted. Returns True when it was freed."""
        if node_alive:
            try:
                await send_node_command(self._bus, record.node_id, "stop",
                                        StopReplica(record.replica_id, "held after a failed node step"),
                                        STOP_TIMEOUT_S)
            except ServiceCallError as exc:
                log.warning("held_replica_not_stopped", model=record.model, replica=record.replica_id,
                            node=record.node_id, error=str(exc))
                return False
        claimed = await self.store.claim_replica(record.model, record.replica_id)
        if claimed is None:
            return False
        await self.store.release_replica(claimed)
        log.info("held_replica_freed", model=record.model, replica=record.replica_id, node=record.node_id)
        return True

