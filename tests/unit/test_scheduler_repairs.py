"""What the reconciler derives from records alone: writes by revision that never overwrite a
replica being given up, reservations nobody backs, node steps a dead scheduler left, GPUs
left out of placement, and the node agent's plan for its workers."""

from __future__ import annotations

import msgspec

from shoal.services.node_agent.reconcile import plan_repairs
from shoal.services.scheduler.records import (
    build_snapshot,
    get_stalled_step,
    get_unbacked_reservations,
    merge_planned_record,
)
from shoal.shared.messages import GpuInfo, GpuRecord, NodeRecord, Occupant, ReplicaRecord
from shoal.shared.placement.config import PlacementConfig

GiB = 1 << 30
NOW = 1_000.0


def record(replica_id: str = "r", node_id: str = "n0", **kwargs: object) -> ReplicaRecord:
    kwargs.setdefault("gpu_bytes", {0: 10 * GiB})
    return ReplicaRecord(replica_id=replica_id, model="m", node_id=node_id, **kwargs)  # type: ignore[arg-type]


def occupant(replica_id: str, state: str = "serving", **kwargs: object) -> Occupant:
    return Occupant(replica_id=replica_id, model="m", num_bytes=10 * GiB, state=state, since=0.0, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- merge_planned_record


def test_a_plan_writes_over_progress_keeping_the_workers_activity() -> None:
    read = record(state="ready", last_request_at=5.0)
    planned = msgspec.structs.replace(read, state="draining", leaving_to="COLD", last_request_at=5.0)
    current = msgspec.structs.replace(read, last_request_at=9.0, num_in_flight=3)
    merged = merge_planned_record(current, read, planned)
    assert merged is not None
    assert (merged.state, merged.leaving_to, merged.last_request_at, merged.num_in_flight) == (
        "draining", "COLD", 9.0, 3)


def test_a_plan_never_overwrites_a_replica_given_up_deleted_or_moved_since_its_read() -> None:
    read = record(state="ready")
    planned = msgspec.structs.replace(read, state="draining", leaving_to="WARM")
    for state in ("failed", "stopping", "lost"):
        assert merge_planned_record(msgspec.structs.replace(read, state=state), read, planned) is None, state
    assert merge_planned_record(None, read, planned) is None, "deleted: not resurrected"
    moved = msgspec.structs.replace(read, node_id="n1")
    assert merge_planned_record(moved, read, planned) is None
    resized = msgspec.structs.replace(read, gpu_bytes={0: 20 * GiB})
    assert merge_planned_record(resized, read, planned) is None


def test_a_new_replica_is_created_only_where_no_record_exists() -> None:
    planned = record(state="pending")
    assert merge_planned_record(None, None, planned) == planned
    assert merge_planned_record(record(state="ready"), None, planned) is None


def test_a_parked_replica_that_changed_since_is_not_restored() -> None:
    read = record(level="WARM", state="sleeping", gpu_bytes={})
    planned = msgspec.structs.replace(read, level="HOT", state="pending", gpu_bytes={0: 10 * GiB})
    assert merge_planned_record(read, read, planned) is not None
    assert merge_planned_record(msgspec.structs.replace(read, state="draining"), read, planned) is None


# --------------------------------------------------------------------------- get_unbacked_reservations


def test_only_lapsed_reservations_no_record_backs_are_removed() -> None:
    gpu = GpuRecord(node_id="n0", index=0, total_bytes=80 * GiB, occupants=[
        occupant("live", state="reserved", expires_at=NOW + 10),       # not lapsed yet
        occupant("crashed", state="reserved", expires_at=NOW - 1),     # scheduler died mid-commit
        occupant("recorded", state="reserved", expires_at=NOW - 1),    # its record backs it
        occupant("warm-again", state="reserved", expires_at=NOW - 1),  # its record went back to WARM
        occupant("orphan"),                                             # serving, no record at all
        occupant("garbled"),                                            # its record does not decode
        occupant("lost"),                                               # a lost replica keeps its bytes
    ])
    replicas = [
        record("recorded", state="pending"),
        record("warm-again", level="WARM", state="sleeping", gpu_bytes={}),
        record("lost", state="lost"),
    ]
    stale = get_unbacked_reservations([gpu], replicas, now=NOW, malformed_replica_ids={"garbled"})
    assert stale == {"n0.0": ["crashed", "warm-again", "orphan"]}


# --------------------------------------------------------------------------- get_stalled_step


def test_the_step_a_record_waits_for_is_derived_from_the_record_alone() -> None:
    assert get_stalled_step(record(state="pending")) == "create"
    assert get_stalled_step(record(state="pending", pid=42)) == "from_cache", "parked before: restored"
    assert get_stalled_step(record(state="draining", leaving_to="WARM")) == "to_cache"
    assert get_stalled_step(record(state="draining", leaving_to="COLD")) == "delete"
    for state in ("loading", "ready", "sleeping", "stopping", "failed", "lost"):
        assert get_stalled_step(record(state=state)) is None, state


# --------------------------------------------------------------------------- placement's view


def node(node_id: str = "n0") -> NodeRecord:
    return NodeRecord(node_id=node_id, hostname=node_id, gpus=[GpuInfo(index=0, total_bytes=80 * GiB)],
                      cpu_ram_bytes=0)


def test_a_gpu_whose_record_does_not_decode_is_left_out_of_placement() -> None:
    snapshot = build_snapshot([node()], [], [], [], config=PlacementConfig(), now=NOW,
                              unreadable_gpu_keys={"n0.0"})
    assert snapshot.nodes[0].pinned_gpu_bytes == {0: 80 * GiB}
    readable = build_snapshot([node()], [], [], [], config=PlacementConfig(), now=NOW)
    assert readable.nodes[0].pinned_gpu_bytes == {}


def test_a_lost_replica_keeps_its_memory_counted_and_does_not_serve() -> None:
    gpu = GpuRecord(node_id="n0", index=0, total_bytes=80 * GiB, occupants=[occupant("r")])
    snapshot = build_snapshot([node()], [gpu], [record(state="lost")], [], config=PlacementConfig(), now=NOW)
    assert snapshot.nodes[0].pinned_gpu_bytes == {0: 10 * GiB}
    assert snapshot.nodes[0].replicas == ()


# --------------------------------------------------------------------------- the node agent's plan


def test_workers_no_live_record_accounts_for_are_stopped() -> None:
    records = {
        "ok": record("ok", state="ready"),
        "failed": record("failed", state="failed"),
        "lost": record("lost", state="lost"),
        "held": record("held", state="stopping"),
        "elsewhere": record("elsewhere", node_id="n1", state="ready"),
    }
    workers = {"ok", "failed", "lost", "held", "elsewhere", "unrecorded"}
    repairs = plan_repairs("n0", workers, records)
    assert {(r.kind, r.replica_id) for r in repairs} == {
        ("stop_worker", "failed"), ("stop_worker", "lost"), ("stop_worker", "held"),
        ("stop_worker", "elsewhere"), ("stop_worker", "unrecorded"),
    }


def test_records_whose_worker_is_gone_are_failed_or_finished() -> None:
    records = {
        "pending": record("pending", state="pending"),      # the scheduler's create may be on its way
        "loading": record("loading", state="loading"),
        "ready": record("ready", state="ready"),
        "parking": record("parking", state="draining", leaving_to="WARM"),
        "stopping-cold": record("stopping-cold", state="draining", leaving_to="COLD"),
        "starting": record("starting", state="loading"),    # this agent is launching it
        "other-node": record("other-node", node_id="n1", state="ready"),
    }
    repairs = plan_repairs("n0", set(), records, starting_ids={"starting"})
    assert {(r.kind, r.replica_id) for r in repairs} == {
        ("fail_record", "loading"), ("fail_record", "ready"), ("fail_record", "parking"),
        ("stopped_record", "stopping-cold"),
    }


def test_a_worker_whose_record_does_not_decode_gets_its_record_rewritten_not_stopped() -> None:
    repairs = plan_repairs("n0", {"r"}, {}, malformed_ids={"r"})
    assert [(r.kind, r.replica_id) for r in repairs] == [("rewrite_record", "r")]
