"""The simulated cluster: GPUs, replicas, models, and the policy's view of them.

What the real scheduler reads from its KV buckets, the simulator keeps in memory, and
builds the same policy inputs from (`services/scheduler/records.py` does it from records):

    SimGpu        one GPU (numbered across the cluster: a "slot"): total bytes; bytes held by HOT replicas (loading, serving) and by leaving
                  ones (draining, parking or stopping: pinned, nothing evicts them); intents
    SimReplica    LOADING -> SERVING -> DRAINING -> RELEASING -> WARM (parked) or gone (COLD)
    SimModel      its replicas, its request queue, its wake, its desired count

    build_snapshot(now, claimant, full_nodes)  ->  ClusterSnapshot     (placement's input)
    get_occupant_views(gpu_slots, now)         ->  [OccupantView]      (fairness's input)
    get_available_bytes(slot, claimant, now)   ->  bytes a claim can count on

The snapshot reads like `records.build_snapshot`'s: a HOT replica is protected when
`fairness.is_protected` says so (popular, not serving yet, inside its minimum runtime);
a WARM one when its model is popular, and one parked by a cold sleep (weights dropped) holds
``parked_process_bytes`` of its node's CPU cache, not its weights (records' ``weights_dropped``);
leaving replicas and other wakers' intents (`fairness.get_pinned_intent_bytes`, first come
first served) are pinned bytes; a replica's last access is now while it runs a request.

A node outside `full_nodes` is given with only the claimant's replicas and everything
else as pinned bytes: a pass that may not evict (a claim, a refill) decides the same on
it, since it only reads free bytes there, and the model's own replicas
(tests/unit/test_sim_snapshot.py checks the two against each other).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from shoal.shared.model_settings import FairnessSettings
from shoal.shared.placement.fairness import IntentView, OccupantView, get_pinned_intent_bytes, is_protected
from shoal.shared.placement.snapshot import ClusterSnapshot, ModelDemand, NodeSnapshot, ReplicaSnapshot
from shoal.sim.scenario import ModelGroup

LOADING, SERVING, DRAINING, RELEASING, WARM = range(5)
"""A replica's states."""
DONE, READY, RELEASED, DRAIN_TIMEOUT, IDLE, REFILL, WAKE, ENSURE, SAMPLE = range(9)
"""The kinds of event on the simulator's heap (sim/engine.py)."""
QueuedRequest = tuple[int, float, int, int]
"""(request index, arrival time, prompt tokens, output tokens)."""


class SimReplica:
    """One replica: where it is, what it holds, what it runs."""

    __slots__ = (
        "compute_share", "cpu_bytes", "decode_s_per_token", "gpu_bytes", "idle_check_at", "kv_capacity", "kv_free",
        "last_access", "leaves_warm",
        "max_num_seqs", "model", "node", "prefill_free_at", "prefill_s_per_token", "replica_id", "running",
        "serving_since", "slots", "state", "weights_dropped",
    )

    def __init__(self, replica_id: str, model: SimModel, node: int, gpu_bytes: dict[int, int],
                 slots: tuple[int, ...], cpu_bytes: int) -> None:
        self.replica_id = replica_id
        self.model = model
        self.node = node
        self.gpu_bytes: dict[int, int] = {}
        """Bytes per GPU index of its node (empty while WARM)."""
        self.slots: tuple[int, ...] = ()
        """Cluster-wide GPU numbers of `gpu_bytes` (node x GPUs per node + index)."""
        self.cpu_bytes = cpu_bytes
        self.running: dict[int, QueuedRequest] = {}
        self.kv_capacity = model.kv_capacity
        self.max_num_seqs = model.max_num_seqs
        self.last_access = 0.0
        self.leaves_warm = False
        self.weights_dropped = False
        """Leaving to, or parked WARM after, a cold sleep: its process stays, its weights are
        dropped (charged ``parked_process_bytes`` of its node's CPU cache; reloaded on wake)."""
        self.idle_check_at: float | None = None
        """The reconciler round that will look at it, if one is scheduled."""
        self.load(gpu_bytes, slots)

    def load(self, gpu_bytes: dict[int, int], slots: tuple[int, ...]) -> None:
        """(Re)start on these GPUs: LOADING, nothing running, an empty KV pool."""
        assert not self.running, f"replica {self.replica_id} loads with requests running"
        self.gpu_bytes = gpu_bytes
        self.slots = slots
        self.state = LOADING
        self.weights_dropped = False
        self.kv_capacity = get_kv_capacity(self.model, sum(gpu_bytes.values()))
        self.kv_free = self.kv_capacity
        num_gpus = max(1, len(slots))
        self.prefill_s_per_token = self.model.prefill_s_per_token / num_gpus
        self.decode_s_per_token = self.model.decode_s_per_token / num_gpus
        self.compute_share = max(1, round(self.model.group.params_b * 1000 / num_gpus))
        """Millions of parameters it runs on each of its GPUs: its share of a GPU's time when
        replicas take turns on it (`SimGpu.busy_share`)."""
        self.prefill_free_at = 0.0
        self.serving_since = 0.0


