"""The knobs of the placement policy (seeds 000 and 002): ``[scheduler.placement]`` in shoal.toml.

One frozen, validated Struct: the configuration loader builds it from the file and the
environment (an invalid value is an error naming ``$.scheduler.placement``), and the
policy, the scheduler, `shoal status` and the simulator use the same object.
"""

from __future__ import annotations

from msgspec import Struct


class PlacementConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Placement defaults; every field is checked in `__post_init__`."""

    gpu_fraction_factor: float = 3.0
    """Serving bytes of a model nothing is known of = this factor x its raw weight bytes
    (seed 000's safety factor: CUDA context, activations, KV cache). Used only when no
    measurement, override or config estimate exists."""

    fraction_threshold: float = 0.8
    """A single-GPU replica needing less than this fraction of a GPU shares the GPU (it
    reserves only what it needs); one needing more reserves the whole GPU (seed 000's
    ``fraction_largest_possible``)."""

    min_available_gpu_fraction: float = 0.3
    """A GPU is in its node's "available" set while at least this fraction of it is free
    (seed 000's ``Resources``)."""

    unknown_extra_gpus: int = 1
    """Extra whole GPUs a multi-GPU model gets when its figure is the factor guess (seed
    000's ``ceil(size / gpu) + 1``). Models with a measured, given or estimated figure get
    exactly the GPUs their figure needs."""

    min_gpu_memory_fraction: float = 0.01
    """Lower clamp of the memory fraction handed to a single-GPU worker."""

    max_gpu_memory_fraction: float = 0.99
    """Upper clamp of the memory fraction handed to a single-GPU worker."""

    warm_cache_fraction: float = 0.5
    """Share of a node's CPU RAM that WARM replicas (weights parked in host memory) may
    hold; the rest stays for the OS, node agent and HOT workers."""

    parked_process_bytes: int = 512 << 20
    """Host RAM a replica slept at ``sleep.level = "cold"`` is charged to its node's CPU cache:
    its worker process stays (weights dropped, reloaded from disk on wake), and this is what the
    process itself holds (interpreter, torch, tokenizer)."""

    def __post_init__(self) -> None:
        if self.parked_process_bytes < 0:
            raise ValueError(f"parked_process_bytes must be >= 0, got {self.parked_process_bytes}")
        if self.gpu_fraction_factor < 1.0:
            raise ValueError(f"gpu_fraction_factor must be >= 1.0, got {self.gpu_fraction_factor}")
        if not 0.0 < self.fraction_threshold <= 1.0:
            raise ValueError(f"fraction_threshold must be in (0, 1], got {self.fraction_threshold}")
        if not 0.0 <= self.min_available_gpu_fraction <= 1.0:
            raise ValueError(
                f"min_available_gpu_fraction must be in [0, 1], got {self.min_available_gpu_fraction}"
            )
        if self.unknown_extra_gpus < 0:
            raise ValueError(f"unknown_extra_gpus must be >= 0, got {self.unknown_extra_gpus}")
        if not 0.0 < self.min_gpu_memory_fraction <= self.max_gpu_memory_fraction <= 1.0:
            raise ValueError(
                "min_gpu_memory_fraction and max_gpu_memory_fraction need 0 < min <= max <= 1, got "
                f"{self.min_gpu_memory_fraction} and {self.max_gpu_memory_fraction}"
            )
        if not 0.0 <= self.warm_cache_fraction <= 1.0:
            raise ValueError(f"warm_cache_fraction must be in [0, 1], got {self.warm_cache_fraction}")

    def clamp_gpu_memory_fraction(self, fraction: float) -> float:
        """Clamp a single-GPU replica's share of its GPU to the configured bounds."""
        return min(self.max_gpu_memory_fraction, max(self.min_gpu_memory_fraction, fraction))
