"""Waking a model that is short of GPU memory, fairly (seed 001).

A request for a model with no replica on its way comes to `WakeCoordinator.ensure`.
What fits is placed at once (a WARM replica restored, or a new one created). What does
not fit starts a wake, which runs in the background while the gateway's requests wait in
the model's stream (the gateway asks again every second: that is the wake's interest)::

    target: where the planner would put it if fair preemption were allowed
      │ nowhere ─▶ no eligible victim: blocked for a while, requests get 503 saying why;
      │            the wake keeps its place in line (below)
    preemption intents on the target GPUs (CAS), first come first served
    fairness wait, max_wait_s: every second, claim if it fits (an idle model may sleep)
    victims: fairness.select_victims on the target GPUs (LRU, not popular, past min runtime)
      │ none, only because a replica there is still loading ─▶ re-check every second
      │ none ─▶ blocked, as above
    preemption pass: the victims drain (barrier, in-flight requests finish) and park or
    stop; their node agents release the memory once the workers have let it go
      │ released, but taken by a waker ahead in line ─▶ victims again
    claim: wake lock on the target GPUs (CAS, expiring), a placement pass that may use
    the memory the intents kept, the restore or start; then the lock and intents go

A blocked wake keeps its place in line when a victim becomes eligible at a known time (an
occupant's minimum runtime ends): its intents stay on its target GPUs with its first `since`,
so the memory freed first goes to the model that has waited longest, not to whichever model
asks first once the block is over. Its requests get 503 with Retry-After meanwhile; from the
block's end it runs again as soon as a request asks (the client's retry), or it ends when none
has by `INTEREST_TTL_S` after. A block nothing will clear by itself (every occupant popular,
a model larger than any GPU) ends the wake.

A wake nobody asks about for `INTEREST_TTL_S` (every waiting request cancelled or timed
out) is cancelled. Several schedulers: a wake belongs to the scheduler that started it;
another one that is asked refreshes the interest on the intents, where the owner reads it.
Locks and intents expire, so a crashed owner leaves nothing behind for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import structlog

from shoal.services.scheduler import records
from shoal.services.scheduler.background import BackgroundTasks
from shoal.services.scheduler.passes import PassOutcome, PlacementPasses
from shoal.services.scheduler.store import ClusterStore
from shoal.shared import gpu_state, subjects
from shoal.shared.bus import Bus, cas_update, publish_event
from shoal.shared.messages import Event, EventKind, GpuRecord, ModelSpec, PreemptionIntent
from shoal.shared.metrics import Registry
from shoal.shared.periodic import sleep_or_stop
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.fairness import (
    RECHECK_INTERVAL_S,
    NoVictim,
    OccupantView,
    Victims,
    behind_older_wakers,
    get_voluntary_release_at,
    keeps_place,
    next_held_step,
    next_wake_step,
    select_victims,
)
from shoal.shared.placement.planner import ClusterPlanner

log = structlog.get_logger(__name__)

INTEREST_TTL_S = 5.0
"""A wake nobody asked about (no waiting request) for this long is cancelled."""
INTENT_TTL_S = 30.0
"""An intent its owner stopped refreshing (a crashed scheduler) lapses after this."""
LOCK_TTL_S = 30.0
"""A wake lock its holder stopped renewing lapses after this; renewed while the claim runs."""
RELEASE_MARGIN_S = 60.0
"""Victims park or stop within their drain timeout plus this, or the wake gives up."""
POLL_S = 0.5
"""How often a wake whose victims are draining checks whether the memory is free."""
BLOCK_WITHOUT_RETRY_S = 30.0
"""How long a wake with no eligible victim and no time one becomes eligible answers 503."""

Phase = Literal["waiting", "preempting", "claiming", "blocked"]


class WakeCancelled(Exception):
    """The wake is not wanted any more (its message says why)."""


@dataclass
class Wake:
    """One model's wake, run by this scheduler."""

    model: str
    num_replicas: int
    started_at: float
    interest_until: float
    phase: Phase = "waiting"
    gpu_bytes: dict[str, int] = field(default_factory=dict)
    """The memory it needs, by GPU key (where its intents are)."""
    fairness_wait_observed: bool = False
    intents_put_at: float = float("-inf")
    last_asked_at: float = float("-inf")
    """When a request last asked for it (here, or through another scheduler's note on its intents)."""
    asked: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by every request that asks for it (wakes a blocked wake whose block is over)."""

    @property
    def holder(self) -> str:
        return self.model


class WakeCoordinator:
    """Runs this scheduler's wakes (see the module doc)."""

    def __init__(
        self,
        bus: Bus,
        store: ClusterStore,
        passes: PlacementPasses,
        *,
        scheduler_id: str,
        policy_config: PlacementConfig,
        metrics: Registry,
        background: BackgroundTasks,
        clock: Callable[[], float],
    ) -> None:
        self._bus = bus
        self._store = store
        self._passes = passes
        self._scheduler_id = scheduler_id
        self._policy_config = policy_config
        self._background = background
        self._clock = clock
        self._wakes: dict[str, Wake] = {}
        self._wakes_total = metrics.counter("shoal_scheduler_wakes_total", "Wakes by outcome",
                                            ["model", "outcome"])
        self._preemptions = metrics.counter("shoal_scheduler_preemptions_total", "Replicas preempted, by model",
                                            ["model"])
        self._wake_seconds = metrics.histogram("shoal_scheduler_wake_duration_seconds",
                                               "From a wake's start to its replica placed", ["model"])
        self._fairness_wait = metrics.histogram("shoal_scheduler_fairness_wait_seconds",
                                                "Time a wake waited before it claimed or preempted", ["model"])
        self._lock_conflicts = metrics.counter("shoal_scheduler_wake_lock_conflicts_total",
                                               "Claims that found a GPU's wake lock held by another waker",
                                               ["scheduler"])

    def phase_of(self, model: str) -> Phase | None:
        wake = self._wakes.get(model)
        return wake.phase if wake is not None else None

    async def stop(self) -> None:
        """Nothing to do: wakes run as background tasks, cancelled with them; their intents lapse."""

    # ------------------------------------------------------------------ entry

    async def request(self, spec: ModelSpec, num_replicas: int, *, interest_s: float | None = None
                      ) -> tuple[Literal["waking", "blocked"], str, float]:
        """A request wants `num_replicas` HOT replicas of `spec` and not all fit now: start (or keep
        alive) its wake, wanted for `interest_s` more (default `INTEREST_TTL_S`). Returns
        ("waking", phase, 0) or ("blocked", why, retry after s)."""
        now = self._clock()
        interest_until = now + (INTEREST_TTL_S if interest_s is None else interest_s)
        if spec.wake_blocked_until is not None and spec.wake_blocked_until > now:
            # A refused request is no interest: only those that ask after the block keep a wake.
            return "blocked", spec.wake_blocked_reason or "no replica may be preempted", spec.wake_blocked_until - now
        wake = self._wakes.get(spec.key)
        if wake is not None:  # running, or keeping its place after a block: this request asks again
            wake.interest_until = max(wake.interest_until, interest_until)
            wake.num_replicas = max(wake.num_replicas, num_replicas)
            wake.last_asked_at = now
            wake.asked.set()  # a blocked wake whose block is over resumes at once
            return "waking", "waiting" if wake.phase == "blocked" else wake.phase, 0.0
        if await self._note_interest_elsewhere(spec.key, interest_until, now):
            return "waking", "waiting", 0.0
        wake = Wake(spec.key, num_replicas, started_at=now, interest_until=interest_until)
        self._wakes[spec.key] = wake
        self._background.spawn(self._run(wake, spec))
        await self._event("wake_started", wake.model, f"{wake.model} needs GPU memory; waking it fairly")
        return "waking", wake.phase, 0.0

    async def _note_interest_elsewhere(self, model: str, until: float, now: float) -> bool:
        """If another scheduler runs `model`'s wake (a live intent of someone else's), tell it
        requests still wait; True when there is such a wake."""
        gpus = await self._bus.gpus.get_all()
        keys = [key for key, entry in gpus.items()
                if any(i.model == model and i.owner != self._scheduler_id and i.expires_at > now
                       for i in entry.value.intents)]
        for key in keys:
            await cas_update(self._bus.gpus, key, functools.partial(
                gpu_state.note_interest, model=model, until=until, now=now))
        return bool(keys)

    # ------------------------------------------------------------------ the wake

    async def _run(self, wake: Wake, spec: ModelSpec) -> None:
        log.info("wake_started", model=wake.model, replicas=wake.num_replicas)
        try:
            outcome = await self._wake(wake, spec)
        except WakeCancelled as exc:
            outcome = "cancelled"
            await self._event("wake_cancelled", wake.model, str(exc))
        except Exception:
            outcome = "error"
            log.exception("wake_failed_unexpectedly", model=wake.model)
        finally:
            await self._drop_intents(wake)
            self._wakes.pop(wake.model, None)
        self._wakes_total.inc(model=wake.model, outcome=outcome)
        if outcome == "done":
            self._wake_seconds.observe(self._clock() - wake.started_at, model=wake.model)

    async def _wake(self, wake: Wake, spec: ModelSpec) -> str:
        """Returns "done" or "blocked" (ended); a block that keeps its place runs it again."""
        while True:
            outcome = await self._wake_once(wake, spec)
            if outcome == "done":
                return outcome
            held = await self._hold_place(wake, outcome)
            if held != "again":
                return held

    async def _wake_once(self, wake: Wake, spec: ModelSpec) -> Literal["done"] | NoVictim:
        target = await self._find_target(wake)
        if isinstance(target, Nowhere):
            await self._move_intents(wake, target.place)
            return target.why
        await self._move_intents(wake, target)
        await self._event("preemption_intent", wake.model,
                          f"{wake.model} needs memory on {', '.join(sorted(target))}",
                          data={"gpu_bytes": dict(sorted(target.items()))})
        # Fairness wait: claim as soon as it fits; preempt only once max_wait_s is over.
        while True:
            self._check_interest(wake)
            if await self._try_claim(wake):
                self._observe_fairness_wait(wake)
                return "done"
            step, wait_s = next_wake_step(fits=False, intent_since=wake.started_at,
                                          max_wait_s=spec.fairness.max_wait_s, now=self._clock(),
                                          voluntary_release_at=await self._voluntary_release_at(wake))
            if step == "preempt":
                break
            await asyncio.sleep(wait_s)
            await self._put_intents(wake)
        self._observe_fairness_wait(wake)
        while True:
            choice = await self._eligible_victims(wake)
            if not isinstance(choice, Victims):
                return choice
            wake.phase = "preempting"
            released = await self._claim_released(wake, choice)
            if released != "taken":
                return released
            # Their memory went to a waker ahead in line (another scheduler's, whose intent came
            # after this choice): choose again now rather than wait out the drain deadline.
            log.info("wake_memory_taken", model=wake.model, victims=list(choice.replica_ids))

    async def _eligible_victims(self, wake: Wake) -> Literal["done"] | Victims | NoVictim:
        """The victims fairness allows; "done" if the model got placed meanwhile."""
        while isinstance(choice := await self._choose_victims(wake), NoVictim):
            if not choice.num_skipped.get("not_serving"):
                return choice
            # A replica still loading holds the memory: once it serves, fairness decides about
            # it (or its memory comes back if it fails). Not a reason to turn requests away.
            self._check_interest(wake)
            if await self._try_claim(wake):
                return "done"
            await asyncio.sleep(RECHECK_INTERVAL_S)
            await self._put_intents(wake)
        return choice

    async def _claim_released(self, wake: Wake, victims: Victims) -> Literal["done", "taken"] | NoVictim:
        """Preempt `victims` and claim their memory once released: "done"; "taken" when they
        released it and it is still not free for this waker; NoVictim when they did not
        release it in time."""
        drain_s = await self._preempt(wake, victims)
        deadline = self._clock() + drain_s + RELEASE_MARGIN_S
        while self._clock() < deadline:
            self._check_interest(wake)
            if await self._try_claim(wake):
                return "done"
            if await self._released(wake, victims) and not (await self._look_at_place(wake)).fits:
                return "taken"
            await asyncio.sleep(POLL_S)
            await self._put_intents(wake)
        return NoVictim(f"the preempted replicas did not release their memory within "
                        f"{drain_s + RELEASE_MARGIN_S:.0f} s", retry_after_s=5.0)

    async def _released(self, wake: Wake, victims: Victims) -> bool:
        """Whether every victim left the wake's GPUs or sleeps there (holding its residue only)."""
        for key in wake.gpu_bytes:
            entry = await self._bus.gpus.get(key)
            if entry is None:
                raise WakeCancelled(f"GPU {key} is gone")
            if any(o.replica_id in victims.replica_ids and o.state != "sleeping" for o in entry.value.occupants):
                return False
        return True

    async def _hold_place(self, wake: Wake, why: NoVictim) -> Literal["again", "done", "blocked"]:
        """No eligible victim: requests get 503 with `why` until the block's end. When a victim
        becomes eligible soon (`fairness.keeps_place`), the wake keeps its intents (its place in
        line, by its first `since`) and runs "again" once the block is over and a request asks
        (`fairness.next_held_step`); memory that frees for it on those GPUs meanwhile it claims
        ("done": its clients' retries find a replica). "blocked": it ends here."""
        until = told_until = await self._block(wake, why)
        if not keeps_place(why) or not wake.gpu_bytes:
            return "blocked"
        wake.phase = "blocked"
        ahead: frozenset[str] | None = None  # the line seen at the last look
        while True:
            wake.asked.clear()
            now = self._clock()
            step = next_held_step(blocked_until=until, told_until=told_until, last_asked_at=wake.last_asked_at,
                                  now=now)
            if step == "resume":
                break
            if step == "give_up":
                raise WakeCancelled("no request asked for it again after its Retry-After")
            look = await self._look_at_place(wake)
            # Placed by a request's pass meanwhile (on other GPUs), or memory freed for the first in line.
            if await self._has_enough_replicas(wake) or (look.fits and await self._try_claim(wake)):
                self._observe_fairness_wait(wake)
                await self._store.update_model(wake.model, _unblocked)
                return "done"
            if ahead is not None and ahead - look.ahead and now < until:
                # A waker ahead in line claimed or gave up: the block it was part of may end sooner.
                until = await self._reconsider_block(wake, until)
            ahead = look.ahead
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(RECHECK_INTERVAL_S, until - now) if now < until else RECHECK_INTERVAL_S):
                    await wake.asked.wait()
            if self._clock() - wake.intents_put_at >= INTENT_TTL_S / 3:  # fewer CAS writes than a running wake's
                await self._put_intents(wake)
        wake.phase = "waiting"
        log.info("wake_resumed", model=wake.model, waiting_s=round(self._clock() - wake.started_at, 1))
        return "again"

    async def _look_at_place(self, wake: Wake) -> PlaceLook:
        """The wake's held GPUs: whether each has its bytes free for it (older intents first),
        and who is ahead of it in line there."""
        fits = True
        ahead: set[str] = set()
        for key, need in wake.gpu_bytes.items():
            entry = await self._bus.gpus.get(key)
            if entry is None:
                raise WakeCancelled(f"GPU {key} is gone")
            now = self._clock()
            fits = fits and _available_for(entry.value, wake.model, now) >= need
            own = next((i for i in entry.value.intents if i.model == wake.model), None)
            if own is not None:
                _note_interest(wake, own.interest_until)
            ahead |= records.get_wakers_ahead(entry.value, wake.model, now)
        return PlaceLook(fits, frozenset(ahead))

    async def _has_enough_replicas(self, wake: Wake) -> bool:
        if await self._store.get_model(wake.model) is None:
            raise WakeCancelled(f"{wake.model} was removed")
        entries = await self._bus.replicas.get_all(subjects.model_token(wake.model) + ".*")
        return sum(1 for e in entries.values() if e.value.is_active and e.value.level == "HOT") >= wake.num_replicas

    async def _reconsider_block(self, wake: Wake, until: float) -> float:
        """The block's end once the line ahead changed: now, if fair preemption could place the
        model now (its requests are not refused any more), or sooner if another victim becomes
        eligible sooner; else `until` unchanged."""
        target = await self._find_target(wake)
        now = self._clock()
        sooner = now if not isinstance(target, Nowhere) else (
            now + max(1.0, target.why.retry_after_s) if target.why.retry_after_s is not None else until)
        if sooner >= until:
            return until

        def shorten(current: ModelSpec | None) -> ModelSpec | None:
            if current is None or current.wake_blocked_until is None:
                return None
            return msgspec.structs.replace(current, wake_blocked_until=sooner)

        await self._store.update_model(wake.model, shorten)
        log.info("wake_block_shortened", model=wake.model, retry_after_s=round(sooner - now, 1))
        return sooner

    def _observe_fairness_wait(self, wake: Wake) -> None:
        if not wake.fairness_wait_observed:  # once per wake, not per run after a block
            wake.fairness_wait_observed = True
            self._fairness_wait.observe(self._clock() - wake.started_at, model=wake.model)

    def _check_interest(self, wake: Wake) -> None:
        if self._clock() > wake.interest_until:
            raise WakeCancelled("no request waits for it any more")

    async def _find_target(self, wake: Wake) -> dict[str, int] | Nowhere:
        """The memory the model needs, by GPU key: where the planner would place its missing
        replicas if it could preempt the replicas fairness allows. `Nowhere` when nowhere."""
        snapshot, plan = await self._passes.plan(self._ensure_op(wake, allow_evictions=True), claimant=wake.model)
        placements = [p for p in plan.placements if p.model == wake.model]
        if placements:
            need: dict[str, int] = {}
            for placement in placements:
                for index, num_bytes in placement.gpu_bytes.items():
                    key = subjects.gpu_kv_key(placement.node_id, index)
                    need[key] = need.get(key, 0) + num_bytes
            return need
        specs = [e.value for e in snapshot.models.values()]
        spec = next(s for s in specs if s.key == wake.model)  # the plan found it in this snapshot
        per_gpu_bytes = records.build_demand(spec, config=self._policy_config).figure.required_bytes // spec.num_gpus
        gpus = [e.value for e in snapshot.gpus.values() if e.value.node_id in snapshot.nodes]
        occupants = records.get_occupant_views(gpus, [e.value for e in snapshot.replicas.values()], specs,
                                               now=self._clock())
        return _explain_nowhere(wake.model, per_gpu_bytes, spec.num_gpus, occupants, gpus, self._clock())

    async def _voluntary_release_at(self, wake: Wake) -> float | None:
        snapshot = await self._store.snapshot()
        gpus = [e.value for key, e in snapshot.gpus.items() if key in wake.gpu_bytes]
        occupants = records.get_occupant_views(gpus, [e.value for e in snapshot.replicas.values()],
                                               [e.value for e in snapshot.models.values()], now=self._clock())
        return get_voluntary_release_at(occupants, wake.gpu_bytes)

    async def _choose_victims(self, wake: Wake) -> Victims | NoVictim:
        snapshot = await self._store.snapshot()
        now = self._clock()
        gpus = {key: entry.value for key, entry in snapshot.gpus.items() if key in wake.gpu_bytes}
        deficits = {key: need - _available_for(gpus[key], wake.model, now)
                    for key, need in wake.gpu_bytes.items() if key in gpus}
        occupants = records.get_occupant_views(gpus.values(), [e.value for e in snapshot.replicas.values()],
                                               [e.value for e in snapshot.models.values()], now=now)
        choice = select_victims(occupants, deficits, wake.model, now)
        if isinstance(choice, NoVictim) and any(records.get_pinned_bytes(gpu, wake.model, now)
                                                for gpu in gpus.values()):
            return behind_older_wakers(choice)
        return choice

    async def _preempt(self, wake: Wake, victims: Victims) -> float:
        """Send the victims to sleep (a pass); returns the longest drain timeout among them (or
        the default one, when the memory is already on its way back and nobody is preempted)."""
        specs = {e.value.key: e.value for e in (await self._bus.models.get_all()).values()}
        replicas = {e.value.replica_id: e.value for e in (await self._bus.replicas.get_all()).values()}
        chosen = [replicas[r] for r in victims.replica_ids if r in replicas]

        def operate(planner: ClusterPlanner, _: dict[str, ModelSpec]) -> None:
            for victim in chosen:
                victim_spec = specs.get(victim.model)
                cold = victim_spec is not None and victim_spec.sleep.level == "cold"
                planner.sleep_replica(victim.model, victim.replica_id, reason="preempted", park=True,
                                      drop_weights=cold)

        # The pass returns once the victims are parked or stopped (its node steps).
        self._background.spawn(self._passes.run(operate))
        for victim in chosen:
            self._preemptions.inc(model=victim.model)
            log.info("replica_preempted", model=victim.model, replica=victim.replica_id, waker=wake.model)
            await publish_event(self._bus.js, Event("replica_preempted", self._clock(),
                                                    f"preempted for {wake.model}", victim.model, victim.replica_id,
                                                    victim.node_id, data={"waker": wake.model}))
        return max((specs[v.model].sleep.drain_timeout_s for v in chosen if v.model in specs), default=30.0)

    async def _try_claim(self, wake: Wake) -> bool:
        """Under the wake lock of every target GPU: place what fits (its intents' memory is free
        for it). True when the model has all the replicas it wanted."""
        wake.phase = "claiming" if wake.phase == "preempting" else wake.phase
        taken = await self._take_locks(wake)
        if taken is None:
            return False
        try:
            renewing = asyncio.create_task(self._renew_locks(wake, taken))
            try:
                outcome = await self._passes.run(self._ensure_op(wake, allow_evictions=False), claimant=wake.model)
            finally:
                renewing.cancel()
        finally:
            await self._release_locks(wake, taken)
        placed = _is_placed(outcome, wake.model)
        if placed:
            log.info("wake_done", model=wake.model, seconds=round(self._clock() - wake.started_at, 3))
            await self._event("wake_done", wake.model, f"{wake.model} placed after "
                                                       f"{self._clock() - wake.started_at:.1f} s")
        return placed

    def _ensure_op(self, wake: Wake, *, allow_evictions: bool) -> Callable[[ClusterPlanner, dict[str, ModelSpec]],
                                                                             object]:
        def operate(planner: ClusterPlanner, specs: dict[str, ModelSpec]) -> None:
            current = specs.get(wake.model)
            if current is None:
                raise WakeCancelled(f"{wake.model} was removed")
            desired = max(current.desired_replicas, wake.num_replicas)
            planner.ensure(records.build_demand(current, config=self._policy_config, desired_replicas=desired),
                           allow_evictions=allow_evictions)

        return operate

    # ------------------------------------------------------------------ intents, locks, blocks

    async def _move_intents(self, wake: Wake, target: dict[str, int]) -> None:
        """Intents on `target` (the wake's first `since` kept); gone from GPUs no longer in it."""
        left = {key: num_bytes for key, num_bytes in wake.gpu_bytes.items() if key not in target}
        if left:
            await self._drop_intents(wake, left)
        wake.gpu_bytes = dict(target)
        await self._put_intents(wake)

    async def _put_intents(self, wake: Wake) -> None:
        now = self._clock()
        for key, num_bytes in sorted(wake.gpu_bytes.items()):
            intent = PreemptionIntent(model=wake.model, num_bytes=num_bytes, since=wake.started_at,
                                      owner=self._scheduler_id, expires_at=now + INTENT_TTL_S,
                                      interest_until=wake.interest_until)
            written = await cas_update(self._bus.gpus, key, functools.partial(gpu_state.put_intent, intent=intent,
                                                                             now=now))
            if written is not None:  # another scheduler a gateway asked may have noted interest there
                _note_interest(wake, _interest_on(written.value, wake.model))
        wake.intents_put_at = now

    async def _drop_intents(self, wake: Wake, keys: Iterable[str] | None = None) -> None:
        for key in sorted(wake.gpu_bytes if keys is None else keys):
            try:
                await cas_update(self._bus.gpus, key, functools.partial(gpu_state.drop_intent, model=wake.model,
                                                                        now=self._clock()))
            except Exception as exc:
                log.warning("intent_not_dropped", model=wake.model, gpu=key, error=str(exc))

    async def _take_locks(self, wake: Wake) -> list[str] | None:
        """The wake lock of every target GPU, in key order; None (and nothing held) when another
        waker holds one."""
        holder = f"{self._scheduler_id}/{wake.model}"
        taken: list[str] = []
        for key in sorted(wake.gpu_bytes):
            now = self._clock()
            written = await cas_update(self._bus.gpus, key, functools.partial(
                gpu_state.take_wake_lock, holder=holder, now=now, ttl_s=LOCK_TTL_S))
            if written is not None:
                current: GpuRecord | None = written.value
            else:
                entry = await self._bus.gpus.get(key)
                current = entry.value if entry is not None else None
            if not gpu_state.holds_wake_lock(current, holder, now):
                self._lock_conflicts.inc(scheduler=self._scheduler_id)
                log.info("wake_lock_busy", model=wake.model, gpu=key)
                await self._release_locks(wake, taken)
                return None
            taken.append(key)
        if taken:
            await self._event("wake_lock_taken", wake.model, f"wake lock on {', '.join(taken)}")
        return taken

    async def _renew_locks(self, wake: Wake, keys: list[str]) -> None:
        holder = f"{self._scheduler_id}/{wake.model}"
        while True:
            await sleep_or_stop(LOCK_TTL_S / 3)
            for key in keys:
                await cas_update(self._bus.gpus, key, functools.partial(
                    gpu_state.take_wake_lock, holder=holder, now=self._clock(), ttl_s=LOCK_TTL_S))

    async def _release_locks(self, wake: Wake, keys: list[str]) -> None:
        holder = f"{self._scheduler_id}/{wake.model}"
        for key in keys:
            await cas_update(self._bus.gpus, key, functools.partial(gpu_state.release_wake_lock, holder=holder,
                                                                    now=self._clock()))
        if keys:
            await self._event("wake_lock_released", wake.model, f"wake lock on {', '.join(keys)} released")

    async def _block(self, wake: Wake, why: NoVictim) -> float:
        """No eligible victim: requests for the model get 503 with `why` until a victim may be
        eligible (or `BLOCK_WITHOUT_RETRY_S`); returns that time."""
        retry_s = why.retry_after_s if why.retry_after_s is not None else BLOCK_WITHOUT_RETRY_S
        until = self._clock() + max(1.0, retry_s)
        log.warning("wake_blocked", model=wake.model, reason=why.reason, retry_after_s=round(retry_s, 1))

        def mutate(current: ModelSpec | None) -> ModelSpec | None:
            if current is None:
                return None
            return msgspec.structs.replace(current, wake_blocked_until=until, wake_blocked_reason=why.reason)

        await self._store.update_model(wake.model, mutate)
        await self._event("wake_failed", wake.model, why.reason,
                          data={"retry_after_s": retry_s, "place_kept": keeps_place(why) and bool(wake.gpu_bytes)})
        return until

    async def _event(self, kind: EventKind, model: str, message: str, *, data: dict[str, object] | None = None
                     ) -> None:
        await publish_event(self._bus.js, Event(kind, self._clock(), message, model, data=data or {}))


