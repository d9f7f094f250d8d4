"""What a waiting request waits for, in words (the SSE comment lines of a stream that waits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shoal.services.gateway.cluster import ClusterView

Stage = Literal["placing", "queued", "generating"]
"""Where the request is: the scheduler places a replica; the request waits in the model's
queue for a replica to take it; a replica generates it."""
MAX_REPLICAS_NAMED = 3


@dataclass
class WaitProgress:
    cluster: ClusterView
    model: str
    stage: Stage = "placing"

    def describe(self, waited_s: float) -> str:
        """E.g. ``waiting 6 s for demo/llama-100m (queued): replica 3f2a1b0c loading_weights``."""
        text = f"waiting {waited_s:.0f} s for {self.model} ({self.stage})"
        replicas = self.cluster.get_active_replicas(self.model)
        loading = [r for r in replicas if r.loading_phase is not None]
        if loading:
            named = ", ".join(f"{r.replica_id[:8]} {r.loading_phase}" for r in loading[:MAX_REPLICAS_NAMED])
            more = f" and {len(loading) - MAX_REPLICAS_NAMED} more" if len(loading) > MAX_REPLICAS_NAMED else ""
            text += f": replica {named}{more}"
        elif any(r.serving for r in replicas):
            text += ": behind other requests"
        return text
