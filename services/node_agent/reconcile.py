"""The node agent's reconciliation (pure): its worker processes against ``shoal_replicas``.

Every ``node.reconcile_interval_s`` the agent compares the workers it runs with the replica
records of its node and repairs what a partition, a crashed scheduler or a bad write left:

    a worker whose record is gone, ``failed``,        stop it: nobody counts its memory any
      ``lost`` or ``stopping``, or on another node      more, or is about to free it
    a worker whose record does not decode             rewrite the record from what the agent
                                                      knows of it (CAS at the bad revision)
    a ``loading``, ``ready`` or ``sleeping`` record   failed (its worker is gone)
      with no worker
    a ``draining`` record with no worker              leaving to COLD: stopped (memory and
                                                      record go); leaving to WARM: failed

`plan_repairs` decides; `NodeAgent` carries it out. Records still ``pending`` are the
scheduler's (its create may be on its way) and are left alone, as is every record of a
worker that is still starting (`starting_ids`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from shoal.shared.messages import ReplicaRecord

RepairKind = Literal["stop_worker", "rewrite_record", "fail_record", "stopped_record"]


@dataclass(frozen=True, slots=True)
class Repair:
    kind: RepairKind
    replica_id: str
    reason: str
    record: ReplicaRecord | None = None
    """The record as read (None for a worker without one)."""


def plan_repairs(
    node_id: str,
    worker_ids: Collection[str],
    records: Mapping[str, ReplicaRecord],
    *,
    malformed_ids: Collection[str] = (),
    starting_ids: Collection[str] = (),
) -> list[Repair]:
    """What to repair on `node_id` (see the module doc).

    Args:
        worker_ids: replicas whose worker process runs here now.
        records: every replica record, by replica id.
        malformed_ids: replicas whose record does not decode.
        starting_ids: replicas this agent is launching right now (their records lag behind), or
            whose worker exited and is being handled (failed or restarted) by the agent.
    """
    repairs: list[Repair] = []
    for replica_id in sorted(worker_ids):
        if replica_id in starting_ids:
            continue
        if replica_id in malformed_ids:
            repairs.append(Repair("rewrite_record", replica_id, "its record does not decode"))
            continue
        record = records.get(replica_id)
        if record is None:
            repairs.append(Repair("stop_worker", replica_id, "it has no replica record"))
        elif record.node_id != node_id:
            repairs.append(Repair("stop_worker", replica_id, f"its record places it on {record.node_id}", record))
        elif record.state in ("failed", "lost", "stopping"):
            repairs.append(Repair("stop_worker", replica_id, f"its record is {record.state}", record))
    for replica_id, record in sorted(records.items()):
        if record.node_id != node_id or replica_id in worker_ids or replica_id in starting_ids:
            continue
        if record.state in ("loading", "ready", "sleeping"):
            repairs.append(Repair("fail_record", replica_id, "its worker is gone", record))
        elif record.state == "draining":
            if record.leaving_to == "WARM":
                repairs.append(Repair("fail_record", replica_id, "its worker is gone (it was parking)", record))
            else:
                repairs.append(Repair("stopped_record", replica_id, "its worker is gone", record))
    return repairs
