"""Placement (seeds 000 and 002): where each replica goes, and who is evicted to make room.

Pure: no NATS, no asyncio; the clock and the random source are injected. The
scheduler and the tests drive it the same way::

    ClusterSnapshot ──▶ ClusterPlanner ──ensure / scale_down / evict_*──▶ finish() ──▶ PlacementPlan

    snapshot.py       what the planner reads (nodes, GPUs, replicas, model demands)
    planner.py        the planning pass: the decision for each replica is made here
    node_eval.py      seed 000's evaluate(): one node's best offer
    cluster_index.py  which node's offer is best, without asking every node
    gpu_index.py      the indexes behind it
    node_state.py     the planner's working copy of one node
    resources.py      GPU and CPU-RAM accounting of one node
    memory_figure.py  how many bytes a replica needs, and where the figure came from
    plan.py           what a pass decides (placements, evictions, unplaced)
    replicas.py       replica ids, scale-down choice, the apply() delta of seed 002
    config.py         the policy's settings (``[scheduler.placement]``)
"""

from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.memory_figure import MemoryFigure, UnknownModelMemory, get_memory_figure
from shoal.shared.placement.plan import Eviction, Placement, PlacementPlan, Unplaced
from shoal.shared.placement.planner import ClusterPlanner
from shoal.shared.placement.replicas import ReplicaDelta, ReplicaLocation, build_delta
from shoal.shared.placement.snapshot import (
    CandidateLevel,
    ClusterSnapshot,
    ModelDemand,
    NodeSnapshot,
    ReplicaSnapshot,
)

__all__ = [
    "CandidateLevel",
    "ClusterPlanner",
    "ClusterSnapshot",
    "Eviction",
    "MemoryFigure",
    "ModelDemand",
    "NodeSnapshot",
    "Placement",
    "PlacementConfig",
    "PlacementPlan",
    "ReplicaDelta",
    "ReplicaLocation",
    "ReplicaSnapshot",
    "UnknownModelMemory",
    "Unplaced",
    "build_delta",
    "get_memory_figure",
]
