"""Load a replica's model and tokenizer within its GPU allocation.

On CUDA the allocation is enforced by torch and accelerate (seed 000):
`set_device` on the first target GPU, `set_per_process_memory_fraction` for a
single-GPU replica, and a `max_memory` map that gives non-target GPUs 0 bytes.
On virtual GPUs (tensors on the CPU) the worker enforces it itself: the
weights plus what the engine needs at least (its activation reserve and the
smallest KV pool it starts with) must fit, or loading fails with a clear error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from shoal.services.worker.pinned_park import (
    PinnedWeights,
    WeightsTransfer,
    park_to_pinned_host,
    release_pinned_host_cache_later,
    restore_to_device,
)
from shoal.shared.errors import ShoalError
from shoal.shared.messages import ModelSpec, ReplicaRecord
from shoal.shared.model_settings import InvalidModelPath, max_model_len_error, resolve_model_dir

if TYPE_CHECKING:
    from shoal.services.worker.engine.packed_load import PendingLoad
    from shoal.services.worker.generation import SuspendableEngine

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(ShoalError, RuntimeError):
    """The model cannot be loaded on this replica's allocation (the message says why)."""


MinEngineBytes = int | Callable[[Any, torch.dtype], int]
"""Bytes the engine needs besides the weights, or a function of the model's config and dtype
that computes them (`engine.factory.get_min_engine_bytes_for`)."""


def _resolve_min_bytes(min_engine_bytes: MinEngineBytes, config: Any, dtype: torch.dtype) -> int:
    return min_engine_bytes if isinstance(min_engine_bytes, int) else min_engine_bytes(config, dtype)


@dataclass
class LoadedModel:
    model: Any
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    weight_bytes: int
    max_model_len: int
    allocation_bytes: int
    """Sum of the replica's per-GPU reservations."""
    context_gpus: frozenset[int] = frozenset()
    """The CUDA devices this process has a context on (its first allocation's GPUs): a
    context lives as long as the process, parked or not (see `restore_weights`)."""
    model_dir: Path | None = None
    """Where the weights were read from (under the models root): a cold sleep reloads them from here."""
    parked: PinnedWeights | None = None
    """CUDA, while parked: the one page-locked buffer holding the weights (`pinned_park`)."""
    weights_arriving: WeightsTransfer | None = None
    """CUDA, from a restore until `join_restored_weights`: the weights' copy still running."""
    attention_checked: bool = False
    """The paged engine's attention check passed for this model (`engine.factory`)."""


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by parameters and buffers (what the weights really occupy)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _torch_dtype(name: str, config: Any) -> torch.dtype:
    if name == "auto":
        configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(configured, torch.dtype):
            return configured
        return _DTYPES.get(str(configured).removeprefix("torch."), torch.float32)
    if name not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}: use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def build_max_memory(gpu_bytes: dict[int, int], num_visible_gpus: int) -> dict[int | str, int]:
    """accelerate's `max_memory`: the allocation on target GPUs, 0 on every other GPU."""
    max_memory: dict[int | str, int] = {i: 0 for i in range(num_visible_gpus)}
    for index, num_bytes in gpu_bytes.items():
        max_memory[index] = num_bytes
    max_memory["cpu"] = 0
    return max_memory


def _cuda_placement(replica: ReplicaRecord) -> dict[str, Any]:
    gpu_ids = sorted(replica.gpu_bytes)
    first = gpu_ids[0]
    torch.cuda.set_device(first)
    if replica.gpu_memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(replica.gpu_memory_fraction, first)
    if len(gpu_ids) == 1:
        return {"device_map": {"": f"cuda:{first}"}}
    return {"device_map": "auto", "max_memory": build_max_memory(replica.gpu_bytes, torch.cuda.device_count())}


def _verify_placement(model: torch.nn.Module, replica: ReplicaRecord, device: torch.device) -> None:
    devices = {p.device for p in model.parameters()}
    if device.type == "cuda":
        allowed = {torch.device("cuda", i) for i in replica.gpu_bytes}
        stray = devices - allowed
        if stray:
            log.warning("model_on_unexpected_devices", devices=sorted(map(str, stray)))