def _unblocked(current: ModelSpec | None) -> ModelSpec | None:
    if current is None or current.wake_blocked_until is None:
        return None
    return msgspec.structs.replace(current, wake_blocked_until=None, wake_blocked_reason=None)


def _note_interest(wake: Wake, noted_until: float) -> None:
    """Interest another scheduler noted on `wake`'s intent (a request it was asked for)."""
    if noted_until > wake.interest_until:
        wake.interest_until = noted_until
        wake.last_asked_at = max(wake.last_asked_at, noted_until - INTEREST_TTL_S)


def _interest_on(record: GpuRecord, model: str) -> float:
    return max((i.interest_until for i in record.intents if i.model == model), default=0.0)


def _available_for(record: GpuRecord, model: str, now: float) -> int:
    """Bytes of `record` `model`'s claim can count on: its total less what is held and what older
    wakers' intents keep (`records.get_pinned_bytes`), plus what draining replicas are giving
    back already (no need to preempt anyone for those)."""
    leaving = sum(o.num_bytes for o in record.occupants if o.state == "draining")
    return record.total_bytes - record.reserved_bytes + leaving - records.get_pinned_bytes(record, model, now)


def _is_placed(outcome: PassOutcome, model: str) -> bool:
    return outcome.committed and not any(u.model == model for u in outcome.plan.unplaced)


