"""Where the next replica of a model goes, decided on a snapshot (no I/O).

First fit on the memory figure of the model: the first node (by id) with a GPU
whose free bytes cover it. The full placement policy (seed 000 and 002)
replaces this.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

from shoal.services.scheduler.store import ClusterSnapshot, Reservation
from shoal.shared import subjects
from shoal.shared.config import PlacementConfig
from shoal.shared.messages import ModelSpec

DEFAULT_UNKNOWN_BYTES = 1 << 30


@dataclass(frozen=True)
class PlacementDecision:
    reservation: Reservation
    gpu_memory_fraction: float | None
    memory_source: str


def memory_figure(spec: ModelSpec, config: PlacementConfig) -> tuple[int, str]:
    """Serving bytes of one replica and where the figure came from (best-informed first)."""
    for figure, source in (
        (spec.measured_serving_bytes, "measured"),
        (spec.memory_override_bytes, "override"),
        (spec.estimated_bytes, "estimate"),
    ):
        if figure:
            return figure, source
    if spec.weight_bytes:
        return int(spec.weight_bytes * config.gpu_fraction_factor), "factor"
    return DEFAULT_UNKNOWN_BYTES, "default"


class Planner:
    def __init__(self, config: PlacementConfig, rng: random.Random) -> None:
        self._config = config
        self._rng = rng

    def plan(self, snapshot: ClusterSnapshot, spec: ModelSpec) -> PlacementDecision | str:
        """A reservation for one new replica of `spec`, or why there is none."""
        required, source = memory_figure(spec, self._config)
        for node_id in sorted(snapshot.nodes):
            for gpu in snapshot.nodes[node_id].gpus:
                entry = snapshot.gpus.get(subjects.gpu_kv_key(node_id, gpu.index))
                if entry is None or entry.value.available_bytes < required:
                    continue
                fraction = min(0.99, max(0.01, required / entry.value.total_bytes))
                replica_id = uuid.UUID(int=self._rng.getrandbits(128)).hex
                reservation = Reservation(replica_id, spec.key, node_id, {gpu.index: required}, spec.dedicated)
                return PlacementDecision(reservation, fraction, source)
        return f"no GPU has {required} bytes free for {spec.key} ({source} memory figure)"