def get_kv_capacity(model: SimModel, reserved_bytes: int) -> int:
    """KV tokens a replica holding `reserved_bytes` gets: its model's budget, or less when the
    policy reserved less than the model's measured memory (the seed's 3x guess can): the
    engine sizes its KV pool to the memory it is given, so the pool shrinks in proportion."""
    group = model.group
    if reserved_bytes >= group.measured_bytes:
        return model.kv_capacity
    kv_bytes = group.measured_bytes - group.raw_weight_bytes
    room_bytes = reserved_bytes - group.raw_weight_bytes
    if kv_bytes <= 0 or room_bytes <= 0:
        return 1
    return max(1, int(model.kv_capacity * room_bytes / kv_bytes))


@dataclass(eq=False)
class SimModel:
    """One model of the catalog, under one policy."""

    index: int
    key: str
    group: ModelGroup
    fairness: FairnessSettings
    idle_timeout_s: float
    parks: bool
    """A replica going to sleep parks (WARM, where CPU RAM allows) or stops (`Policy.parks`)."""
    drops_weights: bool
    """... parked with its weights dropped: a cold sleep (`Policy.drops_weights`)."""
    demand: ModelDemand
    """The planner's view (`Simulator.get_demand` fills in the desired count)."""
    kv_capacity: int
    max_num_seqs: int
    prefill_s_per_token: float
    decode_s_per_token: float
    desired: int = 0
    serving: list[SimReplica] = field(default_factory=list)
    num_loading: int = 0
    num_holding: int = 0
    """Replicas holding GPU memory (loading, serving or leaving)."""
    queue: deque[QueuedRequest] = field(default_factory=deque)
    waking: bool = False
    blocked_until: float = -1.0
    blocked_reason: str = "no_victim"
    asks_again_at: float = -1.0
    """When the gateway asks again for requests waiting out a block (an ENSURE is pending then)."""
    demands: dict[int, ModelDemand] = field(default_factory=dict)
    """`demand` by desired count, made once each."""
    starved_since: float | None = None
    """Since when requests wait with no replica serving (the model's current wait)."""

    @property
    def num_active(self) -> int:
        return len(self.serving) + self.num_loading


@dataclass(eq=False)
class SimGpu:
    node: int
    index: int
    key: str
    total_bytes: int
    hot_bytes: int = 0
    leaving_bytes: int = 0
    hot_ids: set[str] = field(default_factory=set)
    leaving_ids: set[str] = field(default_factory=set)
    intents: list[IntentView] = field(default_factory=list)
    busy_share: int = 0
    """Sum of `SimReplica.compute_share` of its replicas running at least one request: they take
    turns on the GPU, each step as long as its weights take to read."""