@dataclass(frozen=True)
class PlaceLook:
    """What a held wake sees on its GPUs (`WakeCoordinator._look_at_place`)."""

    fits: bool
    ahead: frozenset[str]
    """The models whose intents are older than its own there."""


@dataclass(frozen=True)
class Nowhere:
    """No GPU can take the model even by fair preemption (`why`); `place` is the memory it
    keeps its place in line for meanwhile (on the GPU whose block clears soonest), if any."""

    why: NoVictim
    place: dict[str, int] = field(default_factory=dict)


def _explain_nowhere(model: str, needed_bytes: int, num_gpus: int, occupants: Iterable[OccupantView],
                     gpus: Iterable[GpuRecord], now: float) -> Nowhere:
    """Why no GPU can take `model` (`needed_bytes` on each of `num_gpus` GPUs) even with fair
    preemption: each GPU's own reason, the one that clears soonest first. A model on one GPU
    keeps its place on that GPU (a model spanning GPUs keeps none: which GPUs is the planner's
    choice once victims are eligible)."""
    views = list(occupants)
    reasons: list[tuple[NoVictim, str]] = []
    for gpu in gpus:
        if gpu.total_bytes < needed_bytes:
            continue
        key = subjects.gpu_kv_key(gpu.node_id, gpu.index)
        choice = select_victims(views, {key: needed_bytes - _available_for(gpu, model, now)}, model, now)
        if isinstance(choice, NoVictim):
            reasons.append((behind_older_wakers(choice) if records.get_pinned_bytes(gpu, model, now) else choice, key))
    if not reasons:
        return Nowhere(NoVictim(f"no GPU is large enough for {model} ({needed_bytes} bytes), even by preempting",
                                retry_after_s=None))
    best, key = min(reasons, key=lambda r: (r[0].retry_after_s is None, r[0].retry_after_s or 0.0, r[1]))
    place = {key: needed_bytes} if num_gpus == 1 and best.retry_after_s is not None else {}
    return Nowhere(NoVictim(best.reason, best.retry_after_s, best.num_skipped), place)