def load_model(
    models_root: str | Path,
    spec: ModelSpec,
    replica: ReplicaRecord,
    *,
    device: torch.device,
    attn_implementation: str | None = None,
    min_kv_reserve_bytes: MinEngineBytes = 0,
    get_unsupported_reason: Callable[[Any, int], str | None] | None = None,
    native_pack: bool = False,
) -> LoadedModel:
    """Load `spec` from `models_root` for `replica`.

    Args:
        min_kv_reserve_bytes: what the engine needs besides the weights (its activation
            reserve and minimal KV pool); on a virtual GPU the weights plus this must fit.
        get_unsupported_reason: given the model's config and its serving length, why the
            worker's engine cannot serve it (None: it can); asked before the weights load
            (`engine.model_support.get_unsupported_attention` for the paged engine).
        native_pack: the caller's engine owns the model and packs it for the native forward
            where it can (the paged engine on the CPU): a float32 Llama/Mistral/Qwen2 model
            in one safetensors file is then read straight into the packed layout
            (`engine.packed_load`: one copy, no transformers initialisation); any other model
            loads as without it. A bfloat16 one (`spec.dtype`, or "auto" with a bfloat16
            checkpoint) loads the same way with bfloat16 panels and runs in float32: its
            `LoadedModel.dtype` is then float32, the dtype its activations and KV cache have.

    Raises ModelLoadError when the path is not a transformers checkpoint under
    the models root, or the weights (plus `min_kv_reserve_bytes`) do not fit
    the replica's allocation on a virtual GPU.
    """
    try:
        model_dir = resolve_model_dir(models_root, spec.path)
    except InvalidModelPath as exc:
        raise ModelLoadError(str(exc)) from exc
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} is not a transformers checkpoint (no config.json)")
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read {model_dir}: {exc}") from exc
    checkpoint_max = getattr(config, "max_position_embeddings", None)
    if error := max_model_len_error(spec.max_model_len, checkpoint_max):
        raise ModelLoadError(f"{spec.key}: {error}")
    max_len = spec.max_model_len or int(checkpoint_max or 2048)
    if get_unsupported_reason is not None and (reason := get_unsupported_reason(config, max_len)):
        raise ModelLoadError(f"{spec.key}: {reason}")
    dtype = _torch_dtype(spec.dtype, config)
    # A packed load's copies run on threads of their own while the tokenizer is read here.
    pending = _try_start_packed(model_dir, config, dtype, device) if native_pack else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        if pending is not None:
            pending.wait()
        raise ModelLoadError(f"cannot read {model_dir}: {exc}") from exc
    allocation_bytes = sum(replica.gpu_bytes.values())
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": False, "use_safetensors": True}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device.type == "cuda":
        kwargs.update(_cuda_placement(replica))
    model: Any
    packed = _try_finish_packed(pending, config, attn_implementation) if pending is not None else None
    weights_dtype = dtype
    if packed is not None:
        model, weight_bytes = packed
        dtype = next(model.parameters()).dtype  # float32: bfloat16 weights stay in the panels
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        except (OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot load weights from {model_dir}: {exc}") from exc
        if device.type != "cuda":
            model = model.to(device)
        model.eval()
        weight_bytes = model_weight_bytes(model)
    min_engine_bytes = _resolve_min_bytes(min_kv_reserve_bytes, config, dtype)
    if device.type != "cuda" and allocation_bytes and weight_bytes + min_engine_bytes > allocation_bytes:
        raise ModelLoadError(
            f"{spec.key}: weights ({weight_bytes} bytes) plus the engine's minimum ({min_engine_bytes} bytes: "
            f"activation reserve and minimal KV pool) do not fit this replica's allocation of "
            f"{allocation_bytes} bytes"
        )
    _verify_placement(model, replica, device)
    log.info("model_loaded", path=str(model_dir), dtype=str(dtype), weight_bytes=weight_bytes, device=str(device),
             packed=packed is not None, weights_dtype=str(weights_dtype))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        weight_bytes=weight_bytes,
        max_model_len=max_len,
        allocation_bytes=allocation_bytes,
        context_gpus=frozenset(replica.gpu_bytes) if device.type == "cuda" else frozenset(),
        model_dir=model_dir,
    )


