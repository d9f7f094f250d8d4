"""How many GPU bytes one replica of a model needs, and where that number came from.

Precedence, best first (DESIGN.md, "Behaviour to build"):

    measured  the node agent measured a serving replica after load and warm-up
    override  an operator wrote ``memory_override_bytes`` on the model spec
    estimate  the scheduler estimated it from the model's config
              (parameters x dtype bytes + KV budget + runtime overhead)
    factor    nothing is known: seed 000's guess, factor x raw weight bytes

The estimate is computed by the caller (it needs transformers); this module only
ranks the numbers it is given. Operators see the source in ``shoal status``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from shoal.shared.errors import ShoalError
from shoal.shared.placement.config import PlacementConfig

MemorySource = Literal["measured", "override", "estimate", "factor"]


class UnknownModelMemory(ShoalError, ValueError):
    """A model with no memory figure at all and no weight size to apply the factor to."""


@dataclass(frozen=True, slots=True)
class MemoryFigure:
    """The serving memory of one replica (summed over its GPUs) and its provenance."""

    required_bytes: int
    """GPU bytes one replica needs to serve (weights, KV budget, runtime overhead)."""
    weight_bytes: int
    """Raw weight bytes: what a WARM replica holds in CPU RAM."""
    source: MemorySource

    def __post_init__(self) -> None:
        assert self.required_bytes > 0, f"a memory figure must be positive, got {self.required_bytes}"
        assert self.weight_bytes >= 0, f"weight bytes must be >= 0, got {self.weight_bytes}"

    @property
    def is_guess(self) -> bool:
        """True when nothing was known of the model and the global factor was applied."""
        return self.source == "factor"


def get_memory_figure(
    *,
    weight_bytes: int | None,
    config: PlacementConfig,
    measured_bytes: int | None = None,
    override_bytes: int | None = None,
    estimated_bytes: int | None = None,
) -> MemoryFigure:
    """Pick the best-informed memory figure for a replica of one model.

    Args:
        weight_bytes: raw size of the checkpoint's weights; None when not known yet.
        config: supplies the factor for a model nothing is known of.
        measured_bytes: serving bytes measured on a node (total over the replica's GPUs).
        override_bytes: the operator's figure from the model spec.
        estimated_bytes: the scheduler's estimate from the model config.

    Returns:
        The first positive figure in the order measured > override > estimate, else
        ``ceil(factor x weight_bytes)`` with source ``"factor"``. An unknown weight size
        is taken as the figure itself (an upper bound for the CPU RAM a WARM copy holds).

    Raises:
        UnknownModelMemory: no positive figure and no positive weight size.
    """
    ranked: tuple[tuple[int | None, MemorySource], ...] = (
        (measured_bytes, "measured"),
        (override_bytes, "override"),
        (estimated_bytes, "estimate"),
    )
    for figure_bytes, source in ranked:
        if figure_bytes is not None and figure_bytes > 0:
            known_weight_bytes = figure_bytes if weight_bytes is None else weight_bytes
            return MemoryFigure(required_bytes=figure_bytes, weight_bytes=known_weight_bytes, source=source)
    if weight_bytes is None or weight_bytes <= 0:
        raise UnknownModelMemory("a model with no measured, given or estimated memory needs its weight bytes")
    guessed_bytes = math.ceil(weight_bytes * config.gpu_fraction_factor)
    return MemoryFigure(required_bytes=guessed_bytes, weight_bytes=weight_bytes, source="factor")


def next_measured_figure(current_bytes: int | None, reading_bytes: int | None, *, restored: bool) -> int | None:
    """The model's measured serving figure after a replica reports `reading_bytes`.

    A replica that was created (loaded from disk, engine built for its allocation) sets the
    figure, up or down: that is the reference measurement. A replica restored from WARM
    only raises it: its engine serves whatever allocation the restore got (which
    may be smaller than the figure, e.g. the fraction clamp or an estimate), so a low
    reading there says little about what a new replica needs, and letting it lower the
    figure would shrink every later reservation (and each replica's KV pool) in turn.

    Args:
        current_bytes: the figure on the model's spec (None: nothing measured yet).
        reading_bytes: what the replica holds now (None or 0: no reading).
        restored: the reading comes from a from_cache, not a create.
    """
    if not reading_bytes:
        return current_bytes
    if restored and current_bytes:
        return max(current_bytes, reading_bytes)
    return reading_bytes
