"""The scheduler: model registry, desired replica counts, placement, reconciliation.

Exposed as the ``shoal-scheduler`` micro service on ``shoal.scheduler.<verb>``
(queue-grouped: run several schedulers and each request goes to one). All
cluster state lives in the KV buckets and every GPU change is a CAS, so
schedulers share nothing but NATS.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence

import msgspec
import structlog
from nats.micro import add_service
from nats.micro.service import Service

from shoal.services.scheduler.planner import PlacementDecision, Planner
from shoal.services.scheduler.registry import merge_registration
from shoal.services.scheduler.store import ClusterStore
from shoal.shared import subjects
from shoal.shared.bus import Bus, ensure_model_consumer, publish_event
from shoal.shared.config import SchedulerConfig
from shoal.shared.messages import (
    CreateReplica,
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
    StopReplica,
    model_facts_decoder,
    node_reply_decoder,
    now,
    scheduler_command_decoder,
)
from shoal.shared.metrics import Registry
from shoal.shared.micro import RequestError, ServiceCallError, add_json_endpoint, request_json

log = structlog.get_logger(__name__)

VERSION = "0.1.0"
ACTIVE_STATES = ("pending", "loading", "ready", "draining")
MAX_REPLANS = 8


class Scheduler:
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
        registry = metrics or Registry()
        self.cas_conflicts = registry.counter(
            "shoal_scheduler_gpu_cas_conflicts_total", "GPU key updates that lost a CAS race", ["scheduler"]
        )
        self._placements = registry.counter(
            "shoal_scheduler_placements_total", "Replica placement outcomes", ["scheduler", "outcome"]
        )
        self.store = ClusterStore(
            bus,
            self.scheduler_id,
            conflicts=self.cas_conflicts,
            reservation_ttl_s=config.reservation_ttl_s,
            clock=clock,
            rng=self._rng,
        )
        self._planner = Planner(config.placement, rng=self._rng)
        self._model_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._service: Service | None = None
        self._reconciler: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, models: Sequence[ModelSpec] = ()) -> None:
        for spec in models:
            await self.register(spec)
        self._service = await add_service(
            self._bus.nc,
            name="shoal-scheduler",
            version=VERSION,
            description="Shoal scheduler: placement, replicas, preemption",
            metadata={"scheduler_id": self.scheduler_id},
        )
        for verb in ("ensure", "register", "remove", "scale", "evict", "replica_failed"):
            await add_json_endpoint(
                self._service, verb, subjects.scheduler_subject(verb), scheduler_command_decoder.decode, self.handle
            )
        self._reconciler = asyncio.create_task(self._reconcile_loop())
        log.info("scheduler_started", scheduler=self.scheduler_id, models=len(models))

    async def stop(self) -> None:
        if self._reconciler is not None:
            self._reconciler.cancel()
            await asyncio.gather(self._reconciler, return_exceptions=True)
        if self._service is not None:
            await self._service.stop()

    async def handle(self, command: SchedulerCommand) -> SchedulerReply:
        match command:
            case EnsureModel(model=model, min_replicas=min_replicas):
                return await self.ensure(model, min_replicas)
            case RegisterModel(spec=spec):
                stored = await self.register(spec)
                return SchedulerReply(ok=True, status="ok", model=stored)
            case RemoveModel(model=model):
                return await self.remove(model)
            case ScaleModel(model=model, replicas=replicas):
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
            await self.converge(spec.key)
        return stored

    async def _require_model(self, model: str) -> ModelSpec:
        spec = await self.store.get_model(model)
        if spec is None:
            raise RequestError(404, f"model {model!r} is not registered")
        return spec

    async def remove(self, model: str) -> SchedulerReply:
        await self._require_model(model)
        await self._set_desired(model, lambda _: 0)
        await self.converge(model)
        await self._bus.models.delete(subjects.model_token(model))
        await publish_event(self._bus.js, Event("model_removed", self._clock(), model=model))
        return SchedulerReply(ok=True, status="ok", message=f"model {model} removed")

    async def _set_desired(self, model: str, change: Callable[[int], int]) -> ModelSpec:
        def mutate(current: ModelSpec | None) -> ModelSpec | None:
            if current is None:
                return None
            desired = max(0, change(current.desired_replicas))
            return None if desired == current.desired_replicas else msgspec.structs.replace(
                current, desired_replicas=desired
            )

        spec = await self.store.update_model(model, mutate)
        if spec is None:
            raise RequestError(404, f"model {model!r} is not registered")
        return spec

    # ------------------------------------------------------------------ replicas

    async def ensure(self, model: str, min_replicas: int = 1) -> SchedulerReply:
        """At least `min_replicas` replicas placed (the gateway's call for a model with none)."""
        await self._require_model(model)
        await self._set_desired(model, lambda desired: max(desired, min_replicas))
        return await self.converge(model)

    async def scale(self, model: str, replicas: int) -> SchedulerReply:
        if replicas < 0:
            raise RequestError(400, "replicas must be >= 0")
        await self._require_model(model)
        await self._set_desired(model, lambda _: replicas)
        return await self.converge(model)

    async def evict(self, model: str, replica_id: str | None) -> SchedulerReply:
        """Evict one replica (desired count decremented) or every replica of `model` (desired 0)."""
        await self._require_model(model)
        async with self._model_locks[model]:
            snapshot = await self.store.snapshot()
            targets = [r for r in snapshot.replicas_of(model) if replica_id in (None, r.replica_id)]
            if replica_id is not None and not targets:
                raise RequestError(404, f"replica {replica_id} of {model!r} not found")
            await self._set_desired(model, (lambda _: 0) if replica_id is None else (lambda d: d - 1))
            for record in targets:
                await self._stop_replica(record, reason="evicted by request")
        return await self._reply(model, "ok")

    async def on_replica_failed(self, model: str, replica_id: str, error: str) -> None:
        """Free a failed replica and place a replacement (the desired count is unchanged)."""
        async with self._model_locks[model]:
            entry = await self._bus.replicas.get(subjects.replica_kv_key(model, replica_id))
            if entry is not None:
                await self._forget_replica(entry.value)
        log.warning("replica_replaced", model=model, replica=replica_id, error=error)
        await self.converge(model)

    async def converge(self, model: str) -> SchedulerReply:
        """Place or stop replicas until the model's active count equals its desired count."""
        async with self._model_locks[model]:
            spec = await self.store.get_model(model)
            if spec is None:
                return SchedulerReply(ok=False, status="not_found", message=f"model {model!r} is not registered")
            snapshot = await self.store.snapshot()
            active = [r for r in snapshot.replicas_of(model) if r.state in ACTIVE_STATES]
            for record in _pick_surplus(active, spec.desired_replicas):
                await self._stop_replica(record, reason="scaled down")
            missing = spec.desired_replicas - len(active)
            failures: list[str] = []
            for _ in range(max(0, missing)):
                outcome = await self._place_one(spec)
                if isinstance(outcome, str):
                    failures.append(outcome)
                    break
            if failures:
                return await self._reply(model, "cant_accommodate", failures[0], retry_after_s=5.0)
        return await self._reply(model, "placed" if missing > 0 else "ok")

    async def _reply(self, model: str, status: str, message: str = "", **extra: float) -> SchedulerReply:
        snapshot_replicas = [v.value for v in (await self._bus.replicas.get_all()).values() if v.value.model == model]
        spec = await self.store.get_model(model)
        if status in ("ok", "placed") and any(r.serving for r in snapshot_replicas):
            status = "serving"
        ok = status != "cant_accommodate"
        return SchedulerReply(ok=ok, status=status, message=message, model=spec, replicas=snapshot_replicas, **extra)

    async def _place_one(self, spec: ModelSpec) -> ReplicaRecord | str:
        """Reserve GPU memory for one new replica and start it; a string says why it could not."""
        spec = await self._with_inspection(spec)
        for _ in range(MAX_REPLANS):
            snapshot = await self.store.snapshot()
            decision = self._planner.plan(snapshot, spec)
            if isinstance(decision, str):
                self._placements.inc(scheduler=self.scheduler_id, outcome="cant_accommodate")
                return decision
            if await self.store.reserve(decision.reservation):
                return await self._start_replica(spec, decision)
        self._placements.inc(scheduler=self.scheduler_id, outcome="contended")
        return "placement kept losing races with other schedulers; try again"

    async def _start_replica(self, spec: ModelSpec, decision: PlacementDecision) -> ReplicaRecord | str:
        reservation = decision.reservation
        stamp = self._clock()
        record = ReplicaRecord(
            replica_id=reservation.replica_id,
            model=spec.key,
            node_id=reservation.node_id,
            gpu_bytes=dict(reservation.gpu_bytes),
            gpu_memory_fraction=decision.gpu_memory_fraction,
            dedicated=spec.dedicated,
            cpu_bytes=spec.weight_bytes or 0,
            created_at=stamp,
            updated_at=stamp,
            scheduler_id=self.scheduler_id,
        )
        await self.store.create_replica(record)
        try:
            await request_json(
                self._bus.nc,
                subjects.node_subject(record.node_id, "create"),
                CreateReplica(record, spec),
                node_reply_decoder,
                timeout_s=30.0,
            )
        except ServiceCallError as exc:
            log.error("replica_create_failed", model=spec.key, replica=record.replica_id, error=str(exc))
            await self._forget_replica(record)
            self._placements.inc(scheduler=self.scheduler_id, outcome="create_failed")
            return f"node {record.node_id} could not start the replica: {exc}"
        self._placements.inc(scheduler=self.scheduler_id, outcome="placed")
        await publish_event(self._bus.js, Event("replica_placed", stamp, model=spec.key, replica_id=record.replica_id,
                            node_id=record.node_id, data={"gpu_bytes": {str(k): v for k, v in record.gpu_bytes.items()},
                                                          "memory_source": decision.memory_source}))
        log.info("replica_placed", model=spec.key, replica=record.replica_id, node=record.node_id,
                 gpu_bytes=record.gpu_bytes, memory_source=decision.memory_source)
        return record

    async def _with_inspection(self, spec: ModelSpec) -> ModelSpec:
        """Fill in weight size and config estimate from a node agent, once per model."""
        if spec.weight_bytes is not None:
            return spec
        try:
            facts = await request_json(
                self._bus.nc,
                subjects.NODE_INSPECT,
                InspectModel(spec.path, spec.dtype, spec.kv_cache_tokens),
                model_facts_decoder,
                timeout_s=30.0,
            )
        except ServiceCallError as exc:
            log.warning("model_inspection_failed", model=spec.key, error=str(exc))
            return spec

        def mutate(current: ModelSpec | None) -> ModelSpec | None:
            if current is None:
                return None
            return msgspec.structs.replace(
                current,
                weight_bytes=facts.weight_bytes,
                num_parameters=facts.num_parameters,
                estimated_bytes=facts.estimated_bytes,
                max_model_len=current.max_model_len or facts.max_model_len,
            )

        return await self.store.update_model(spec.key, mutate) or spec

    async def _stop_replica(self, record: ReplicaRecord, reason: str) -> None:
        try:
            await request_json(
                self._bus.nc,
                subjects.node_subject(record.node_id, "stop"),
                StopReplica(record.replica_id, reason),
                node_reply_decoder,
                timeout_s=60.0,
            )
        except ServiceCallError as exc:
            log.warning("replica_stop_unconfirmed", replica=record.replica_id, error=str(exc))
        await self._forget_replica(record)
        await publish_event(self._bus.js, Event("replica_stopped", self._clock(), reason, record.model,
                                                record.replica_id, record.node_id))

    async def _forget_replica(self, record: ReplicaRecord) -> None:
        """Give its GPU memory back, then drop its record (in that order: see the reconciler)."""
        await self.store.release_replica(record)
        await self.store.delete_replica(record)

    # ------------------------------------------------------------------ reconciliation

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.reconcile_interval_s)
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconcile_failed")

    async def reconcile(self) -> None:
        """Repair what crashes leave behind and retry models short of replicas."""
        snapshot = await self.store.snapshot()
        await self.store.remove_lapsed_reservations(snapshot)
        for entry in snapshot.replicas.values():
            record = entry.value
            if record.state == "failed":
                await self.on_replica_failed(record.model, record.replica_id, record.error or "failed")
            elif record.node_id not in snapshot.nodes and record.state in ACTIVE_STATES:
                await self.on_replica_failed(record.model, record.replica_id, f"node {record.node_id} is gone")
        for entry in snapshot.models.values():
            spec = entry.value
            active = [r for r in snapshot.replicas_of(spec.key) if r.state in ACTIVE_STATES]
            if len(active) != spec.desired_replicas:
                await self.converge(spec.key)


def _pick_surplus(active: list[ReplicaRecord], desired: int) -> list[ReplicaRecord]:
    """Replicas to stop when there are more than desired: not-yet-ready ones, then the newest."""
    surplus = len(active) - desired
    if surplus <= 0:
        return []
    ranked = sorted(active, key=lambda r: (r.state == "ready", -r.created_at))
    return ranked[:surplus]
