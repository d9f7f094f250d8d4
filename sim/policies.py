"""The four ways of running the same cluster that a simulation compares, as knobs on one mechanism.

Every policy runs the same machinery (sim/engine.py, sim/wakes.py): Shoal's placement policy
(`ClusterPlanner`) decides where replicas go, fairness (`select_victims`, `next_wake_step`)
who is preempted and when, `is_idle` who sleeps. What differs is only what they are given:

| policy    | memory figure           | min runtime, fairness wait | idle sleep | parked to | target, victims          |
|-----------|-------------------------|----------------------------|------------|-----------|--------------------------|
| shoal     | measured                | the catalog's              | catalog's  | catalog's | planner, select_victims  |
| dedicated | whole GPUs              | never preempted            | no         | -         | none                     |
| seed      | 3x weights (seed 000)   | none                       | no         | CPU RAM   | the planner's evictions  |
| lru       | measured                | none                       | no         | stopped   | least recently used GPU  |

"catalog's" sleep is what the scheduler does (`services/scheduler/commands.py` `sleep_idle`):
every replica parks (its process stays, WARM), ``sleep.level = "warm"`` with its weights in CPU
RAM, ``"cold"`` with them dropped (charged ``parked_process_bytes``, reloaded from disk on wake).

All but ``dedicated`` keep the catalog's ``popular`` flag: seed 000 never evicts a
"dedicated" deployment, llama-swap keeps a ``persistent`` group loaded.

* ``dedicated``: one model per GPU (or per whole GPUs for a model larger than one): every
  model's replicas placed at the start, never moved; a model that finds no GPU is unserved.
* ``seed``: seed 000's heuristic, 3x the raw weight bytes as the memory figure (so a model
  of 7B and more takes most of a GPU), evictions chosen by the placement policy itself
  (fewest, then smallest, then least recently used) the moment a model does not fit: no
  minimum runtime, no fairness wait, no idle sleep. Departure: seed 000 shuffles GPUs and
  takes the first that fits; we keep Shoal's best fit (random only among exact ties),
  which packs tighter: the comparison favours the baseline.
* ``lru``: llama-swap / Ollama-like swapping: a model that does not fit goes to the GPU
  whose memory it needs was used least recently, and evicts those replicas (least recently
  used first) at once: no minimum runtime, no fairness wait; models stay until evicted (no
  idle timeout); an evicted replica stops (a wake starts a new process, weights from disk). It keeps Shoal's
  packing by measured memory. (A model spanning GPUs goes where the planner says.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from shoal.shared.model_settings import FairnessSettings
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.memory_figure import MemoryFigure, get_memory_figure
from shoal.shared.placement.snapshot import ModelDemand
from shoal.sim.scenario import ModelGroup, PolicyName

NEVER_PREEMPTED = FairnessSettings(min_runtime_s=0.0, max_wait_s=0.0, popular=True)


@dataclass(frozen=True)
class Policy:
    """One column of the table in the module doc."""

    name: PolicyName
    label: str
    memory: Literal["measured", "factor", "whole_gpus"]
    fairness: Literal["catalog", "none", "never"]
    idle_sleep: bool
    park: Literal["catalog", "warm", "stop"]
    """How a replica goes to sleep: "catalog" as the scheduler does (parked, weights dropped for
    ``sleep.level = "cold"``), "warm" parked with its weights, "stop" its process stopped."""
    victims: Literal["fair", "planner", "lru", "none"]
    refill: bool
    """The reconciler refills a model short of its desired replicas where it fits (Shoal)."""
    keeps_places: bool = False
    """A waker blocked until a victim becomes eligible keeps its place in line (Shoal's
    scheduler, `WakeCoordinator`); the baselines have no such line."""

    def get_fairness(self, group: ModelGroup) -> FairnessSettings:
        if self.fairness == "catalog":
            return group.fairness
        if self.fairness == "none":
            return FairnessSettings(min_runtime_s=0.0, max_wait_s=0.0, popular=group.fairness.popular)
        return NEVER_PREEMPTED

    def parks(self, group: ModelGroup) -> bool:
        """`ClusterPlanner.sleep_replica`'s ``park`` for a replica of `group` going to sleep:
        its process stays (WARM) where CPU RAM allows, or it stops."""
        del group  # every level parks under "catalog" (the scheduler's `sleep_idle`)
        return self.park != "stop"

    def drops_weights(self, group: ModelGroup) -> bool:
        """`ClusterPlanner.sleep_replica`'s ``drop_weights``: a cold sleep parks the process
        without its weights (reloaded from disk on wake)."""
        return self.park == "catalog" and group.sleep.level == "cold"

    def get_idle_timeout_s(self, group: ModelGroup) -> float:
        return group.sleep.idle_timeout_s if self.idle_sleep else 0.0

    def get_desired_replicas(self, group: ModelGroup) -> int:
        """Replicas placed at the start: the catalog's; one model per GPU places every model."""
        return max(1, group.replicas) if self.name == "dedicated" else group.replicas

    def get_figure(self, group: ModelGroup, config: PlacementConfig, gpu_bytes: int) -> MemoryFigure:
        """The memory figure the policy places `group`'s replicas by."""
        weight_bytes = group.raw_weight_bytes
        if self.memory == "measured":
            return get_memory_figure(weight_bytes=weight_bytes, config=config, measured_bytes=group.measured_bytes)
        if self.memory == "factor":
            return get_memory_figure(weight_bytes=weight_bytes, config=config)
        num_gpus = max(group.num_gpus, math.ceil(group.measured_bytes / gpu_bytes))
        return MemoryFigure(num_gpus * gpu_bytes, weight_bytes, "override")

    def build_demand(self, key: str, group: ModelGroup, config: PlacementConfig, gpu_bytes: int,
                     desired_replicas: int) -> ModelDemand:
        """The planner's view of one model under this policy."""
        return ModelDemand(
            model=key,
            figure=self.get_figure(group, config, gpu_bytes),
            desired_replicas=desired_replicas,
            popular=self.get_fairness(group).popular,
            min_num_gpus=group.num_gpus,
        )


POLICIES: dict[PolicyName, Policy] = {
    "shoal": Policy("shoal", "Shoal", "measured", "catalog", True, "catalog", "fair", True, keeps_places=True),
    "dedicated": Policy("dedicated", "one model per GPU", "whole_gpus", "never", False, "warm", "none", False),
    "seed": Policy("seed", "seed heuristic (3x)", "factor", "none", False, "warm", "planner", False),
    "lru": Policy("lru", "LRU swapping", "measured", "none", False, "stop", "lru", False),
}
