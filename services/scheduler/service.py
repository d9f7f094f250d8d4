"""The scheduler service: the ``shoal-scheduler`` micro endpoints, wired to the parts that do the work.

Exposed on ``shoal.scheduler.<verb>`` (queue-grouped: run several and each request goes
to one of them). Each job is its own module:

    registry.py    register / remove a model, ask node agents about its files
    commands.py    ensure / scale / evict: what each asks of the planner, and the reply
    passes.py      one placement pass: snapshot, plan, lease, commit, node steps
    executor.py    the node steps of a committed plan (order: step_graph.py)
    failures.py    a failed replica: freed once, counted (backoff.py), replaced
    reconciler.py  the periodic repair and refill
    events.py      events on SHOAL_EVENTS
    store.py       every KV read and CAS write;  records.py: records <-> policy types
    leases.py, backoff.py, step_graph.py: the pure rules the async parts follow

The placement decision itself is the pure policy in shared/placement/ (ClusterPlanner).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable, Sequence

import nats.errors
import structlog
from nats.micro import add_service
from nats.micro.service import Service

from shoal.services.scheduler.background import BackgroundTasks
from shoal.services.scheduler.commands import PlacementCommands
from shoal.services.scheduler.failures import FailureHandler
from shoal.services.scheduler.passes import PlacementPasses
from shoal.services.scheduler.reconciler import Reconciler
from shoal.services.scheduler.registry import ModelRegistry
from shoal.services.scheduler.store import ClusterStore
from shoal.services.scheduler.wakes import WakeCoordinator
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.config import SchedulerConfig
from shoal.shared.messages import (
    EnsureModel,
    EvictReplicas,
    ModelSpec,
    RegisterModel,
    RemoveModel,
    ReplicaFailed,
    ReplicaRecord,
    ScaleModel,
    SchedulerCommand,
    SchedulerReply,
    now,
    scheduler_command_decoders,
)
from shoal.shared.metrics import Registry
from shoal.shared.micro import RequestError, add_json_endpoint
from shoal.shared.version import SHOAL_VERSION

log = structlog.get_logger(__name__)

SERVICE_STOP_TIMEOUT_S = 5.0



class SchedulerService:
    """One scheduler: its parts, its micro service and its reconciler (see the module doc)."""

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
        self.scheduler_id = config.scheduler_id or f"sched-{uuid.uuid4().hex[:8]}"
        self.metrics = metrics or Registry()
        rng = rng or random.Random()
        policy_config = config.placement
        self.store = ClusterStore(
            bus,
            self.scheduler_id,
            conflicts=self.metrics.counter(
                "shoal_scheduler_gpu_cas_conflicts_total", "GPU key updates that lost a CAS race", ["scheduler"]
            ),
            spec_conflicts=self.metrics.counter(
                "shoal_scheduler_model_cas_conflicts_total",
                "Placement passes that lost a race for a model spec to another scheduler",
                ["scheduler"],
            ),
            reservation_ttl_s=config.reservation_ttl_s,
            clock=clock,
            rng=rng,
        )
        self._background = BackgroundTasks()
        # The parts call each other through these methods (bound now, resolved when called).
        self._failures = FailureHandler(bus, self.store, replace=self.ensure, background=self._background,
                                        clock=clock)
        self._passes = PlacementPasses(
            bus, self.store, scheduler_id=self.scheduler_id, policy_config=policy_config,
            reservation_ttl_s=config.reservation_ttl_s, metrics=self.metrics,
            on_step_failed=self._failures.on_step_failed, clock=clock, rng=rng,
        )
        self._registry = ModelRegistry(bus, self.store, self._passes, place=self.ensure,
                                       background=self._background, clock=clock)
        self.wakes = WakeCoordinator(bus, self.store, self._passes, scheduler_id=self.scheduler_id,
                                     policy_config=policy_config, metrics=self.metrics,
                                     background=self._background, clock=clock)
        self._commands = PlacementCommands(bus, self.store, self._registry, self._passes, self.wakes,
                                           policy_config=policy_config, metrics=self.metrics, clock=clock)
        self._reconciler = Reconciler(bus, self.store, self._failures, refill=self._refill,
                                      sleep_idle=self._commands.sleep_idle,
                                      interval_s=config.reconcile_interval_s, clock=clock,
                                      scheduler_id=self.scheduler_id,
                                      has_step=self._passes.has_unfinished_step,
                                      stalled_step_s=config.stalled_step_s,
                                      node_lost_after_s=config.node_lost_after_s)
        self._stop_grace_s = config.stop_grace_s
        self._service: Service | None = None
        self._reconciling: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, models: Sequence[ModelSpec] = ()) -> None:
        """Register `models` (the config file's), then answer commands and reconcile."""
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
        self._reconciling = asyncio.create_task(self._reconciler.run())
        log.info("scheduler_started", scheduler=self.scheduler_id, models=len(models))

    async def stop(self) -> None:
        """Stop (SIGTERM): take no more commands, let a commit in progress finish and node steps
        run for up to ``scheduler.stop_grace_s``; what is cut short leaves records any
        scheduler's reconciler finishes (docs/reliability.md)."""
        if self._service is not None:
            try:  # draining the micro service's subscriptions was seen to hang (nats-py): bounded
                await asyncio.wait_for(self._service.stop(), timeout=SERVICE_STOP_TIMEOUT_S)
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("scheduler_service_stop_cut_short", error=repr(exc))
        if self._reconciling is not None:
            self._reconciling.cancel()
            await asyncio.gather(self._reconciling, return_exceptions=True)
        await self._passes.stop(self._stop_grace_s)
        await self._background.stop()

    async def handle(self, command: SchedulerCommand) -> SchedulerReply:
        """One command from a micro endpoint; RequestError becomes its error reply."""
        match command:
            case EnsureModel(model=model, min_replicas=min_replicas):
                return await self.ensure(model, min_replicas)
            case RegisterModel(spec=spec):
                stored = await self.register(await self._registry.check_files(spec.as_registration()))
                return SchedulerReply(ok=True, status="ok", model=stored)
            case RemoveModel(model=model):
                return await self.remove(model)
            case ScaleModel(model=model, num_replicas=num_replicas):
                return await self.scale(model, num_replicas)
            case EvictReplicas(model=model, replica_id=replica_id):
                return await self.evict(model, replica_id)
            case ReplicaFailed(model=model, replica_id=replica_id, error=error):
                await self.on_replica_failed(model, replica_id, error)
                return SchedulerReply(ok=True, status="ok")
        raise RequestError(400, f"unsupported command {type(command).__name__}")

    # ------------------------------------------------------------------ the commands, by part

    async def register(self, spec: ModelSpec) -> ModelSpec:
        return await self._registry.register(spec)

    async def remove(self, model: str) -> SchedulerReply:
        return await self._registry.remove(model)

    async def ensure(self, model: str, min_replicas: int = 1, *, allow_evictions: bool = True) -> SchedulerReply:
        return await self._commands.ensure(model, min_replicas, allow_evictions=allow_evictions)

    async def scale(self, model: str, num_replicas: int) -> SchedulerReply:
        return await self._commands.scale(model, num_replicas)

    async def evict(self, model: str, replica_id: str | None) -> SchedulerReply:
        return await self._commands.evict(model, replica_id)

    async def on_replica_failed(self, model: str, replica_id: str, error: str) -> None:
        await self._failures.on_replica_failed(model, replica_id, error)

    async def reconcile(self) -> None:
        await self._reconciler.reconcile()

    async def reap_held_replica(self, record: ReplicaRecord, *, node_alive: bool) -> bool:
        return await self._reconciler.reap_held_replica(record, node_alive=node_alive)

    async def _refill(self, model: str, num_replicas: int) -> SchedulerReply:
        return await self.ensure(model, num_replicas, allow_evictions=False)
