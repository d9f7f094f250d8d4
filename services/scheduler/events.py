"""What the scheduler tells the world: events on ``SHOAL_EVENTS`` and the matching log lines.

    model_registered / model_removed      registry.ModelRegistry
    replica_placed / replica_evicted      a committed plan (passes.PlacementPasses)

A replica's failure is published by the node agent that saw it (``replica_failed``);
the scheduler logs how it handled it (`failures.FailureHandler`).
"""

from __future__ import annotations

from typing import Literal

import structlog
from nats.js import JetStreamContext

from shoal.shared.bus import publish_event
from shoal.shared.messages import Event
from shoal.shared.placement.plan import PlacementPlan

log = structlog.get_logger(__name__)


async def publish_model_event(js: JetStreamContext, kind: Literal["model_registered", "model_removed"], model: str,
                              at: float) -> None:
    """``model_registered`` or ``model_removed``."""
    await publish_event(js, Event(kind, at, model=model))


async def publish_plan_events(js: JetStreamContext, plan: PlacementPlan, at: float) -> None:
    """One ``replica_placed`` per placement and one ``replica_evicted`` per eviction of a
    committed plan, each also logged."""
    for placement in plan.placements:
        log.info("replica_placed", model=placement.model, replica=placement.replica_id, node=placement.node_id,
                 gpu_bytes=dict(placement.gpu_bytes), memory_source=placement.memory_source,
                 kind=placement.kind, from_level=placement.from_level)
        await publish_event(js, Event(
            "replica_placed", at, model=placement.model, replica_id=placement.replica_id,
            node_id=placement.node_id, data={"gpu_bytes": {str(k): v for k, v in placement.gpu_bytes.items()},
                                             "memory_source": placement.memory_source,
                                             "from_level": placement.from_level}))
    for eviction in plan.evictions:
        log.info("replica_evicted", model=eviction.model, replica=eviction.replica_id, node=eviction.node_id,
                 to_level=eviction.to_level, reason=eviction.reason)
        await publish_event(js, Event(
            "replica_evicted", at, eviction.reason, eviction.model, eviction.replica_id, eviction.node_id,
            data={"to_level": eviction.to_level}))
