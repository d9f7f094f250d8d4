"""Carrying out a plan's replica delta through the node agents (seed 002's apply()).

Steps run in the order `ReplicaDelta.steps()` gives: to_cache, delete, then
from_cache, create — parking and stopping finish before a restore or a new
replica reuses their GPU memory. A create or from_cache the node cannot carry
out is returned as a failure (the scheduler frees and replaces that replica).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import (
    CacheReplica,
    CreateReplica,
    ModelSpec,
    NodeCommand,
    ReplicaRecord,
    RestoreReplica,
    StopReplica,
    node_reply_decoder,
)
from shoal.shared.micro import ServiceCallError, request_json
from shoal.shared.policy.replica_plan import ReplicaDelta

log = structlog.get_logger(__name__)

STOP_TIMEOUT_S = 90.0
START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class StepFailure:
    op: str
    record: ReplicaRecord
    error: str


async def send_node_command(bus: Bus, node_id: str, verb: str, command: NodeCommand, timeout_s: float) -> None:
    """One command to one node agent; raises ServiceCallError when it is not carried out."""
    await request_json(bus.nc, subjects.node_subject(node_id, verb), command, node_reply_decoder,
                       timeout_s=timeout_s)


async def run_delta(
    bus: Bus,
    delta: ReplicaDelta,
    *,
    records: Mapping[str, ReplicaRecord],
    specs: Mapping[str, ModelSpec],
) -> list[StepFailure]:
    """Send every step of `delta` to its node agent, in order.

    Args:
        records: the replica records as the plan leaves them, by replica id (restores
            and creates carry the new allocation).
        specs: model specs by key (a create needs its model's spec).
    """
    failures: list[StepFailure] = []
    for op, location in delta.steps():
        record = records.get(location.replica_id)
        if record is None:  # deleted by the plan: stop what the location says
            record = ReplicaRecord(replica_id=location.replica_id, model=location.model, node_id=location.node_id)
        try:
            match op:
                case "to_cache":
                    await send_node_command(bus, location.node_id, "to_cache", CacheReplica(location.replica_id),
                                            STOP_TIMEOUT_S)
                case "delete":
                    await send_node_command(bus, location.node_id, "stop",
                                            StopReplica(location.replica_id, "evicted"), STOP_TIMEOUT_S)
                case "from_cache":
                    await send_node_command(bus, location.node_id, "from_cache", RestoreReplica(record),
                                            START_TIMEOUT_S)
                case "create":
                    spec = specs.get(record.model)
                    if spec is None:
                        failures.append(StepFailure(op, record, f"model {record.model} is no longer registered"))
                        continue
                    await send_node_command(bus, location.node_id, "create", CreateReplica(record, spec),
                                            START_TIMEOUT_S)
        except ServiceCallError as exc:
            log.error("replica_step_failed", op=op, replica=location.replica_id, node=location.node_id,
                      error=str(exc))
            if op in ("from_cache", "create"):
                failures.append(StepFailure(op, record, f"node {location.node_id}: {exc}"))
    return failures
