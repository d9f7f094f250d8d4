"""Reading a model's record (``shoal_models``) the way several integration tests wait for it."""

from __future__ import annotations

import asyncio

from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import ModelSpec


async def wait_for_measured_spec(bus: Bus, model: str, *, tries: int = 40, pause_s: float = 0.25) -> ModelSpec:
    """The model's record once its node agent wrote the measured figure (just after the
    replica's "ready"), or as it is after `tries` looks `pause_s` apart."""
    for _ in range(tries):
        entry = await bus.models.get(subjects.model_token(model))
        assert entry is not None
        spec = entry.value
        if spec.measured_serving_bytes is not None:
            break
        await asyncio.sleep(pause_s)
    return spec
