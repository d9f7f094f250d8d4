"""Placement passes: where the scheduler decides, and writes the decision down.

Every change to the cluster's replicas is one pass (`PlacementPasses.run`):

    snapshot of the four buckets (store.ClusterStore.snapshot)
      -> records.build_snapshot -> ClusterPlanner (shared/placement: the decision)
      -> `operate` (ensure / scale down / evict, from commands.py) -> plan
    under the pass lock:
      -> lease the specs of the models the plan touches, with its desired counts (leases.py:
         serializes schedulers per model; the intent is written before any record)
      -> CAS every GPU key the plan changes, in key order, rolled back if one no longer fits
      -> replica records; leases released; events
      -> the plan's node steps submitted (their dependencies taken in commit order)
    outside it:
      -> node agents: to_cache, delete, from_cache, create (executor.NodeSteps)

A lost race anywhere re-reads and re-plans (bounded by MAX_REPLANS). Schedulers share
nothing but NATS. A pass's caller waits for its own node steps, not for other passes'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from shoal.services.scheduler import leases, records
from shoal.services.scheduler.events import publish_plan_events
from shoal.services.scheduler.executor import NodeSteps, StepResult
from shoal.services.scheduler.store import ClusterStore, StoredCluster
from shoal.shared.bus import Bus
from shoal.shared.messages import ModelSpec
from shoal.shared.metrics import Registry
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.plan import PlacementPlan
from shoal.shared.placement.planner import ClusterPlanner
from shoal.shared.placement.replicas import ReplicaDelta, build_delta, get_planned_locations
from shoal.shared.placement.snapshot import ClusterSnapshot

MAX_REPLANS = 12

Operation = Callable[[ClusterPlanner, dict[str, ModelSpec]], object]
"""Changes a pass makes on the planner, given the model specs by key; whatever it returns
is ignored."""


@dataclass(frozen=True)
class PassOutcome:
    plan: PlacementPlan
    committed: bool
    message: str = ""
    steps: tuple[StepResult, ...] = ()
    """What the node agents did with the plan's delta."""


def without_replicas(delta: ReplicaDelta, replica_ids: set[str]) -> ReplicaDelta:
    """`delta` less every step of `replica_ids` (their records were not written)."""
    if not replica_ids:
        return delta
    return dataclasses.replace(delta, **{
        op: tuple(loc for loc in getattr(delta, op) if loc.replica_id not in replica_ids)
        for op in ("to_cache", "delete", "from_cache", "create")
    })


