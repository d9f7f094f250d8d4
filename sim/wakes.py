"""Waking a model short of GPU memory, as the scheduler's wake coordinator does it
(`services/scheduler/wakes.py`), step by step on the simulated clock.

    a request finds no replica of its model on its way                      ensure
      claim: place what fits without evicting (a pass)  ──placed──▶ loading
      │ not all placed
    target: where the planner would put it with the evictions fairness allows (a pass,
            not committed)  ──nowhere──▶ blocked (below); held on the GPU whose reason
                                         clears soonest, for a model of one GPU
    intents on the target GPUs (first come, first served)
    fairness wait: every second until max_wait_s, claim if anything was released; only
                   while an occupant of the target sleeps by itself within it
                   (`get_voluntary_release_at`), else preempt at once     `next_wake_step`
    victims: `select_victims` on the target GPUs (the seed baseline: the planner's own
             evictions)  ──none, only because a replica there is still loading──▶ re-check
             every second  ──none──▶ blocked, as below
             (the lru baseline's target: the GPU whose victims were used least recently)
    a pass puts them to sleep (`sleep_replica`, reason preempted); they drain and park or stop
    claim every 0.5 s until placed, or blocked after the victims' drain timeout + 60 s

    blocked: requests for the model are refused (503, or kept waiting by the gateway's
    capacity wait) until max(1 s, the first victim's remaining minimum runtime), 5 s at
    most behind older wakers' intents (`behind_older_wakers`)
      │ that time is known and within a minute (`keeps_place`), and the wake has a target
      │ (`keep_place`: Shoal's policy)
    held: its intents stay, as old as the wake (its place in line); every second, when
          anything was released and its place has room for it, it claims
      │ a request asks from blocked_until on (a new one, or one waiting out the block;
      │ one refused during the block took its 503 and is no interest)
      ▶ runs again from the target, as old as it was: its fairness wait is long over
      │ none by blocked_until + PLACE_KEPT_S
      ▶ ends: its intents go
    (otherwise the wake ends at the block; the next request starts a new, younger one)

A claim retried while nothing was released since the last one is known to fail (free
memory only shrinks in between) and is skipped, without a pass; everything else is a
real placement pass over the state of the moment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from shoal.shared.placement.fairness import (
    PLACE_KEPT_S,
    RECHECK_INTERVAL_S,
    NoVictim,
    OccupantView,
    Victims,
    behind_older_wakers,
    get_pinned_intent_bytes,
    get_voluntary_release_at,
    keeps_place,
    next_held_step,
    next_wake_step,
    select_victims,
)
from shoal.shared.placement.node_eval import get_single_gpu_allocation
from shoal.shared.placement.planner import ClusterPlanner
from shoal.shared.placement.snapshot import CandidateLevel
from shoal.sim.state import SERVING, WAKE, SimModel

if TYPE_CHECKING:
    from shoal.sim.engine import Simulator

POLL_S = 0.5
"""How often a wake whose victims are draining tries to claim (as the scheduler's)."""
RELEASE_MARGIN_S = 60.0
"""Victims release their memory within their drain timeout plus this, or the wake gives up."""
BLOCK_WITHOUT_RETRY_S = 30.0
"""How long a model with no eligible victim and no time one becomes eligible answers 503."""
DEFAULT_DRAIN_S = 30.0


@dataclass(eq=False)
class Wake:
    """One model's wake in progress."""

    model: SimModel
    num_replicas: int
    started_at: float
    """Also its intents' age: its place in line among wakers, kept while it is held."""
    phase: Literal["waiting", "preempting", "held"] = "waiting"
    need_by_slot: dict[int, int] = field(default_factory=dict)
    """GPU bytes it needs, by cluster-wide GPU number (where its intents are)."""
    planner_victims: tuple[str, ...] = ()
    """The evictions the target pass named (victims of the seed baseline)."""
    claim_epoch: int = -1
    """`Simulator.memory_epoch` at the last claim that failed."""
    deadline: float = 0.0
    """When its victims must have released their memory (drain timeout + `RELEASE_MARGIN_S`)."""
    release_within_s: float = 0.0
    num_steps: int = 0
    """Steps scheduled so far: only the latest one runs (a held wake that a request resumes, or
    a wake that ends, leaves its pending step behind)."""


@dataclass(frozen=True, slots=True)
class Nowhere:
    """No GPU can take the model now, even with the preemptions fairness allows."""

    why: NoVictim
    place_by_slot: dict[int, int]
    """Where the wake may hold its place while blocked: one replica's bytes on the GPU whose
    reason clears soonest, for a model of one GPU; empty otherwise."""


class WakeCoordinator:
    """Runs the simulated scheduler's wakes (see the module doc)."""

    def __init__(self, sim: Simulator, *, keep_place: bool = True) -> None:
        """Args:
        keep_place: a wake blocked until a victim becomes eligible keeps its place in line
            (its intents, as old as the wake) and runs again when the block ends, as the
            scheduler's does; False: it ends, and the model's next request starts a new wake,
            younger than every waker that asked meanwhile (the behaviour before).
        """
        self.sim = sim
        self.keep_place = keep_place
        self.held: dict[str, Wake] = {}
        """Wakes holding their place while their model is blocked, by model key."""

    # ------------------------------------------------------------------ entry

    def ensure(self, model: SimModel) -> None:
        """A request waits for `model`, which has no replica on its way."""
        sim = self.sim
        if model.num_active:
            return
        held = self.held.get(model.key)
        if held is not None:
            self._ask_held(held)
            return
        if model.waking:
            return
        if sim.now < model.blocked_until:
            sim.refuse_queue(model)
            return
        num_replicas = max(model.desired, 1)
        if self._claim(model, num_replicas):
            return
        if sim.policy.victims == "none":
            self._mark_blocked(model, NoVictim("no GPU is free for it (one model per GPU)", None), "unplaceable")
            sim.refuse_queue(model)
            return
        wake = Wake(model, num_replicas, started_at=sim.now)
        model.waking = True
        sim.metrics.counters["wakes"] += 1
        sim.log("wake", model.key)
        self._run_from_target(wake)

    def step(self, wake: Wake, number: int) -> None:
        """A wake's scheduled step `number` (only its latest one runs)."""
        sim = self.sim
        if number != wake.num_steps:
            return
        if wake.phase == "held":
            self._step_held(wake)
            return
        if wake.phase == "preempting" and sim.now >= wake.deadline:
            why = NoVictim(f"the preempted replicas did not release their memory within "
                           f"{wake.release_within_s:.0f} s", retry_after_s=5.0)
            self._block(wake, why, wake.need_by_slot)
            return
        if self._try_claim(wake):
            return
        if wake.phase == "preempting":
            self._schedule(wake, sim.now + POLL_S)
        else:
            self._next(wake)

    # ------------------------------------------------------------------ steps

    def _run_from_target(self, wake: Wake) -> None:
        """Target, intents there, a claim, then the fairness wait."""
        target = self._find_target(wake)
        if isinstance(target, Nowhere):
            self._block(wake, target.why, target.place_by_slot)
            return
        self._place_intents(wake, target)
        if self._try_claim(wake):  # its own intents now pin less for it than before
            return
        self._next(wake)

    def _next(self, wake: Wake) -> None:
        """During the fairness wait: wait (re-check within a second) or preempt now."""
        sim = self.sim
        state = sim.state
        occupants = state.get_occupant_views(wake.need_by_slot, sim.now)
        release_at = get_voluntary_release_at(occupants, {state.gpus[slot].key for slot in wake.need_by_slot})
        step, wait_s = next_wake_step(fits=False, intent_since=wake.started_at,
                                      max_wait_s=wake.model.fairness.max_wait_s, now=sim.now,
                                      voluntary_release_at=release_at)
        if step == "wait":
            self._schedule(wake, sim.now + wait_s)
            return
        choice = self._choose_victims(wake)
        if isinstance(choice, NoVictim):
            if choice.num_skipped.get("not_serving"):
                # A replica still loading holds the memory: once it serves, fairness decides
                # about it (as the scheduler's wake, which re-checks every second).
                self._schedule(wake, sim.now + RECHECK_INTERVAL_S)
                return
            self._block(wake, choice, wake.need_by_slot)
            return
        wake.phase = "preempting"
        victims = [state.replicas[r] for r in choice.replica_ids
                   if r in state.replicas and state.replicas[r].state == SERVING]
        if victims:
            def operate(planner: ClusterPlanner) -> None:
                for victim in victims:
                    planner.sleep_replica(victim.model.key, victim.replica_id, reason="preempted",
                                          park=victim.model.parks, drop_weights=victim.model.drops_weights)

            sim.log("preempt", wake.model.key, " ".join(sorted(v.model.key for v in victims)))
            sim.run_pass(operate, full_nodes={victim.node for victim in victims})
        drain_s = max((v.model.group.sleep.drain_timeout_s for v in victims), default=DEFAULT_DRAIN_S)
        wake.release_within_s = drain_s + RELEASE_MARGIN_S
        wake.deadline = sim.now + wake.release_within_s
        if not self._try_claim(wake):
            self._schedule(wake, sim.now + POLL_S)

    def _step_held(self, wake: Wake) -> None:
        """A held wake's check (`next_held_step`): run again once the block is over if requests
        wait it out, end when nobody asked in time, else claim if its place has room for it."""
        sim, model = self.sim, wake.model
        now, blocked_until = sim.now, model.blocked_until
        step = next_held_step(blocked_until=blocked_until, last_asked_at=now if model.queue else float("-inf"),
                              now=now)
        if step == "resume":
            self._resume(wake)
            return
        if step == "give_up":
            sim.metrics.counters["places_lapsed"] += 1
            sim.log("lapsed", model.key)
            self._end(wake)
            return
        if self._fits_place(wake) and self._try_claim(wake):
            model.blocked_until = now  # placed: its requests are not refused any more
            return
        lapses_at = blocked_until + PLACE_KEPT_S
        self._schedule(wake, min(now + RECHECK_INTERVAL_S, blocked_until if now < blocked_until else lapses_at))

    def _fits_place(self, wake: Wake) -> bool:
        """Whether every GPU of the held place has the wake's bytes free for it (older intents
        first): the scheduler's look before a held wake's claim."""
        state, now, key = self.sim.state, self.sim.now, wake.model.key
        return all(state.get_available_bytes(slot, key, now) >= need for slot, need in wake.need_by_slot.items())

    def _ask_held(self, wake: Wake) -> None:
        """A request asks for a model whose wake holds its place: refused while the block lasts
        (no interest: it takes its 503, or waits the block out); after it, the wake runs again
        at once."""
        if self.sim.now < wake.model.blocked_until:
            self.sim.refuse_queue(wake.model)
        else:
            self._resume(wake)

    def _resume(self, wake: Wake) -> None:
        """The block is over and the model still wanted: the wake runs again from its target,
        as old as it was (so its fairness wait is usually over: it preempts at once)."""
        del self.held[wake.model.key]
        wake.phase = "waiting"
        self.sim.log("resumed", wake.model.key)
        self._run_from_target(wake)

    def _claim(self, model: SimModel, num_replicas: int) -> bool:
        """A pass placing what fits without evicting; True when nothing of `model` is left unplaced."""
        sim = self.sim
        demand = sim.get_demand(model, max(model.desired, num_replicas))
        plan = sim.run_pass(lambda planner: planner.ensure(demand, allow_evictions=False),
                            claimant=model.key, full_nodes=(), listed_models={model.key})
        assert plan is not None, "a committed pass has a plan"
        return not any(u.model == model.key for u in plan.unplaced)

    def _try_claim(self, wake: Wake) -> bool:
        sim = self.sim
        if sim.memory_epoch == wake.claim_epoch:
            return False  # nothing was released since the last claim failed
        wake.claim_epoch = sim.memory_epoch
        if not self._claim(wake.model, wake.num_replicas):
            return False
        self._end(wake)
        sim.log("claimed", wake.model.key, f"after {sim.now - wake.started_at:.3f} s")
        return True

    def _find_target(self, wake: Wake) -> dict[int, int] | Nowhere:
        """The GPUs the planner would place the model on if it could evict what fairness lets it."""
        sim = self.sim
        model = wake.model
        if sim.policy.victims == "lru" and wake.num_replicas == 1:
            target = self._find_lru_target(model)
            if target is not None:
                return target
        demand = sim.get_demand(model, max(model.desired, wake.num_replicas))
        offers = []
        sim.run_pass(lambda planner: offers.extend(planner.ensure(demand, allow_evictions=True)),
                     claimant=model.key, commit=False)
        need: dict[int, int] = {}
        victims: list[str] = []
        state = sim.state
        for offer in offers:
            if offer.level in (CandidateLevel.DEPLOYED, CandidateLevel.CANT_ACCOMMODATE):
                continue
            node = state.pos_by_node_id[offer.node_id]
            for slot, num_bytes in zip(state.get_slots(node, offer.gpu_bytes), offer.gpu_bytes.values(),
                                       strict=True):
                need[slot] = need.get(slot, 0) + num_bytes
            victims.extend(offer.eviction_ids)
        if need:
            wake.planner_victims = tuple(victims)
            return need
        return self._explain_nowhere(model)

    def _find_lru_target(self, model: SimModel) -> dict[int, int] | Nowhere | None:
        """The lru baseline's target for one single-GPU replica: the GPU where the replicas to
        evict (`select_victims`: least recently used first) were used least recently; then
        fewer victims, then best fit. None for a model that needs several GPUs."""
        sim = self.sim
        state, now, key = sim.state, sim.now, model.key
        shape = get_single_gpu_allocation(model.demand, state.gpus[0].total_bytes, sim.config)
        if shape is None:
            return None
        alloc_bytes = shape[1]
        views: dict[str, list[OccupantView]] = {}
        for view in state.get_occupant_views(range(len(state.gpus)), now):
            views.setdefault(view.gpu_key, []).append(view)
        best: tuple[float, int, int, int] | None = None
        for slot, gpu in enumerate(state.gpus):
            deficit = alloc_bytes - state.get_available_bytes(slot, key, now)
            choice = select_victims(views.get(gpu.key, ()), {gpu.key: deficit}, key, now)
            if isinstance(choice, NoVictim):
                continue
            newest = max((v.last_accessed for v in views.get(gpu.key, ()) if v.replica_id in choice.replica_ids),
                         default=float("-inf"))
            room_bytes = sum(choice.freed_bytes_by_gpu.values()) - deficit
            candidate = (newest, len(choice.replica_ids), room_bytes, slot)
            if best is None or candidate < best:
                best = candidate
        if best is None:
            return self._explain_nowhere(model)
        return {best[3]: alloc_bytes}

    def _choose_victims(self, wake: Wake) -> Victims | NoVictim:
        sim = self.sim
        if sim.policy.victims == "planner":
            return Victims(wake.planner_victims)
        state, now, key = sim.state, sim.now, wake.model.key
        deficits = {state.gpus[slot].key: need - state.get_available_bytes(slot, key, now)
                    for slot, need in wake.need_by_slot.items()}
        occupants = state.get_occupant_views(wake.need_by_slot, now)
        choice = select_victims(occupants, deficits, key, now)
        if isinstance(choice, NoVictim) and self.keep_place and any(
                get_pinned_intent_bytes(state.gpus[slot].intents, key, now) for slot in wake.need_by_slot):
            return behind_older_wakers(choice)
        return choice

    def _explain_nowhere(self, model: SimModel) -> Nowhere:
        """Why no GPU can take one replica even with fair preemption: each GPU's reason, the one
        that clears soonest first (as the scheduler's `_explain_nowhere`), and that GPU."""
        state, now = self.sim.state, self.sim.now
        per_gpu_bytes = model.demand.figure.required_bytes // max(1, model.group.num_gpus)
        reasons: list[tuple[NoVictim, int]] = []
        for slot, gpu in enumerate(state.gpus):
            if gpu.total_bytes < per_gpu_bytes:
                continue
            deficit = {gpu.key: per_gpu_bytes - state.get_available_bytes(slot, model.key, now)}
            choice = select_victims(state.get_occupant_views((slot,), now), deficit, model.key, now)
            if isinstance(choice, NoVictim):
                behind = self.keep_place and get_pinned_intent_bytes(gpu.intents, model.key, now) > 0
                reasons.append((behind_older_wakers(choice) if behind else choice, slot))
        if not reasons:
            return Nowhere(NoVictim(f"no GPU can hold {model.key}, even by preempting", retry_after_s=None), {})
        why, slot = min(reasons, key=lambda r: (r[0].retry_after_s is None, r[0].retry_after_s or 0.0))
        return Nowhere(why, {slot: per_gpu_bytes} if model.group.num_gpus == 1 else {})

    # ------------------------------------------------------------------ intents, blocks, the end

    def _place_intents(self, wake: Wake, need_by_slot: dict[int, int]) -> None:
        """The wake's intents on `need_by_slot`, as old as the wake (its place in line); those on
        GPUs it no longer needs go."""
        sim, key = self.sim, wake.model.key
        left = [slot for slot in wake.need_by_slot if slot not in need_by_slot]
        if left:
            sim.state.drop_intents(key, left)
        if any(need_by_slot.get(slot, 0) < num_bytes for slot, num_bytes in wake.need_by_slot.items()):
            sim.memory_epoch += 1  # what they kept is free for other claims again
        wake.need_by_slot = need_by_slot
        sim.state.put_intents(key, need_by_slot, wake.started_at)

    def _block(self, wake: Wake, why: NoVictim, place_by_slot: dict[int, int]) -> None:
        """No eligible victim: the model is blocked (`_mark_blocked`); its wake holds its place on
        `place_by_slot` meanwhile (`keep_place`, when a victim becomes eligible at a known time)
        or ends; its waiting requests are refused."""
        model = wake.model
        self._mark_blocked(model, why, "no_victim")
        if self.keep_place and keeps_place(why) and place_by_slot:
            self._hold(wake, place_by_slot)
        else:
            self._end(wake)
        self.sim.refuse_queue(model)

    def _mark_blocked(self, model: SimModel, why: NoVictim, reason: str) -> None:
        """Requests for `model` are refused until a victim may be eligible (or for a while)."""
        sim = self.sim
        retry_s = why.retry_after_s if why.retry_after_s is not None else BLOCK_WITHOUT_RETRY_S
        model.blocked_until = sim.now + max(1.0, retry_s)
        model.blocked_reason = reason
        sim.metrics.counters[f"blocked_{reason}"] += 1
        sim.log("blocked", model.key, why.reason)

    def _hold(self, wake: Wake, place_by_slot: dict[int, int]) -> None:
        sim = self.sim
        wake.phase = "held"
        self._place_intents(wake, place_by_slot)
        self.held[wake.model.key] = wake
        sim.metrics.counters["places_kept"] += 1
        sim.log("held", wake.model.key, " ".join(sim.state.gpus[slot].key for slot in sorted(place_by_slot)))
        self._schedule(wake, min(sim.now + RECHECK_INTERVAL_S, wake.model.blocked_until))

    def _schedule(self, wake: Wake, when: float) -> None:
        wake.num_steps += 1
        self.sim.push(when, WAKE, wake, wake.num_steps)

    def _end(self, wake: Wake) -> None:
        sim = self.sim
        wake.num_steps += 1  # a step still pending does not run
        wake.model.waking = False
        self.held.pop(wake.model.key, None)
        if wake.need_by_slot:
            sim.state.drop_intents(wake.model.key, wake.need_by_slot)
            sim.memory_epoch += 1  # what its intents kept is free for other claims again