class ClusterState:
    """GPUs, nodes' CPU RAM and every replica, with the conversions to the policy's types."""

    def __init__(self, gpus_by_node: Sequence[int], gpu_bytes: int, cpu_cache_bytes: int, *,
                 parked_process_bytes: int = 0) -> None:
        """Args:
        gpus_by_node: how many GPUs each node has.
        gpu_bytes: each GPU's memory.
        cpu_cache_bytes: each node's CPU RAM for parked (WARM) replicas.
        parked_process_bytes: what a WARM replica with its weights dropped holds of it
            (``placement.parked_process_bytes``).
        """
        num_nodes = len(gpus_by_node)
        self.num_nodes = num_nodes
        self.node_ids = tuple(f"node-{pos:04d}" for pos in range(num_nodes))
        self.pos_by_node_id = {node_id: pos for pos, node_id in enumerate(self.node_ids)}
        self.first_slot = [sum(gpus_by_node[:pos]) for pos in range(num_nodes)]
        """Cluster-wide number of each node's GPU 0."""
        self.gpus = [SimGpu(pos, index, f"{self.node_ids[pos]}.{index}", gpu_bytes)
                     for pos in range(num_nodes) for index in range(gpus_by_node[pos])]
        totals = {count: dict.fromkeys(range(count), gpu_bytes) for count in set(gpus_by_node)}
        self.gpu_totals = [totals[count] for count in gpus_by_node]
        """Per node: GPU index -> total bytes."""
        self.cpu_cache_bytes = cpu_cache_bytes
        self.parked_process_bytes = parked_process_bytes
        self.replicas: dict[str, SimReplica] = {}
        """Every replica that is not COLD."""
        self.replica_ids_by_node: list[set[str]] = [set() for _ in range(num_nodes)]
        self.models_by_node: list[dict[str, int]] = [{} for _ in range(num_nodes)]
        """Per node: model key -> its replicas there (any state)."""
        self.slot_by_key = {gpu.key: slot for slot, gpu in enumerate(self.gpus)}
        self._node_versions = [0] * num_nodes
        """Per node: bumped whenever bytes held on one of its GPUs change."""
        self._light_nodes: list[tuple[int, bool, NodeSnapshot] | None] = [None] * num_nodes
        """Per node: its last light snapshot with no replica listed and no intent, and what it
        was built from (version, leaving_is_free): reused while they still hold."""

    def get_slots(self, node: int, gpu_bytes: Iterable[int]) -> tuple[int, ...]:
        first = self.first_slot[node]
        return tuple(first + index for index in gpu_bytes)

    # ------------------------------------------------------------------ the policy's view

    def build_snapshot(self, now: float, desired: dict[str, int], *, claimant: str | None = None,
                       full_nodes: Collection[int] | None = None, listed_models: Collection[str] = (),
                       leaving_is_free: bool = False) -> ClusterSnapshot:
        """The cluster as placement sees it (see the module doc).

        Args:
            claimant: the model a waking pass places: intents older than its own (and others'
                when it has none) keep their bytes from it.
            full_nodes: nodes given with every replica; None: all of them.
            listed_models: the models whose replicas the other nodes list (the ones the pass
                places); everything else there is pinned bytes.
            leaving_is_free: count what leaving replicas hold as free (where a wake could go
                once they are released; never for a pass that commits).
        """
        nodes = []
        gpus = self.gpus
        for pos, node_id in enumerate(self.node_ids):
            full = full_nodes is None or pos in full_nodes
            if not full:
                first, num_gpus = self.first_slot[pos], len(self.gpu_totals[pos])
                models_here = self.models_by_node[pos]
                if not any(gpus[slot].intents for slot in range(first, first + num_gpus)) and not any(
                        key in models_here for key in listed_models):
                    nodes.append(self._get_light_node(pos, leaving_is_free))
                    continue
            pinned: dict[int, int] = {}
            first = self.first_slot[pos]
            for index in range(len(self.gpu_totals[pos])):
                gpu = self.gpus[first + index]
                num_bytes = 0 if leaving_is_free else gpu.leaving_bytes
                if not full:
                    num_bytes += gpu.hot_bytes
                if gpu.intents:
                    num_bytes += get_pinned_intent_bytes(gpu.intents, claimant, now)
                if num_bytes:
                    pinned[index] = num_bytes
            replicas = []
            for replica_id in sorted(self.replica_ids_by_node[pos]):
                replica = self.replicas[replica_id]
                if replica.state in (DRAINING, RELEASING):
                    continue
                if not full:
                    if replica.model.key not in listed_models:
                        continue
                    if replica.state != WARM:
                        for index, num_bytes in replica.gpu_bytes.items():
                            pinned[index] -= num_bytes
                replicas.append(self._replica_snapshot(replica, now))
            nodes.append(NodeSnapshot(node_id, self.gpu_totals[pos], self.cpu_cache_bytes, tuple(replicas),
                                      {i: b for i, b in pinned.items() if b}))
        return ClusterSnapshot(tuple(nodes), desired)

    def _get_light_node(self, pos: int, leaving_is_free: bool) -> NodeSnapshot:
        """A node with nothing listed: its GPUs' held bytes, all pinned (cached per version)."""
        version = self._node_versions[pos]
        cached = self._light_nodes[pos]
        if cached is not None and cached[0] == version and cached[1] == leaving_is_free:
            return cached[2]
        first = self.first_slot[pos]
        pinned = {}
        for index in range(len(self.gpu_totals[pos])):
            gpu = self.gpus[first + index]
            num_bytes = gpu.hot_bytes + (0 if leaving_is_free else gpu.leaving_bytes)
            if num_bytes:
                pinned[index] = num_bytes
        node = NodeSnapshot(self.node_ids[pos], self.gpu_totals[pos], self.cpu_cache_bytes, (), pinned)
        self._light_nodes[pos] = (version, leaving_is_free, node)
        return node

    def _replica_snapshot(self, replica: SimReplica, now: float) -> ReplicaSnapshot:
        fairness = replica.model.fairness
        if replica.state == WARM:
            return ReplicaSnapshot(replica.replica_id, replica.model.key, "WARM", {}, replica.cpu_bytes,
                                   fairness.popular, replica.last_access,
                                   parked_bytes=self.parked_process_bytes if replica.weights_dropped else None)
        protected = is_protected(fairness, serving=replica.state == SERVING, serving_since=replica.serving_since,
                                 now=now)
        return ReplicaSnapshot(replica.replica_id, replica.model.key, "HOT", replica.gpu_bytes, replica.cpu_bytes,
                               protected, now if replica.running else replica.last_access)

    def get_occupant_views(self, slots: Iterable[int], now: float) -> list[OccupantView]:
        """Every occupant of these GPUs as fair preemption sees it (`records.get_occupant_views`)."""
        views = []
        for slot in slots:
            gpu = self.gpus[slot]
            for replica_id in sorted(gpu.hot_ids | gpu.leaving_ids):
                replica = self.replicas[replica_id]
                views.append(OccupantView(
                    replica_id=replica_id,
                    model=replica.model.key,
                    gpu_key=gpu.key,
                    num_bytes=replica.gpu_bytes[gpu.index],
                    serving=replica.state == SERVING,
                    serving_since=replica.serving_since,
                    last_accessed=now if replica.running else replica.last_access,
                    fairness=replica.model.fairness,
                    idle_timeout_s=replica.model.idle_timeout_s,
                ))
        return views

    def get_available_bytes(self, slot: int, claimant: str, now: float) -> int:
        """Bytes of a GPU a claim by `claimant` can count on: free, plus what leaving replicas
        are giving back, less what older wakers' intents keep (wakes._available_for)."""
        gpu = self.gpus[slot]
        pinned = get_pinned_intent_bytes(gpu.intents, claimant, now) if gpu.intents else 0
        return gpu.total_bytes - gpu.hot_bytes - pinned

    # ------------------------------------------------------------------ intents

    def put_intents(self, model: str, need_by_slot: dict[int, int], since: float) -> None:
        for slot, num_bytes in need_by_slot.items():
            intents = self.gpus[slot].intents
            intents[:] = [i for i in intents if i.model != model]
            intents.append(IntentView(model, num_bytes, since, float("inf")))

    def drop_intents(self, model: str, slots: Iterable[int]) -> None:
        for slot in slots:
            intents = self.gpus[slot].intents
            intents[:] = [i for i in intents if i.model != model]

    # ------------------------------------------------------------------ changes

    def add_replica(self, replica: SimReplica) -> None:
        assert replica.replica_id not in self.replicas, f"replica {replica.replica_id} exists already"
        self.replicas[replica.replica_id] = replica
        self.replica_ids_by_node[replica.node].add(replica.replica_id)
        models = self.models_by_node[replica.node]
        models[replica.model.key] = models.get(replica.model.key, 0) + 1

    def remove_replica(self, replica: SimReplica) -> None:
        del self.replicas[replica.replica_id]
        self.replica_ids_by_node[replica.node].discard(replica.replica_id)
        models = self.models_by_node[replica.node]
        models[replica.model.key] -= 1
        if not models[replica.model.key]:
            del models[replica.model.key]

    def hold(self, replica: SimReplica) -> None:
        """A new or restored replica reserves its GPU bytes (HOT)."""
        self._node_versions[replica.node] += 1
        for slot, num_bytes in zip(replica.slots, replica.gpu_bytes.values(), strict=True):
            gpu = self.gpus[slot]
            gpu.hot_bytes += num_bytes
            gpu.hot_ids.add(replica.replica_id)
            assert gpu.hot_bytes + gpu.leaving_bytes <= gpu.total_bytes, f"GPU {gpu.key} over-committed"

    def start_leaving(self, replica: SimReplica) -> None:
        """A HOT replica starts draining: its bytes stay held, pinned."""
        self._node_versions[replica.node] += 1
        for slot, num_bytes in zip(replica.slots, replica.gpu_bytes.values(), strict=True):
            gpu = self.gpus[slot]
            gpu.hot_bytes -= num_bytes
            gpu.leaving_bytes += num_bytes
            gpu.hot_ids.discard(replica.replica_id)
            gpu.leaving_ids.add(replica.replica_id)

    def release(self, replica: SimReplica) -> None:
        """A leaving replica's memory is given back (parked or stopped)."""
        self._node_versions[replica.node] += 1
        for slot, num_bytes in zip(replica.slots, replica.gpu_bytes.values(), strict=True):
            gpu = self.gpus[slot]
            gpu.leaving_bytes -= num_bytes
            gpu.leaving_ids.discard(replica.replica_id)
            assert gpu.leaving_bytes >= 0, f"GPU {gpu.key} released more than it held"