class PlacementPasses:
    """Runs placement passes for one scheduler (see the module doc)."""

    def __init__(
        self,
        bus: Bus,
        store: ClusterStore,
        *,
        scheduler_id: str,
        policy_config: PlacementConfig,
        reservation_ttl_s: float,
        metrics: Registry,
        on_step_failed: Callable[[StepResult], None],
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        """Args:
        reservation_ttl_s: how long a GPU reservation, and a model lease, lives unconfirmed.
        on_step_failed: told of every from_cache / create a node agent did not carry out.
        """
        self._bus = bus
        self._store = store
        self._scheduler_id = scheduler_id
        self._policy_config = policy_config
        self._ttl_s = reservation_ttl_s
        self._clock = clock
        self._rng = rng
        self._passes = metrics.counter(
            "shoal_scheduler_passes_total", "Placement passes by outcome", ["scheduler", "outcome"]
        )
        self._placed = metrics.counter("shoal_scheduler_replicas_placed_total", "Replicas placed", ["scheduler"])
        self._lock = asyncio.Lock()
        self._stopping = False
        self._steps = NodeSteps(bus, store, self._lock, on_step_failed)

    async def stop(self, grace_s: float = 0.0) -> None:
        """Shutdown: wait for a commit in progress (a pass never stops between its GPU writes
        and its records), let node steps finish for up to `grace_s`, cancel the rest."""
        self._stopping = True
        try:
            async with asyncio.timeout(max(grace_s, 1.0)), self._lock:
                pass  # a commit in progress has finished; no other starts (`run`)
        except TimeoutError:
            pass  # a pass stuck on NATS: its reservations lapse, its records are repaired
        await self._steps.stop(grace_s)

    def has_unfinished_step(self, replica_id: str) -> bool:
        """Whether this scheduler still runs a node step of `replica_id`."""
        return self._steps.has_unfinished(replica_id)

    async def run(self, operate: Operation, *, claimant: str | None = None) -> PassOutcome:
        """Plan on a fresh snapshot and commit it, re-planning on any lost race, under the
        pass lock; then wait, outside the lock, for the plan's own node steps.

        Args:
            claimant: the model a wake places (the memory its own preemption intents keep is
                free for it: `records.build_snapshot`)."""
        async with self._lock:
            if self._stopping:
                return PassOutcome(PlacementPlan(), committed=False, message="the scheduler is stopping")
            outcome, steps = await self._plan_and_commit(operate, claimant)
        if steps is None:
            return outcome
        results = await asyncio.shield(steps)  # a caller that gives up does not cancel the steps
        return dataclasses.replace(outcome, steps=tuple(results))

    async def plan(self, operate: Operation, *, claimant: str | None = None) -> tuple[StoredCluster, PlacementPlan]:
        """What a pass would decide now, committing nothing, with the memory of replicas already
        draining away counted free (a wake looking for its target)."""
        snapshot = await self._store.snapshot()
        return snapshot, self._plan(snapshot, operate, claimant, leaving_is_free=True)

    def _plan(self, snapshot: StoredCluster, operate: Operation, claimant: str | None, *,
              leaving_is_free: bool = False) -> PlacementPlan:
        specs = {v.value.key: v.value for v in snapshot.models.values()}
        planner = ClusterPlanner(self._policy_snapshot(snapshot, claimant, leaving_is_free),
                                 config=self._policy_config, rng=self._rng, clock=self._clock)
        operate(planner, specs)
        return planner.finish()

    async def _plan_and_commit(self, operate: Operation, claimant: str | None
                               ) -> tuple[PassOutcome, asyncio.Task[list[StepResult]] | None]:
        for _ in range(MAX_REPLANS):
            snapshot = await self._store.snapshot()
            plan = self._plan(snapshot, operate, claimant)
            if plan.is_empty:
                self._passes.inc(scheduler=self._scheduler_id, outcome="no_change")
                return PassOutcome(plan, committed=True), None
            steps = await self._commit(snapshot, plan)
            if steps is not None:
                self._passes.inc(scheduler=self._scheduler_id, outcome="committed")
                return PassOutcome(plan, committed=True), steps
            await asyncio.sleep(self._rng.uniform(0.0, 0.02))
        self._passes.inc(scheduler=self._scheduler_id, outcome="contended")
        return PassOutcome(PlacementPlan(), committed=False, message="placement kept losing races; try again"), None

    def _policy_snapshot(self, snapshot: StoredCluster, claimant: str | None, leaving_is_free: bool
                         ) -> ClusterSnapshot:
        return records.build_snapshot(
            snapshot.nodes.values(),
            [v.value for v in snapshot.gpus.values()],
            [v.value for v in snapshot.replicas.values()],
            [v.value for v in snapshot.models.values()],
            config=self._policy_config,
            now=self._clock(),
            claimant=claimant,
            leaving_is_free=leaving_is_free,
            unreadable_gpu_keys=snapshot.malformed_gpu_keys,
        )

    async def _commit(self, snapshot: StoredCluster, plan: PlacementPlan) -> asyncio.Task[list[StepResult]] | None:
        """Write `plan` (see the module doc) and submit its node steps; None when a race was
        lost and nothing stays written.

        Returns:
            The task running the plan's node steps (`NodeSteps.submit`).
        """
        versioned = {v.value.key: v for v in snapshot.models.values()}
        touched = leases.get_touched_models(plan) & versioned.keys()
        stamp = self._clock()
        if any(leases.is_leased_by_other(versioned[m].value, self._scheduler_id, stamp) for m in touched):
            return None
        leased = {m: (versioned[m].revision, leases.take_lease(versioned[m].value, self._scheduler_id, stamp,
                                                               self._ttl_s, plan.desired_replicas.get(m)))
                  for m in touched}
        before = {m: versioned[m].value.desired_replicas for m in touched}
        if not await self._store.commit_specs(leased):
            await self._release_leases(touched, before)
            return None
        replicas = {v.value.replica_id: v.value for v in snapshot.replicas.values()}
        changes = records.plan_to_records(plan, gpus=[v.value for v in snapshot.gpus.values()], replicas=replicas,
                                          scheduler_id=self._scheduler_id, reservation_ttl_s=self._ttl_s)
        if not await self._store.apply_gpu_changes(dict(changes.gpu_changes), snapshot.gpus):
            await self._release_leases(touched, before)  # nothing of the plan stays: nor its counts
            return None
        skipped = await self._store.write_replicas(changes.replica_puts, changes.replica_delete_keys,
                                                   snapshot.replicas)
        for record in changes.replica_puts:
            if record.replica_id in skipped and record.state == "pending":
                # Its record changed since the plan read it (failed, say): no replica to start
                # there, so its reservation goes (an eviction's draining occupant stays: the
                # failure's handling frees it).
                await self._store.release_replica(record)
        specs = await self._release_leases(touched, plan.desired_replicas)
        self._placed.inc(len(plan.placements), scheduler=self._scheduler_id)
        await publish_plan_events(self._bus.js, plan, self._clock())
        recorded = records.get_recorded_locations(replicas.values())
        delta = without_replicas(build_delta(recorded, get_planned_locations(recorded, plan)), skipped)
        new_records = {**replicas, **{r.replica_id: r for r in changes.replica_puts}}
        all_specs = {**{k: v.value for k, v in versioned.items()}, **specs}
        return self._steps.submit(delta, records_before=replicas, records_after=new_records, specs=all_specs)

    async def _release_leases(self, models: set[str], desired: Mapping[str, int]) -> dict[str, ModelSpec]:
        released: dict[str, ModelSpec] = {}
        for model in sorted(models):

            def mutate(current: ModelSpec | None, model: str = model) -> ModelSpec | None:
                return leases.release_lease(current, self._scheduler_id, desired.get(model))

            spec = await self._store.update_model(model, mutate)
            if spec is not None:
                released[model] = spec
        return released
