"""Waking a model short of GPU memory, as the scheduler's wake coordinator does it
(`services/scheduler/wakes.py`), step by step on the simulated clock.

    a request finds no replica of its model on its way                      ensure
      claim: place what fits without evicting (a pass)  ──placed──▶ loading
      │ not all placed
    target: where the planner would put it with the evictions fairness allows (a pass,
            not committed)  ──nowhere──▶ blocked: the waiting requests fail (503) for
                                         max(1 s, the first victim's remaining minimum runtime)
    intents on the target GPUs (first come, first served)
    fairness wait: every second until max_wait_s, claim if anything was released; only
                   while an occupant of the target sleeps by itself within it
                   (`get_voluntary_release_at`), else preempt at once     `next_wake_step`
    victims: `select_victims` on the target GPUs (the seed baseline: the planner's own
             evictions)  ──none, only because a replica there is still loading──▶ re-check
             every second  ──none──▶ blocked, as above
             (the lru baseline's target: the GPU whose victims were used least recently)
    a pass puts them to sleep (`sleep_replica`, reason preempted); they drain and park or stop
    claim every 0.5 s until placed, or blocked after the victims' drain timeout + 60 s

A claim retried while nothing was released since the last one is known to fail (free
memory only shrinks in between) and is skipped, without a pass; everything else is a
real placement pass over the state of the moment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from shoal.shared.placement.fairness import (
    RECHECK_INTERVAL_S,
    NoVictim,
    OccupantView,
    Victims,
    get_voluntary_release_at,
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
    phase: Literal["waiting", "preempting"] = "waiting"
    need_by_slot: dict[int, int] = field(default_factory=dict)
    """GPU bytes it needs, by cluster-wide GPU number (where its intents are)."""
    planner_victims: tuple[str, ...] = ()
    """The evictions the target pass named (victims of the seed baseline)."""
    claim_epoch: int = -1
    """`Simulator.memory_epoch` at the last claim that failed."""
    deadline: float = 0.0
    """When its victims must have released their memory (drain timeout + `RELEASE_MARGIN_S`)."""
    release_within_s: float = 0.0


class WakeCoordinator:
    """Runs the simulated scheduler's wakes (see the module doc)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim

    # ------------------------------------------------------------------ entry

    def ensure(self, model: SimModel) -> None:
        """A request waits for `model`, which has no replica on its way."""
        sim = self.sim
        if model.waking or model.num_active:
            return
        if sim.now < model.blocked_until:
            sim.fail_queue(model, model.blocked_reason)
            return
        num_replicas = max(model.desired, 1)
        if self._claim(model, num_replicas):
            return
        if sim.policy.victims == "none":
            self._block(model, None, NoVictim("no GPU is free for it (one model per GPU)", None), "unplaceable")
            return
        wake = Wake(model, num_replicas, started_at=sim.now)
        model.waking = True
        sim.metrics.counters["wakes"] += 1
        sim.log("wake", model.key)
        target = self._find_target(wake)
        if isinstance(target, NoVictim):
            self._block(model, wake, target, "no_victim")
            return
        wake.need_by_slot = target
        sim.state.put_intents(model.key, target, wake.started_at)
        if self._try_claim(wake):  # its own intents now pin less for it than before
            return
        self._next(wake)

    def step(self, wake: Wake) -> None:
        """A wake's scheduled next step."""
        sim = self.sim
        if wake.phase == "preempting" and sim.now >= wake.deadline:
            why = NoVictim(f"the preempted replicas did not release their memory within "
                           f"{wake.release_within_s:.0f} s", retry_after_s=5.0)
            self._block(wake.model, wake, why, "no_victim")
            return
        if self._try_claim(wake):
            return
        if wake.phase == "preempting":
            sim.push(sim.now + POLL_S, WAKE, wake)
        else:
            self._next(wake)

    # ------------------------------------------------------------------ steps

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
            sim.push(sim.now + wait_s, WAKE, wake)
            return
        choice = self._choose_victims(wake)
        if isinstance(choice, NoVictim):
            if choice.num_skipped.get("not_serving"):
                # A replica still loading holds the memory: once it serves, fairness decides
                # about it (as the scheduler's wake, which re-checks every second).
                sim.push(sim.now + RECHECK_INTERVAL_S, WAKE, wake)
                return
            self._block(wake.model, wake, choice, "no_victim")
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
            sim.push(sim.now + POLL_S, WAKE, wake)

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

    def _find_target(self, wake: Wake) -> dict[int, int] | NoVictim:
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

    def _find_lru_target(self, model: SimModel) -> dict[int, int] | NoVictim | None:
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
        return select_victims(occupants, deficits, key, now)

    def _explain_nowhere(self, model: SimModel) -> NoVictim:
        """Why no GPU can take one replica even with fair preemption: each GPU's reason, the one
        that clears soonest first (as the scheduler's `_explain_nowhere`)."""
        state, now = self.sim.state, self.sim.now
        per_gpu_bytes = model.demand.figure.required_bytes // max(1, model.group.num_gpus)
        reasons: list[NoVictim] = []
        for slot, gpu in enumerate(state.gpus):
            if gpu.total_bytes < per_gpu_bytes:
                continue
            deficit = {gpu.key: per_gpu_bytes - state.get_available_bytes(slot, model.key, now)}
            choice = select_victims(state.get_occupant_views((slot,), now), deficit, model.key, now)
            if isinstance(choice, NoVictim):
                reasons.append(choice)
        if not reasons:
            return NoVictim(f"no GPU can hold {model.key}, even by preempting", retry_after_s=None)
        return min(reasons, key=lambda r: (r.retry_after_s is None, r.retry_after_s or 0.0))

    def _block(self, model: SimModel, wake: Wake | None, why: NoVictim, reason: str) -> None:
        """Requests for `model` fail until a victim may be eligible (or for a while)."""
        sim = self.sim
        retry_s = why.retry_after_s if why.retry_after_s is not None else BLOCK_WITHOUT_RETRY_S
        model.blocked_until = sim.now + max(1.0, retry_s)
        model.blocked_reason = reason
        sim.metrics.counters[f"blocked_{reason}"] += 1
        sim.log("blocked", model.key, why.reason)
        if wake is not None:
            self._end(wake)
        sim.fail_queue(model, reason)

    def _end(self, wake: Wake) -> None:
        sim = self.sim
        wake.model.waking = False
        if wake.need_by_slot:
            sim.state.drop_intents(wake.model.key, wake.need_by_slot)
            sim.memory_epoch += 1  # what its intents kept is free for other claims again
