"""Read what placement needs to know of a model from its files, without loading weights."""

from __future__ import annotations

from pathlib import Path

from shoal.shared.errors import ShoalError
from shoal.shared.messages import InspectModel, ModelFacts
from shoal.shared.model_memory import estimate_from_config
from shoal.shared.model_settings import resolve_model_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class ModelInspectionError(ShoalError, ValueError):
    """The path is not a readable transformers checkpoint under the models root."""


def checkpoint_weight_bytes(model_dir: Path) -> int:
    """Bytes of weight files on disk (safetensors preferred, as the loader does)."""
    safetensors = sorted(model_dir.glob("*.safetensors"))
    files = safetensors or [p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES]
    return sum(p.stat().st_size for p in files)


def inspect_model(
    models_root: str | Path, command: InspectModel, runtime_overhead_bytes: int, *, on_cpu: bool = False
) -> ModelFacts:
    """Size `command.path` from its config (parameters x dtype bytes + KV budget + overhead),
    as a CPU worker runs it when `on_cpu` (this node's GPUs are virtual)."""
    from transformers import AutoConfig  # heavy: imported only when a model is inspected

    try:
        model_dir = resolve_model_dir(models_root, command.path)
        if not model_dir.is_dir():  # else transformers reads the path as a Hub repo id, and says so
            raise ModelInspectionError(f"cannot read model {command.path!r}: no such directory under the models root")
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except ModelInspectionError:
        raise
    except (OSError, ValueError) as exc:
        raise ModelInspectionError(f"cannot read model {command.path!r}: {exc}") from exc
    dtype = None if command.dtype == "auto" else command.dtype
    estimate = estimate_from_config(
        config, command.kv_cache_tokens, dtype=dtype, on_cpu=on_cpu, runtime_overhead_bytes=runtime_overhead_bytes
    )
    architectures = getattr(config, "architectures", None) or [type(config).__name__]
    return ModelFacts(
        weight_bytes=checkpoint_weight_bytes(model_dir),
        num_parameters=estimate.num_parameters,
        estimated_bytes=estimate.total_bytes,
        max_model_len=getattr(config, "max_position_embeddings", None),
        architecture=architectures[0],
    )
