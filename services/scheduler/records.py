"""Pure conversion between the KV records and the placement policy's types, both ways.

    shoal_nodes, shoal_gpus, shoal_replicas, shoal_models
        │ build_snapshot / build_demand
        ▼
    ClusterSnapshot, ModelDemand ──policy──▶ PlacementPlan
        │ plan_to_records
        ▼
    RecordChanges: per GPU key, occupants to remove and to add (applied with
    `apply_gpu_change` on the revision read for each CAS); replica records to put / delete

No I/O: the scheduler reads the buckets, calls these, and writes the results.

How records read (the GPU records are the truth for memory, since every change to them
is a CAS; replica records say what the memory is for):

* an occupant whose replica record is HOT on the same node, and not failed, stopping or
  draining, is that replica's reservation on that GPU; pressure may evict it only if
  fairness allows (serving, not popular, past its min runtime: `fairness.is_protected`);
* a ``sleeping`` occupant holds only its residue (pinned); its replica is WARM;
* any other occupant (a reservation whose replica record is not written yet, a failed,
  stopping or draining replica, a record that disagrees) is pinned: it counts, nothing
  evicts it; except a reservation without a replica record whose ``expires_at`` has
  passed (a scheduler died between the two writes), which counts for nothing;
* preemption intents keep their bytes for their wakers, first come first served
  (`fairness.get_pinned_intent_bytes`): pinned for every placement but their own
  waker's and older wakers'.

A replica's last access is the latest of its occupants' ``last_accessed`` and its
record's ``last_request_at`` (written by its worker), or now while a request is in flight.

Evictions are two-phase: a plan that evicts marks its victims ``draining`` (record and
occupants, bytes still counted); the node agent parks or stops the worker and only then
releases the memory (`gpu_state.mark_parked` / `remove_occupant`). A plan never places on
memory its own evictions free: the waker claims it in a later pass.

A GPU whose occupants exceed its total (a node re-registered with smaller GPUs) is read
as it is, not clamped: the policy treats it as having no room until evictions cover the
excess, and `find_over_committed` reports it. A live node's GPU whose record does not decode
(a hand-written or forged value, a newer version) is left out of placement (all its bytes
pinned) until its node agent repairs it: nothing is placed on a GPU whose occupants are unknown.

A ``lost`` replica (its node's heartbeats lapsed) keeps its memory pinned until its node agent
confirms the worker is gone; so do ``failed`` and ``stopping`` ones (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from shoal.shared.messages import GpuRecord, ModelSpec, NodeRecord, Occupant, ReplicaRecord
from shoal.shared.model_settings import FairnessSettings
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.fairness import (
    IntentView,
    OccupantView,
    get_older_intents,
    get_pinned_intent_bytes,
    is_protected,
)
from shoal.shared.placement.memory_figure import get_memory_figure
from shoal.shared.placement.plan import PlacementPlan
from shoal.shared.placement.replicas import DeltaOp, ReplicaLocation
from shoal.shared.placement.snapshot import ClusterSnapshot, ModelDemand, NodeSnapshot, ReplicaSnapshot
from shoal.shared.subjects import gpu_kv_key, replica_kv_key

_NOT_HOLDING = ("failed", "stopping", "draining", "lost")
"""Replica states whose GPU memory is still held but no longer serves (pinned, not evictable)."""
_DEFAULT_FAIRNESS = FairnessSettings()


# --------------------------------------------------------------------------- records -> policy


def build_snapshot(
    nodes: Iterable[NodeRecord],
    gpus: Iterable[GpuRecord],
    replicas: Iterable[ReplicaRecord],
    models: Iterable[ModelSpec],
    *,
    config: PlacementConfig,
    now: float,
    claimant: str | None = None,
    leaving_is_free: bool = False,
    unreadable_gpu_keys: Collection[str] = (),
) -> ClusterSnapshot:
    """The policy's view of the cluster, from the four buckets' current values.

    Args:
        nodes: live node agents (the TTL bucket drops dead ones; their GPUs are ignored).
        gpus: every GPU record.
        replicas: every replica record.
        models: every model spec (desired replica counts; its weight bytes stand in for
            a replica record's CPU bytes when the record has none).
        config: supplies the share of CPU RAM WARM replicas may hold.
        now: clock time, to let lapsed reservations go and for fairness.
        claimant: the model a waking pass places (its own and younger intents do not pin
            memory for it); None for any other pass.
        leaving_is_free: count the bytes of replicas draining away (evicted, parking or
            stopping) as free: where a wake could go once they are released (never for a
            pass that commits: nothing is placed on memory still held).
        unreadable_gpu_keys: GPU keys whose value does not decode: those GPUs are left out.

    Returns:
        Nodes in node id order (so a seeded plan does not depend on read order).
    """
    gpu_by_key = {gpu_kv_key(g.node_id, g.index): g for g in gpus}
    replica_by_id = {r.replica_id: r for r in replicas}
    specs = {spec.key: spec for spec in models}
    snapshots = [
        _build_node(node, gpu_by_key, replica_by_id, specs, config, now, claimant, leaving_is_free,
                    unreadable_gpu_keys)
        for node in sorted(nodes, key=lambda n: n.node_id)
    ]
    desired = {spec.key: spec.desired_replicas for spec in specs.values()}
    return ClusterSnapshot(tuple(snapshots), desired)


def get_last_accessed(occupant_accessed: float, replica: ReplicaRecord | None, now: float) -> float:
    """A replica's last access: see the module doc."""
    if replica is None:
        return occupant_accessed
    if replica.num_in_flight > 0:
        return now
    return max(occupant_accessed, replica.last_request_at)


def _build_node(
    node: NodeRecord,
    gpu_by_key: Mapping[str, GpuRecord],
    replica_by_id: Mapping[str, ReplicaRecord],
    specs: Mapping[str, ModelSpec],
    config: PlacementConfig,
    now: float,
    claimant: str | None,
    leaving_is_free: bool,
    unreadable_gpu_keys: Collection[str],
) -> NodeSnapshot:
    total_bytes_by_gpu: dict[int, int] = {}
    pinned_bytes_by_gpu: dict[int, int] = {}
    hot_bytes_by_id: dict[str, dict[int, int]] = {}
    last_accessed_by_id: dict[str, float] = {}
    serving_since_by_id: dict[str, float] = {}
    sleeping_ids: set[str] = set()

    def pin(gpu_index: int, num_bytes: int) -> None:
        if num_bytes:
            pinned_bytes_by_gpu[gpu_index] = pinned_bytes_by_gpu.get(gpu_index, 0) + num_bytes

    for info in node.gpus:
        record = gpu_by_key.get(gpu_kv_key(node.node_id, info.index))
        total_bytes_by_gpu[info.index] = record.total_bytes if record is not None else info.total_bytes
        if record is None:
            if gpu_kv_key(node.node_id, info.index) in unreadable_gpu_keys:
                pin(info.index, info.total_bytes)  # occupants unknown: left out of placement
            continue
        for occupant in record.occupants:
            replica = replica_by_id.get(occupant.replica_id)
            last_accessed_by_id[occupant.replica_id] = max(
                get_last_accessed(occupant.last_accessed, replica, now),
                last_accessed_by_id.get(occupant.replica_id, 0.0),
            )
            if occupant.state == "sleeping":
                sleeping_ids.add(occupant.replica_id)
                pin(info.index, occupant.residual_bytes)
            elif _is_reservation_of(replica, node.node_id):
                by_gpu = hot_bytes_by_id.setdefault(occupant.replica_id, {})
                by_gpu[info.index] = by_gpu.get(info.index, 0) + occupant.num_bytes
                if occupant.state == "serving":
                    serving_since_by_id[occupant.replica_id] = occupant.since
            elif leaving_is_free and occupant.state == "draining" and replica is not None \
                    and replica.state == "draining":
                continue
            elif replica is not None or occupant.expires_at is None or occupant.expires_at > now:
                pin(info.index, occupant.num_bytes)
        pin(info.index, get_pinned_bytes(record, claimant, now))
    replica_snapshots = []
    for replica in sorted(replica_by_id.values(), key=lambda r: r.replica_id):
        if replica.node_id != node.node_id or replica.level == "COLD" or replica.state in _NOT_HOLDING:
            continue
        spec = specs.get(replica.model)
        fairness = spec.fairness if spec is not None else _DEFAULT_FAIRNESS
        gpu_bytes = hot_bytes_by_id.get(replica.replica_id, {})
        is_hot = replica.level == "HOT" and (gpu_bytes or replica.replica_id not in sleeping_ids)
        serving_since = serving_since_by_id.get(replica.replica_id)
        protected = (is_protected(fairness, serving=replica.serving and serving_since is not None,
                                  serving_since=serving_since or 0.0, now=now)
                     if is_hot else fairness.popular)
        replica_snapshots.append(
            ReplicaSnapshot(
                replica_id=replica.replica_id,
                model=replica.model,
                level="HOT" if is_hot else "WARM",
                gpu_bytes=gpu_bytes if is_hot else {},
                cpu_bytes=replica.cpu_bytes or (spec.weight_bytes or 0 if spec is not None else 0),
                parked_bytes=config.parked_process_bytes if replica.weights_dropped and not is_hot else None,
                protected=protected,
                last_accessed=last_accessed_by_id.get(replica.replica_id, replica.last_request_at),
                loaded=replica.state == "ready" or not is_hot,
            )
        )
    return NodeSnapshot(
        node_id=node.node_id,
        gpu_total_bytes=total_bytes_by_gpu,
        cpu_cache_bytes=int(node.cpu_ram_bytes * config.warm_cache_fraction),
        replicas=tuple(replica_snapshots),
        pinned_gpu_bytes=pinned_bytes_by_gpu,
    )


def get_occupant_views(
    gpus: Iterable[GpuRecord], replicas: Iterable[ReplicaRecord], models: Iterable[ModelSpec], *, now: float
) -> list[OccupantView]:
    """Every occupant of `gpus` as fair preemption sees it (`fairness.select_victims`)."""
    replica_by_id = {r.replica_id: r for r in replicas}
    specs = {spec.key: spec for spec in models}
    views = []
    for gpu in gpus:
        for occupant in gpu.occupants:
            replica = replica_by_id.get(occupant.replica_id)
            serving = (occupant.state == "serving" and replica is not None and replica.serving
                       and _is_reservation_of(replica, gpu.node_id))
            views.append(OccupantView(
                replica_id=occupant.replica_id,
                model=occupant.model,
                gpu_key=gpu_kv_key(gpu.node_id, gpu.index),
                num_bytes=occupant.residual_bytes if occupant.state == "sleeping" else occupant.num_bytes,
                serving=serving,
                serving_since=occupant.since,
                last_accessed=get_last_accessed(occupant.last_accessed, replica, now),
                fairness=specs[occupant.model].fairness if occupant.model in specs else _DEFAULT_FAIRNESS,
                idle_timeout_s=specs[occupant.model].sleep.idle_timeout_s if occupant.model in specs else 0.0,
            ))
    return views


def find_over_committed(gpus: Iterable[GpuRecord]) -> dict[str, int]:
    """GPU keys whose occupants hold more than the GPU's total, with the excess bytes.

    Happens when a node re-registers with smaller GPUs (its agent updates the total and
    keeps the occupants). Nothing here is an error: `build_snapshot` reads such a GPU
    as it is, and the policy gives it no room (a placement there must first evict enough
    to cover the excess; protected replicas are never evicted). The scheduler reports
    these (log, ``shoal status``) so an operator can move what no longer fits.
    """
    excess_by_key = {}
    for gpu in gpus:
        excess_bytes = gpu.reserved_bytes - gpu.total_bytes
        if excess_bytes > 0:
            excess_by_key[gpu_kv_key(gpu.node_id, gpu.index)] = excess_bytes
    return dict(sorted(excess_by_key.items()))


def _is_reservation_of(replica: ReplicaRecord | None, node_id: str) -> bool:
    return (
        replica is not None
        and replica.node_id == node_id
        and replica.level == "HOT"
        and replica.state not in _NOT_HOLDING
    )


def build_demand(
    spec: ModelSpec, *, config: PlacementConfig, desired_replicas: int | None = None
) -> ModelDemand:
    """A model to place, with its memory figure ranked measured > override > estimate > factor.

    Args:
        spec: the model's record (its ``weight_bytes`` sizes WARM copies and the factor).
        config: supplies the factor.
        desired_replicas: HOT replicas wanted; default the spec's count.

    Raises:
        UnknownModelMemory: the spec has no memory figure and no weight size yet.
    """
    figure = get_memory_figure(
        weight_bytes=spec.weight_bytes,
        config=config,
        measured_bytes=spec.measured_serving_bytes,
        override_bytes=spec.memory_override_bytes,
        estimated_bytes=spec.estimated_bytes,
    )
    return ModelDemand(
        model=spec.key,
        figure=figure,
        desired_replicas=spec.desired_replicas if desired_replicas is None else desired_replicas,
        popular=spec.fairness.popular,
        min_num_gpus=spec.num_gpus,
    )


def get_recorded_locations(replicas: Iterable[ReplicaRecord]) -> dict[str, ReplicaLocation]:
    """Replica records as `build_delta` reads them (COLD ones are absent)."""
    locations = {}
    for replica in replicas:
        if replica.level != "COLD":
            gpu_bytes = dict(replica.gpu_bytes) if replica.level == "HOT" else {}
            locations[replica.replica_id] = ReplicaLocation(
                replica.replica_id, replica.model, replica.node_id, replica.level, gpu_bytes
            )
    return locations


# --------------------------------------------------------------------------- policy -> records


@dataclass(frozen=True, slots=True)
class GpuChange:
    """What one plan changes on one GPU key: drop these replicas' occupants, then add these."""

    remove_replica_ids: tuple[str, ...] = ()
    add: tuple[Occupant, ...] = ()


@dataclass(frozen=True, slots=True)
class RecordChanges:
    """The writes that carry out a plan."""

    gpu_changes: Mapping[str, GpuChange] = field(default_factory=dict)
    """By GPU key, in key order (reserve in a fixed order to avoid lock-step conflicts)."""
    replica_puts: tuple[ReplicaRecord, ...] = ()
    """New or changed replica records."""
    replica_delete_keys: tuple[str, ...] = ()
    """Keys of replica records to delete (replicas gone COLD)."""


def plan_to_records(
    plan: PlacementPlan,
    *,
    gpus: Iterable[GpuRecord],
    replicas: Mapping[str, ReplicaRecord],
    scheduler_id: str,
    reservation_ttl_s: float,
) -> RecordChanges:
    """The GPU-key and replica-record writes of a plan.

    Placements become ``reserved`` occupants owned by `scheduler_id` that lapse after
    `reservation_ttl_s` unless their replica record is written; evicted HOT replicas become
    ``draining`` (holding their bytes) with ``leaving_to`` WARM or COLD, for their node agent
    to park or stop; evicted WARM replicas' records are deleted.

    Args:
        plan: the policy's decision.
        gpus: the GPU records the plan's snapshot was built from.
        replicas: the replica records by id, likewise.
        scheduler_id: owner written on reservations.
        reservation_ttl_s: how long a reservation lives without its replica record.
    """
    at = plan.planned_at
    touched_ids = {p.replica_id for p in plan.placements} | {e.replica_id for e in plan.evictions}
    removals: dict[str, set[str]] = {}
    last_accessed_by_id: dict[str, float] = {}
    for gpu in gpus:
        for occupant in gpu.occupants:
            if occupant.replica_id in touched_ids:
                removals.setdefault(gpu_kv_key(gpu.node_id, gpu.index), set()).add(occupant.replica_id)
                last_accessed_by_id[occupant.replica_id] = max(
                    occupant.last_accessed, last_accessed_by_id.get(occupant.replica_id, 0.0)
                )
    placed_ids = {p.replica_id for p in plan.placements}
    additions: dict[str, list[Occupant]] = {}
    puts: dict[str, ReplicaRecord] = {}
    delete_keys: list[str] = []
    for eviction in plan.evictions:
        if eviction.replica_id in placed_ids:
            continue  # left its old place and was placed again: the placement says where it is
        key = replica_kv_key(eviction.model, eviction.replica_id)
        old = replicas.get(eviction.replica_id)
        if eviction.from_level == "WARM" or old is None:
            delete_keys.append(key)  # dropped from the CPU cache: no GPU memory to wait for
            continue
        # Two-phase (module doc): the victim drains holding its bytes; its node agent frees them.
        for gpu_id, num_bytes in eviction.freed_gpu_bytes.items():
            additions.setdefault(gpu_kv_key(eviction.node_id, gpu_id), []).append(
                Occupant(
                    replica_id=eviction.replica_id,
                    model=eviction.model,
                    num_bytes=num_bytes,
                    state="draining",
                    since=at,
                    last_accessed=last_accessed_by_id.get(eviction.replica_id, 0.0),
                )
            )
        puts[key] = msgspec.structs.replace(old, state="draining", leaving_to=eviction.to_level, updated_at=at,
                                            scheduler_id=scheduler_id, weights_dropped=eviction.drop_weights)
    for placement in plan.placements:
        for gpu_id, num_bytes in placement.gpu_bytes.items():
            additions.setdefault(gpu_kv_key(placement.node_id, gpu_id), []).append(
                Occupant(
                    replica_id=placement.replica_id,
                    model=placement.model,
                    num_bytes=num_bytes,
                    state="reserved",
                    since=at,
                    last_accessed=at,
                    owner=scheduler_id,
                    expires_at=at + reservation_ttl_s,
                )
            )
        key = replica_kv_key(placement.model, placement.replica_id)
        old = replicas.get(placement.replica_id)
        restored = old if old is not None and placement.from_level == "WARM" else None
        puts[key] = ReplicaRecord(
            replica_id=placement.replica_id,
            model=placement.model,
            node_id=placement.node_id,
            gpu_bytes=dict(placement.gpu_bytes),
            gpu_memory_fraction=placement.gpu_memory_fraction,
            level="HOT",
            state="pending",
            cpu_bytes=placement.cpu_bytes,
            created_at=restored.created_at if restored is not None else at,
            updated_at=at,
            scheduler_id=scheduler_id,
            pid=restored.pid if restored is not None else None,
            measured_bytes=old.measured_bytes if old is not None else None,
            ready_at=restored.ready_at if restored is not None else None,  # a restored replica has served
        )
    gpu_changes = {
        key: GpuChange(tuple(sorted(removals.get(key, ()))), tuple(additions.get(key, ())))
        for key in sorted(removals.keys() | additions.keys())
    }
    return RecordChanges(gpu_changes, tuple(puts.values()), tuple(delete_keys))


def apply_gpu_change(record: GpuRecord, change: GpuChange, *, now: float) -> GpuRecord | None:
    """The GPU record after `change`, or None when the change would add bytes beyond the
    GPU's total (the record moved on since the plan was made: re-read and re-plan).

    A change that does not bring a new occupant onto the GPU (removals, victims marked
    ``draining``) applies whenever it does not increase the bytes held, even on an
    over-committed GPU (a node re-registered with smaller GPUs): evicting there lowers the
    excess. A change that adds a memory-holding occupant must leave the GPU within its
    total: a new replica never starts on memory that is already held.
    """
    removed = set(change.remove_replica_ids)
    present = {o.replica_id for o in record.occupants}
    occupants = [o for o in record.occupants if o.replica_id not in removed]
    occupants.extend(change.add)
    updated = msgspec.structs.replace(record, occupants=occupants, updated_at=now)
    if updated.reserved_bytes <= updated.total_bytes:
        return updated
    adds_newcomer = any(o.replica_id not in present and o.state != "sleeping" and o.num_bytes > 0
                        for o in change.add)
    if adds_newcomer or updated.reserved_bytes > record.reserved_bytes:
        return None
    return updated


# --------------------------------------------------------------------------- writes by revision

_GONE = ("failed", "stopping", "lost")
"""States a plan never overwrites: the replica is being given up."""


def merge_planned_record(current: ReplicaRecord | None, read: ReplicaRecord | None,
                         planned: ReplicaRecord) -> ReplicaRecord | None:
    """What a plan writes over the record as it is now (a CAS at `current`'s revision), or
    None when the plan no longer applies to it.

    Between the plan's read (`read`) and its write, a node agent or a worker may have written
    the record. Progress (pending -> loading -> ready, a worker's activity) does not stop the
    plan: its write keeps the worker's activity fields. A record that was failed, held, lost,
    deleted, moved or created since does: the plan's change for that replica is dropped (the
    caller rolls back its GPU reservation), never written over a ``failed``.

    Args:
        current: the record now (None: absent).
        read: the record the plan was made on (None: a new replica).
        planned: what the plan writes.
    """
    if read is None:
        return planned if current is None else None
    if current is None or current.state in _GONE or (current.node_id, current.level) != (read.node_id, read.level):
        return None
    if current.level == "HOT" and current.gpu_bytes != read.gpu_bytes:
        return None
    if read.level == "WARM" and current.state != read.state:
        return None  # a parked replica that changed since was not what the plan restores
    return msgspec.structs.replace(planned, last_request_at=max(planned.last_request_at, current.last_request_at),
                                   num_in_flight=current.num_in_flight)


def get_unbacked_reservations(gpus: Iterable[GpuRecord], replicas: Iterable[ReplicaRecord], *, now: float,
                              malformed_replica_ids: Collection[str] = ()) -> dict[str, list[str]]:
    """Reservations to remove, by GPU key: ``reserved`` occupants whose reservation lapsed and
    that no replica record backs (a scheduler died between reserving and recording, or its
    record went back to WARM), and occupants of any state with no replica record at all once
    their reservation (if any) lapsed. An occupant whose record does not decode is kept (its
    worker may run: the node agent's reconciliation decides)."""
    by_id = {r.replica_id: r for r in replicas}
    stale: dict[str, list[str]] = {}
    for gpu in gpus:
        key = gpu_kv_key(gpu.node_id, gpu.index)
        for occupant in gpu.occupants:
            if occupant.replica_id in malformed_replica_ids:
                continue
            lapsed = occupant.expires_at is None or occupant.expires_at < now
            record = by_id.get(occupant.replica_id)
            if record is None:
                unbacked = lapsed
            else:
                backs = record.node_id == gpu.node_id and record.level == "HOT" and gpu.index in record.gpu_bytes
                unbacked = occupant.state == "reserved" and lapsed and not backs
            if unbacked:
                stale.setdefault(key, []).append(occupant.replica_id)
    return stale


def get_stalled_step(record: ReplicaRecord) -> DeltaOp | None:
    """The node step a ``pending`` or ``draining`` record still waits for, derived from the
    record alone (so a scheduler that died after its commit leaves nothing that cannot be
    finished): a pending replica that parked before (it has a pid) is restored, another one
    created; a draining one is parked (leaving to WARM) or stopped."""
    if record.state == "pending" and record.level == "HOT":
        return "from_cache" if record.pid is not None else "create"
    if record.state == "draining":
        return "to_cache" if record.leaving_to == "WARM" else "delete"
    return None


def get_pinned_bytes(record: GpuRecord, claimant: str | None, now: float) -> int:
    """Bytes of one GPU its wakers' intents keep from `claimant` (`fairness.get_pinned_intent_bytes`:
    every live intent's for a model not waking, the older ones' for a waker)."""
    return get_pinned_intent_bytes(_intent_views(record), claimant, now)


def get_wakers_ahead(record: GpuRecord, claimant: str, now: float) -> frozenset[str]:
    """The models whose intents on one GPU are ahead of `claimant`'s in line (`fairness.get_older_intents`)."""
    return frozenset(i.model for i in get_older_intents(_intent_views(record), claimant, now))


def _intent_views(record: GpuRecord) -> list[IntentView]:
    return [IntentView(i.model, i.num_bytes, i.since, i.expires_at) for i in record.intents]
