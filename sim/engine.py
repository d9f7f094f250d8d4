"""The discrete-event loop: requests arrive, replicas serve them, the policy is asked when
something must be placed, preempted or put to sleep.

    arrivals (the trace, read in order)   merged with   a heap of (time, seq, kind, a, b)

    request for a model with a serving replica that has room   dispatch: O(replicas of the model)
    ... none has room                                            the model's FIFO queue
    ... no replica on its way                                    wakes.ensure: placement passes
    ... its model blocked (no victim yet)                        refused (503), or kept waiting
                                                                 (timing.capacity_wait_s): ENSURE again
    DONE       a request finishes: KV and slot back; the queue's head goes next
    READY      a replica finished loading: it serves its model's queue
    DRAINED    (no event: when its last request ends) a leaving replica parks or stops
    RELEASED   its GPU memory is free: WARM in CPU RAM, or gone
    IDLE       a reconciler round finds replicas idle (`fairness.is_idle`): one sleep pass
    REFILL     a reconciler round places models short of replicas where they fit (Shoal)
    WAKE       a wake's next step (fairness wait, victims, claim; a held place's checks)
    ENSURE     the gateway asks again for a model's waiting requests

A request is served by its replica's engine: prefills one after another (first token =
start + prompt x prefill time), then decodes for (output - 1) x decode time; it holds
prompt + output tokens of the replica's KV pool until it ends. Replicas that share a
GPU slow each other (`timing.interference`). Nothing here knows the trace's future: the
policy passes see the state the events so far made (`ClusterState.build_snapshot`).

Speed: the common request (its model resident, room on a replica) costs one dispatch
and one heap push/pop; placement passes run only for wakes, sleeps and refills.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shoal.shared.placement.fairness import is_idle
from shoal.shared.placement.plan import PlacementPlan
from shoal.shared.placement.planner import ClusterPlanner, order_demands
from shoal.shared.placement.snapshot import ModelDemand
from shoal.sim.metrics import Metrics, RunResult
from shoal.sim.policies import Policy
from shoal.sim.scenario import Scenario
from shoal.sim.state import (
    DONE,
    DRAIN_TIMEOUT,
    DRAINING,
    ENSURE,
    IDLE,
    LOADING,
    READY,
    REFILL,
    RELEASED,
    RELEASING,
    SAMPLE,
    SERVING,
    WAKE,
    WARM,
    ClusterState,
    QueuedRequest,
    SimModel,
    SimReplica,
)
from shoal.sim.traces import Trace
from shoal.sim.wakes import WakeCoordinator

WAITED_OUT_REASONS = frozenset({"no_victim"})
"""Refusals that clear by themselves (a victim's minimum runtime ends), which the gateway's
capacity wait lets a request wait out (its `WAITED_OUT_STATUSES`)."""
_CHUNK = 1 << 16
"""Requests read from the trace's arrays per batch (as Python lists: no numpy scalars)."""
NUM_SAMPLES = 480
"""Timeline samples over the trace's duration."""


@dataclass(frozen=True)
class LoggedEvent:
    """A decision or a state change, for tests and debugging (`Simulator(record_events=True)`)."""

    time_s: float
    kind: str
    model: str
    detail: str = ""


class Simulator:
    """One policy on one cluster over one trace. `run()` once."""

    def __init__(self, scenario: Scenario, trace: Trace, policy: Policy, *, record_events: bool = False,
                 keep_place: bool | None = None) -> None:
        """Args:
        keep_place: a wake blocked until a victim becomes eligible keeps its place in line
            (`WakeCoordinator`); False: it ends, as before the scheduler kept places. None:
            the policy's (`Policy.keeps_places`: Shoal's only).
        """
        cluster, timing = scenario.cluster, scenario.timing
        self.scenario = scenario
        self.trace = trace
        self.policy = policy
        self.timing = timing
        self.config = cluster.placement
        self.state = ClusterState(cluster.get_gpus_by_node(), cluster.gpu_memory_bytes,
                                  int(cluster.cpu_ram_bytes * self.config.warm_cache_fraction),
                                  parked_process_bytes=self.config.parked_process_bytes)
        self.rng = random.Random(scenario.seed)
        self.now = 0.0
        self.heap: list[tuple[Any, ...]] = []
        self._seq = itertools.count()
        self.memory_epoch = 0
        """Counts every change that can let a claim succeed that failed before (memory released,
        an intent dropped): a claim retried with nothing changed is known to fail again."""
        self.events: list[LoggedEvent] | None = [] if record_events else None
        self.metrics = Metrics(len(trace), cluster.total_gpus, cluster.total_gpus * cluster.gpu_memory_bytes,
                               trace.duration_s)
        groups = {key: group for group in scenario.models for key in group.model_keys()}
        self.models: list[SimModel] = []
        for index, key in enumerate(trace.model_keys):
            group = groups[key]
            params_b = group.params_b
            self.models.append(SimModel(
                index=index, key=key, group=group, fairness=policy.get_fairness(group),
                idle_timeout_s=policy.get_idle_timeout_s(group), parks=policy.parks(group),
                drops_weights=policy.drops_weights(group),
                demand=policy.build_demand(key, group, self.config, cluster.gpu_memory_bytes, 0),
                kv_capacity=group.kv_cache_tokens, max_num_seqs=timing.max_num_seqs,
                prefill_s_per_token=timing.prefill_s_per_token_per_b * params_b,
                decode_s_per_token=timing.decode_s_per_token_per_b * params_b,
                desired=policy.get_desired_replicas(group)))
        self.model_by_key = {model.key: model for model in self.models}
        self.desired = {model.key: model.desired for model in self.models}
        self.wakes = WakeCoordinator(self, keep_place=policy.keeps_places if keep_place is None else keep_place)
        self.capacity_wait_s = min(timing.capacity_wait_s, timing.request_timeout_s)
        """How long after its arrival a refused request may still ask again (the gateway's
        ``give_up_at``: its capacity wait, within its deadline)."""
        self._idle_ticks: dict[float, list[SimReplica]] = {}
        self._short: set[str] = set()
        self._refill_at: float | None = None
        self._refill_epoch = -1
        self._starting = False
        self.snapshot_s = 0.0
        self.policy_s = 0.0
        self.num_passes = 0

    # ------------------------------------------------------------------ running

    def run(self) -> RunResult:
        started = time.perf_counter()
        self._place_at_start()
        trace, heap, handle = self.trace, self.heap, self._handle
        heappop = heapq.heappop
        interval = trace.duration_s / NUM_SAMPLES
        for number in range(NUM_SAMPLES + 1):
            self.push(number * interval, SAMPLE)
        on_arrival = self._on_arrival
        for first in range(0, len(trace), _CHUNK):
            last = first + _CHUNK
            times = trace.time_s[first:last].tolist()
            models = trace.model[first:last].tolist()
            prompts = trace.prompt_tokens[first:last].tolist()
            outputs = trace.output_tokens[first:last].tolist()
            for offset, arrival in enumerate(times):
                while heap and heap[0][0] <= arrival:
                    handle(heappop(heap))
                self.now = arrival
                on_arrival(first + offset, arrival, self.models[models[offset]], prompts[offset], outputs[offset])
        end = trace.duration_s + self.timing.request_timeout_s
        while heap and heap[0][0] <= end:
            handle(heappop(heap))
        self.now = max(self.now, end)
        for model in self.models:
            for request, _, _, _ in model.queue:
                self.metrics.fail(request, "unserved")
            if model.starved_since is not None:
                self.metrics.waits_s.append(self.now - model.starved_since)
        tail_models = np.array([not m.group.fairness.popular for m in self.models], dtype=bool)
        result = self.metrics.summarize(self.policy.name, trace.model, tail_models, self.scenario.slo)
        return replace(result, wall_s=time.perf_counter() - started, snapshot_s=self.snapshot_s,
                       policy_s=self.policy_s, num_passes=self.num_passes)

    def push(self, when: float, kind: int, a: object = None, b: object = None) -> None:
        heapq.heappush(self.heap, (when, next(self._seq), kind, a, b))

    def log(self, kind: str, model: str, detail: str = "") -> None:
        if self.events is not None:
            self.events.append(LoggedEvent(self.now, kind, model, detail))

    def _handle(self, event: tuple[Any, ...]) -> None:
        when, _, kind, a, b = event
        self.now = when
        if kind == DONE:
            self._on_done(a, b)
        elif kind == READY:
            self._on_ready(a)
        elif kind == RELEASED:
            self._on_released(a)
        elif kind == DRAIN_TIMEOUT:
            self._on_drain_timeout(a)
        elif kind == IDLE:
            self._on_idle_tick(when)
        elif kind == REFILL:
            self._on_refill_tick()
        elif kind == WAKE:
            self.wakes.step(a, b)
        elif kind == ENSURE:
            if a.queue and not a.num_active:
                self.wakes.ensure(a)
        elif kind == SAMPLE and when <= self.trace.duration_s:
            self.metrics.sample(when)

    # ------------------------------------------------------------------ requests

    def _on_arrival(self, request: int, now: float, model: SimModel, prompt: int, output: int) -> None:
        entry = (request, now, prompt, output)
        if model.serving and not model.queue:
            replica = _pick(model, prompt + output)
            if replica is not None:
                self._dispatch(replica, entry, now)
                return
        if not model.num_active and now < model.blocked_until:
            self._on_refused_arrival(model, entry)
            return
        model.queue.append(entry)
        if not model.serving:
            if model.starved_since is None:
                model.starved_since = now
            if not model.num_loading:
                self.wakes.ensure(model)

    def _on_refused_arrival(self, model: SimModel, entry: QueuedRequest) -> None:
        """A request for a blocked model: it fails at once, or (capacity wait) waits in the
        queue to ask again when the block ends."""
        if not self._may_wait_out(model, entry):
            self.metrics.fail(entry[0], model.blocked_reason)
            return
        model.queue.append(entry)
        if model.starved_since is None:
            model.starved_since = self.now
        self._ask_again_when_unblocked(model)

    def _dispatch(self, replica: SimReplica, entry: QueuedRequest, now: float) -> None:
        request, arrival, prompt, output = entry
        kv_tokens = prompt + output
        if kv_tokens > replica.kv_capacity:
            kv_tokens = replica.kv_capacity
        factor = 1.0
        interference = self.timing.interference
        gpus = self.state.gpus
        share = replica.compute_share
        if not replica.running:
            for slot in replica.slots:
                gpus[slot].busy_share += share
        if interference:
            busiest = max(gpus[slot].busy_share for slot in replica.slots)
            factor += interference * (busiest - share) / share
        start = replica.prefill_free_at if replica.prefill_free_at > now else now
        first_token = start + prompt * replica.prefill_s_per_token * factor
        replica.prefill_free_at = first_token
        done = first_token + (output - 1) * replica.decode_s_per_token * factor
        if request in self.metrics.requeued:
            self.metrics.requeued.discard(request)
        else:
            self.metrics.ttft[request] = first_token - arrival
        replica.kv_free -= kv_tokens
        replica.running[request] = entry
        replica.last_access = now
        heapq.heappush(self.heap, (done, next(self._seq), DONE, replica, request))

    def _on_done(self, replica: SimReplica, request: int) -> None:
        entry = replica.running.pop(request, None)
        if entry is None:
            return  # handed back to the queue by a drain that timed out
        kv_tokens = entry[2] + entry[3]
        replica.kv_free += kv_tokens if kv_tokens < replica.kv_capacity else replica.kv_capacity
        now = self.now
        replica.last_access = now
        if not replica.running:
            gpus = self.state.gpus
            for slot in replica.slots:
                gpus[slot].busy_share -= replica.compute_share
            if replica.state == DRAINING:
                self._drained(replica)
                return
            if replica.model.idle_timeout_s and replica.idle_check_at is None:
                self._schedule_idle_check(replica, now)
        if replica.state == SERVING and replica.model.queue:
            self._serve_queue(replica.model)

    def _serve_queue(self, model: SimModel) -> None:
        """Dispatch the queue's head while a replica has room for it (FIFO)."""
        queue, now = model.queue, self.now
        timeout_s = self.timing.request_timeout_s
        while queue:
            entry = queue[0]
            if now - entry[1] > timeout_s:
                queue.popleft()
                self.metrics.fail(entry[0], "timeout")
                continue
            replica = _pick(model, entry[2] + entry[3])
            if replica is None:
                return
            queue.popleft()
            self._dispatch(replica, entry, now)

    def refuse_queue(self, model: SimModel) -> None:
        """The scheduler refuses to place `model` until its `blocked_until`: a waiting request
        that may wait that out (`_may_wait_out`) asks again then, the others fail (a 503 with
        the block's reason). The model's wait ends when none is left waiting."""
        queue = model.queue
        for _ in range(len(queue)):  # once round the queue, in place: the waiting keep their order
            entry = queue.popleft()
            if self._may_wait_out(model, entry):
                queue.append(entry)
            else:
                self.metrics.fail(entry[0], model.blocked_reason)
        if queue:
            self._ask_again_when_unblocked(model)
        elif model.starved_since is not None:
            self.metrics.waits_s.append(self.now - model.starved_since)
            model.starved_since = None

    def _may_wait_out(self, model: SimModel, entry: QueuedRequest) -> bool:
        """Whether a request refused now waits for the block to end, as the gateway's
        `ensure_placed` decides: a refusal that clears by itself, whose Retry-After comes
        within the request's capacity wait (`timing.capacity_wait_s`) from its arrival."""
        return model.blocked_reason in WAITED_OUT_REASONS and model.blocked_until <= entry[1] + self.capacity_wait_s

    def _ask_again_when_unblocked(self, model: SimModel) -> None:
        if model.asks_again_at != model.blocked_until:
            model.asks_again_at = model.blocked_until
            self.push(model.blocked_until, ENSURE, model)

    # ------------------------------------------------------------------ passes

    def run_pass(self, operate: Callable[[ClusterPlanner], object], *, claimant: str | None = None,
                 full_nodes: Collection[int] | None = None, listed_models: Collection[str] = (),
                 commit: bool = True) -> PlacementPlan | None:
        """One placement pass: snapshot, planner, `operate`; its plan committed and returned, or
        (`commit=False`: a look at where things would go once leaving replicas are gone, as the
        scheduler's `PlacementPasses.plan`) nothing."""
        started = time.perf_counter()
        now = self.now
        snapshot = self.state.build_snapshot(now, self.desired, claimant=claimant, full_nodes=full_nodes,
                                             listed_models=listed_models, leaving_is_free=not commit)
        built = time.perf_counter()
        planner = ClusterPlanner(snapshot, config=self.config, rng=self.rng, clock=lambda: now)
        operate(planner)
        plan = planner.finish() if commit else None
        self.snapshot_s += built - started
        self.policy_s += time.perf_counter() - built
        self.num_passes += 1
        if plan is not None:
            self.commit(plan)
        return plan

    def get_demand(self, model: SimModel, desired_replicas: int) -> ModelDemand:
        """The model as the planner sees it, wanting `desired_replicas` HOT replicas."""
        demand = model.demands.get(desired_replicas)
        if demand is None:
            demand = model.demands[desired_replicas] = replace(model.demand, desired_replicas=desired_replicas)
        return demand

    def _place_at_start(self) -> None:
        """The cluster as if it had been running: the desired replicas that fit, serving."""
        demands = [self.get_demand(m, m.desired) for m in self.models if m.desired > 0]

        def operate(planner: ClusterPlanner) -> None:
            for demand in order_demands(demands):
                planner.ensure(demand, allow_evictions=False)

        self._starting = True
        self.run_pass(operate)
        self._starting = False
        for replica in list(self.state.replicas.values()):
            self._on_ready(replica)
            replica.serving_since = -1e9  # serving for long: past any minimum runtime
        if self.policy.refill:  # what did not fit comes when room does, as the reconciler's refills
            for model in self.models:
                if model.num_active < model.desired:
                    self._note_short(model)

    def commit(self, plan: PlacementPlan) -> None:
        """Carry out a plan: evictions first (victims drain), then placements (replicas load)."""
        state = self.state
        for eviction in plan.evictions:
            replica = state.replicas[eviction.replica_id]
            if eviction.from_level == "HOT":
                self._leave(replica, warm=eviction.to_level == "WARM", drop_weights=eviction.drop_weights,
                            reason=eviction.reason)
            else:
                state.remove_replica(replica)
                self.log("dropped", replica.model.key, eviction.reason)
        for placement in plan.placements:
            model = self.model_by_key[placement.model]
            node = state.pos_by_node_id[placement.node_id]
            gpu_bytes = dict(placement.gpu_bytes)
            slots = state.get_slots(node, gpu_bytes)
            if placement.from_level == "WARM":
                replica = state.replicas[placement.replica_id]
                assert replica.state == WARM and replica.node == node, "a restore is of a WARM replica there"
                reload = replica.weights_dropped
                replica.load(gpu_bytes, slots)
                load_s = (self.timing.get_reload_s if reload else self.timing.get_restore_s)(
                    replica.cpu_bytes, len(slots))
            else:
                replica = SimReplica(placement.replica_id, model, node, gpu_bytes, slots, placement.cpu_bytes)
                state.add_replica(replica)
                load_s = self.timing.get_create_s(placement.cpu_bytes)
            state.hold(replica)
            self._account(replica, +1)
            model.num_loading += 1
            if self._starting:
                continue  # serving from the start (`_place_at_start`)
            counter = "loads_from_disk" if placement.from_level != "WARM" else \
                "reloads_in_place" if reload else "loads_from_cpu"
            self.metrics.counters[counter] += 1
            self.log("load", model.key, f"{placement.from_level} {placement.node_id} {sorted(gpu_bytes)}")
            self.push(self.now + self.timing.scheduler_latency_s + load_s, READY, replica)
        for key, desired in plan.desired_replicas.items():
            self.desired[key] = desired
            self.model_by_key[key].desired = desired

    def _account(self, replica: SimReplica, sign: int) -> None:
        """Memory and occupancy figures for a replica starting (+1, after `hold`) or ending (-1,
        after `release`) its hold on GPU memory."""
        metrics, gpus = self.metrics, self.state.gpus
        model = replica.model
        metrics.change_memory(self.now, sign * sum(replica.gpu_bytes.values()), sign * model.group.measured_bytes)
        for slot in replica.slots:
            gpu = gpus[slot]
            holders = len(gpu.hot_ids) + len(gpu.leaving_ids)
            if (sign > 0 and holders == 1) or (sign < 0 and holders == 0):
                metrics.num_occupied_gpus += sign
        model.num_holding += sign
        if (sign > 0 and model.num_holding == 1) or (sign < 0 and model.num_holding == 0):
            metrics.num_resident_models += sign

    # ------------------------------------------------------------------ replica life

    def _on_ready(self, replica: SimReplica) -> None:
        if replica.state != LOADING:
            return
        model = replica.model
        replica.state = SERVING
        replica.serving_since = replica.last_access = self.now
        model.num_loading -= 1
        model.serving.append(replica)
        self.log("ready", model.key, replica.replica_id[:8])
        if model.starved_since is not None:
            self.metrics.waits_s.append(self.now - model.starved_since)
            model.starved_since = None
        if model.queue:
            self._serve_queue(model)
        if not replica.running and model.idle_timeout_s and replica.idle_check_at is None:
            self._schedule_idle_check(replica, self.now)

    def _leave(self, replica: SimReplica, *, warm: bool, drop_weights: bool, reason: str) -> None:
        """A HOT replica is evicted: it takes no new request, drains, then parks (with its
        weights, or without them: `drop_weights`, a cold sleep) or stops."""
        model = replica.model
        assert replica.state == SERVING, f"only serving replicas are evicted, not {replica.state}"
        model.serving.remove(replica)
        replica.state = DRAINING
        replica.leaves_warm = warm
        replica.weights_dropped = warm and drop_weights
        self.state.start_leaving(replica)
        self.metrics.counters[f"evicted_{reason}"] += 1
        self.log("evict", model.key, f"{reason} to {'WARM' if warm else 'COLD'}"
                 f"{' (weights dropped)' if replica.weights_dropped else ''}")
        if not replica.running:
            self._drained(replica)
        else:
            self.push(self.now + model.group.sleep.drain_timeout_s, DRAIN_TIMEOUT, replica)
        if model.queue and not model.num_active:
            self.push(self.now, ENSURE, model)  # the gateway asks again for its waiting requests
        if reason in ("preempted", "pressure") and self.policy.refill:
            self._note_short(model)

    def _on_drain_timeout(self, replica: SimReplica) -> None:
        """Requests still running when the drain timeout ends go back to the queue."""
        if replica.state != DRAINING or not replica.running:
            return
        model = replica.model
        for request, entry in sorted(replica.running.items(), key=lambda item: item[1][1], reverse=True):
            model.queue.appendleft(entry)
            self.metrics.requeued.add(request)
            self.metrics.counters["requeued"] += 1
        replica.running.clear()
        replica.kv_free = replica.kv_capacity
        for slot in replica.slots:
            self.state.gpus[slot].busy_share -= replica.compute_share
        self._drained(replica)
        if model.serving:
            self._serve_queue(model)
        elif not model.num_active:
            if model.starved_since is None:
                model.starved_since = self.now
            self.push(self.now, ENSURE, model)

    def _drained(self, replica: SimReplica) -> None:
        replica.state = RELEASING
        sleep_s = self.timing.get_sleep_s(replica.cpu_bytes, len(replica.slots), park=replica.leaves_warm,
                                          drop_weights=replica.weights_dropped)
        self.push(self.now + sleep_s, RELEASED, replica)

    def _on_released(self, replica: SimReplica) -> None:
        state = self.state
        state.release(replica)
        self._account(replica, -1)
        model = replica.model
        if replica.leaves_warm:
            replica.state = WARM
            replica.gpu_bytes, replica.slots = {}, ()
        else:
            state.remove_replica(replica)
        self.log("released", model.key, "WARM" if replica.leaves_warm else "COLD")
        self.memory_epoch += 1

    # ------------------------------------------------------------------ reconciler

    def _schedule_idle_check(self, replica: SimReplica, last_access: float) -> None:
        """Check at the first reconciler round when the replica may have been idle long enough
        (at most one check pending per replica: a busy replica is looked at once per timeout)."""
        interval = self.timing.reconcile_interval_s
        tick = -(-(max(last_access, replica.serving_since) + replica.model.idle_timeout_s) // interval) * interval
        replica.idle_check_at = tick
        pending = self._idle_ticks.get(tick)
        if pending is None:
            self._idle_ticks[tick] = [replica]
            self.push(tick, IDLE)
        else:
            pending.append(replica)

    def _on_idle_tick(self, tick: float) -> None:
        idle: list[SimReplica] = []
        for replica in self._idle_ticks.pop(tick, []):
            replica.idle_check_at = None
            if replica.state != SERVING or replica.running:
                continue  # busy: checked again when its last request ends
            last_accessed = max(replica.last_access, replica.serving_since)
            if is_idle(last_accessed=last_accessed, num_in_flight=len(replica.running),
                       idle_timeout_s=replica.model.idle_timeout_s, now=tick):
                idle.append(replica)
            else:
                self._schedule_idle_check(replica, last_accessed)
        if not idle:
            return

        def operate(planner: ClusterPlanner) -> None:
            for replica in idle:
                planner.sleep_replica(replica.model.key, replica.replica_id, reason="idle",
                                      park=replica.model.parks, drop_weights=replica.model.drops_weights)

        self.run_pass(operate, full_nodes={replica.node for replica in idle})

    def _note_short(self, model: SimModel) -> None:
        self._short.add(model.key)
        if self._refill_at is None:
            interval = self.timing.reconcile_interval_s
            self._refill_at = (self.now // interval + 1) * interval
            self.push(self._refill_at, REFILL)

    def _on_refill_tick(self) -> None:
        """Models short of their desired replicas (preempted or evicted ones) come back where
        they fit without evicting (`ensure(..., allow_evictions=False)`), as the reconciler does."""
        self._refill_at = None
        now = self.now
        short = [self.model_by_key[key] for key in sorted(self._short)]
        short = [m for m in short if m.num_active < m.desired and not m.waking and now >= m.blocked_until]
        self._short = {m.key for m in short}
        if not short:
            return
        if self.memory_epoch != self._refill_epoch:
            self._refill_epoch = self.memory_epoch

            def operate(planner: ClusterPlanner) -> None:
                for model in short:
                    planner.ensure(self.get_demand(model, model.desired), allow_evictions=False)

            self.run_pass(operate, full_nodes=(), listed_models={m.key for m in short})
        for model in short:
            if model.num_active < model.desired:
                self._note_short(model)


def _pick(model: SimModel, kv_tokens: int) -> SimReplica | None:
    """The serving replica with the most free KV that can take a request of `kv_tokens`."""
    best: SimReplica | None = None
    best_free = -1
    for replica in model.serving:
        free = replica.kv_free
        need = kv_tokens if kv_tokens < replica.kv_capacity else replica.kv_capacity
        if free >= need and free > best_free and len(replica.running) < replica.max_num_seqs:
            best, best_free = replica, free
    return best