def _try_start_packed(model_dir: Path, config: Any, dtype: torch.dtype, device: torch.device) -> PendingLoad | None:
    """`engine.packed_load.start_load` where it applies (None: load the ordinary way)."""
    from shoal.services.worker.engine import packed_load  # the engine's modules import this one

    reason = packed_load.get_skip_reason(model_dir, config, dtype, device)
    if reason is not None:
        log.debug("packed_load.skipped", reason=reason)
        return None
    try:
        return packed_load.start_load(model_dir, config, weights_dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:  # an unreadable file: the ordinary path says why
        log.info("packed_load.failed", error=str(exc))
        return None


def _try_finish_packed(pending: PendingLoad, config: Any, attn_implementation: str | None) -> tuple[Any, int] | None:
    try:
        return pending.finish(config, attn_implementation=attn_implementation)
    except (OSError, ValueError, KeyError) as exc:
        log.info("packed_load.failed", error=str(exc))
        return None


def detach_dispatch(model: Any) -> None:
    """Undo accelerate's `dispatch_model` on `model`, in place: its hooks (which move every
    layer's inputs to the device the layer was dispatched to), its wrappers of ``to`` and
    ``cuda``, and ``hf_device_map``. Without this a parked model moved back onto other GPUs
    would still send its activations to the old ones."""
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(model, recurse=True)
    if "hf_device_map" in model.__dict__:
        del model.hf_device_map


def park_weights(loaded: LoadedModel, replica: ReplicaRecord) -> None:
    """to_cache: weights to CPU RAM, the GPU memory and the memory cap given back.

    What stays on the GPU is the process's CUDA context (hundreds of MiB per GPU it has
    used), which lives as long as the process: its node agent measures it with NVML once
    parked and records it as the sleeping occupant's residual bytes (docs/operations.md,
    "What a parked worker keeps on its GPUs")."""
    if loaded.device.type != "cuda":
        return  # virtual GPUs: the weights already live in host RAM
    join_restored_weights(loaded)  # the copy below reads them
    detach_dispatch(loaded.model)
    loaded.parked = park_to_pinned_host(loaded.model)
    for index in replica.gpu_bytes:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:  # cuBLAS keeps its workspaces in the caching allocator
        clear_workspaces()
    torch.cuda.empty_cache()


def join_restored_weights(loaded: LoadedModel) -> None:
    """Orders everything the device's stream runs from now on after the weights' copy that
    `restore_weights` started (the host does not wait). Harmless without one."""
    if loaded.weights_arriving is not None:
        loaded.weights_arriving.join()
        loaded.weights_arriving = None


def resume_engine(engine: SuspendableEngine, loaded: LoadedModel) -> None:
    """A wake onto the allocation the engine was sized for: the engine kept across the sleep
    resumed (`PagedEngine.resume`), then its passes ordered after the weights' copy (as
    `engine.factory.build_paged_engine` orders a new engine's)."""
    engine.resume()
    join_restored_weights(loaded)


def get_stray_context_gpus(loaded: LoadedModel, replica: ReplicaRecord) -> list[int]:
    """GPUs where this process holds a CUDA context but `replica`'s allocation has none:
    memory no occupant would count if it served there."""
    return sorted(loaded.context_gpus - set(replica.gpu_bytes))


def restore_weights(
    loaded: LoadedModel, replica: ReplicaRecord, *, min_kv_reserve_bytes: MinEngineBytes = 0
) -> None:
    """from_cache: the weights back onto the GPUs of the replica's (new) allocation.

    On one GPU the weights' copy may still run when this returns (the engine is built
    meanwhile): `join_restored_weights` before anything reads them.

    On CUDA the new allocation must include every GPU this process has a context on: a
    context cannot be given back while the process lives, and serving elsewhere would leave
    it on a GPU where nothing counts it. Such a restore is refused (the scheduler then
    frees the replica and places a fresh worker, whose process starts clean).

    Raises ModelLoadError when the weights (plus `min_kv_reserve_bytes`, as in `load_model`)
    do not fit the allocation of a virtual GPU, or the CUDA allocation leaves a context out.
    """
    allocation_bytes = sum(replica.gpu_bytes.values())
    if loaded.device.type == "cuda":
        join_restored_weights(loaded)  # an earlier restore's copy, if no engine joined it (a failed build)
        stray = get_stray_context_gpus(loaded, replica)
        if stray:
            raise ModelLoadError(
                f"this worker's CUDA context lives on GPU(s) {stray}, outside the new allocation "
                f"{sorted(replica.gpu_bytes)}: restore it where it parked, or start a fresh worker"
            )
        from accelerate import dispatch_model, infer_auto_device_map

        placement = _cuda_placement(replica)
        if placement["device_map"] == "auto":
            device_map = infer_auto_device_map(
                loaded.model,
                max_memory=placement["max_memory"],
                no_split_module_classes=getattr(loaded.model, "_no_split_modules", None),
                dtype=loaded.dtype,
            )
            loaded.model = dispatch_model(loaded.model, device_map=device_map)
            _verify_placement(loaded.model, replica, loaded.device)
        else:
            device = torch.device(placement["device_map"][""])
            transfer = restore_to_device(loaded.parked, device) if loaded.parked is not None else None
            if transfer is None or not transfer.complete:  # else every tensor lies in one buffer on `device`
                loaded.model.to(device)  # what the parked buffer did not hold (a cold sleep's reloaded weights)
                _verify_placement(loaded.model, replica, loaded.device)
            loaded.weights_arriving = transfer
        loaded.parked = None
        release_pinned_host_cache_later()
        loaded.context_gpus |= set(replica.gpu_bytes)
    else:
        min_engine_bytes = _resolve_min_bytes(min_kv_reserve_bytes, loaded.model.config, loaded.dtype)
        if allocation_bytes and loaded.weight_bytes + min_engine_bytes > allocation_bytes:
            raise ModelLoadError(
                f"weights ({loaded.weight_bytes} bytes) plus the engine's minimum ({min_engine_bytes} bytes) "
                f"do not fit the new allocation of {allocation_bytes} bytes"
            )
    loaded.allocation_bytes = allocation_bytes
