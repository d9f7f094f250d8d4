"""Cold sleep: a parked worker drops its weights (no host RAM held for them) and reloads them
from the model's files on wake, in place, while its process stays.

CPU: every weight tensor keeps its address (the packed products' structs, the engine's views
stay valid); its pages go back to the kernel (``madvise(MADV_DONTNEED)``: the whole buffer of a
packed load, else each tensor's whole pages) and a reload writes the file's tensors back
where they were (bfloat16 weights, `packed_load.get_weights_dtype`: rounded again, into their
bfloat16 panels). CUDA: each parameter's storage is released (an empty CPU tensor keeps its
Parameter object) and a reload reads the files to the CPU; `loader.restore_weights` then
moves the model onto its allocation, as after a warm park.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from shoal.services.worker.loader import LoadedModel, ModelLoadError
from shoal.services.worker.page_advice import can_advise, release_pages

log = structlog.get_logger(__name__)

_INDEX_FILE = "model.safetensors.index.json"

FileEntry = tuple[str, tuple[int, ...]]
"""A tensor of the model's files as the drop found it: its dtype code and shape."""


@dataclass
class _Fill:
    """One target refilled from the files: the products' panels (`pack`, rows joined), a
    packed bias (rows joined, zeros for a module without one) or one tensor (`names` of one)."""

    names: list[str]
    target: torch.Tensor
    kind: str  # "pack" | "bias" | "copy"
    silu_mul: bool = False
    modules: list[str] = field(default_factory=list)


@dataclass
class DroppedWeights:
    """What a reload needs: the fills (CPU) or the parameters' shapes (CUDA), and the file
    entries the drop saw (a reload refuses files that changed)."""

    model_dir: Path
    entries: dict[str, FileEntry]
    fills: list[_Fill] = field(default_factory=list)
    rounded: bool = False
    """The model's weights are the files' rounded to bfloat16 (a packed load's bfloat16 weights)."""
    parameters: dict[str, tuple[torch.nn.Parameter, torch.Size, torch.dtype]] = field(default_factory=dict)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = {name for name in weight_map.values() if isinstance(name, str) and "/" not in name}
        if len(names) != len(set(weight_map.values())):
            raise ValueError("the index names a file outside the model's directory")
        return [model_dir / name for name in sorted(names)]
    return [model_dir / "model.safetensors"]


def _open_sources(model_dir: Path) -> dict[str, Any]:
    """Each tensor name of the model's safetensors files -> the mapped file holding it. Raises
    ModelLoadError when a file is missing or not one it can read (a truncated file, a broken
    index): a restore then answers 507 and the replica is not served half-loaded."""
    from shoal.services.worker.engine.packed_load import WeightsFile

    sources: dict[str, Any] = {}
    try:
        for path in _weight_files(model_dir):
            if not path.is_file():
                raise ModelLoadError(f"{path} is missing: the weights cannot be reloaded")
            weights_file = WeightsFile(path)
            sources.update(dict.fromkeys(weights_file.entries, weights_file))
    except (OSError, ValueError, KeyError, TypeError) as exc:  # json's errors are ValueErrors
        raise ModelLoadError(f"the weights in {model_dir} cannot be read back: {exc}") from exc
    return sources


def _entries(sources: dict[str, Any]) -> dict[str, FileEntry]:
    return {name: (f.entries[name][0], f.entries[name][1]) for name, f in sources.items()}


def _plan_cpu_fills(model: Any, sources: dict[str, Any]) -> list[_Fill]:
    from shoal.services.worker.engine.native_forward import get_packed_model
    from shoal.services.worker.engine.packed_load import get_products

    fills: list[_Fill] = []
    packed = get_packed_model(model)
    if packed is not None:
        products = get_products(len(packed.layers), tied=packed.lm_head is None)
        for (modules, silu_mul), linear in zip(products, packed.linears, strict=True):
            fills.append(_Fill([m + ".weight" for m in modules], linear.panels, "pack", silu_mul, modules))
            if linear.bias is not None:
                fills.append(_Fill([], linear.bias, "bias", modules=modules))
    for name, parameter in model.named_parameters():
        if parameter.numel() > 0:
            fills.append(_Fill([name], parameter.data, "copy"))
    for fill in fills:
        _check_fill(fill, sources)
    return fills


def _check_fill(fill: _Fill, sources: dict[str, Any]) -> None:
    missing = [n for n in fill.names if n not in sources]
    if missing:
        raise ModelLoadError(f"the model's files lack {missing[:3]}")
    shapes = [sources[n].entries[n][1] for n in fill.names]
    if fill.kind == "copy":
        if tuple(fill.target.shape) != shapes[0]:
            raise ModelLoadError(f"{fill.names[0]}: the file holds {shapes[0]}, the model {tuple(fill.target.shape)}")
    elif fill.kind == "pack":
        from shoal.services.worker.engine.packed_load import PANEL, get_num_panels

        num_out, num_in = sum(s[0] for s in shapes), shapes[0][1]
        if fill.target.numel() != get_num_panels(num_out) * num_in * PANEL:
            raise ModelLoadError(f"{fill.names}: the file's shapes {shapes} are not the packed product's")


def drop_weights(loaded: LoadedModel) -> DroppedWeights:
    """Drops the model's weights (the engine is closed); raises ModelLoadError when they could
    not be reloaded (no model dir, files that are not the model's): nothing is dropped then."""
    if loaded.model_dir is None:
        raise ModelLoadError("the model's directory is unknown: weights cannot be reloaded")
    sources = _open_sources(loaded.model_dir)
    dropped = DroppedWeights(loaded.model_dir, _entries(sources))
    if loaded.device.type == "cuda":
        from shoal.services.worker.loader import detach_dispatch

        detach_dispatch(loaded.model)
        for name, parameter in loaded.model.named_parameters():
            if name not in sources or tuple(parameter.shape) != sources[name].entries[name][1]:
                raise ModelLoadError(f"{name}: not in the model's files with this shape")
            dropped.parameters[name] = (parameter, parameter.shape, parameter.dtype)
        for parameter, _, dtype in dropped.parameters.values():
            parameter.data = torch.empty(0, dtype=dtype)
        return dropped
    from shoal.services.worker.engine.packed_load import get_allocation, get_weights_dtype

    dropped.fills = _plan_cpu_fills(loaded.model, sources)
    dropped.rounded = get_weights_dtype(loaded.model) == torch.bfloat16
    if not can_advise():
        raise ModelLoadError("no libc: weights cannot be dropped in place")
    allocation = get_allocation(loaded.model)
    if allocation is not None:
        release_pages(allocation)
    for fill in dropped.fills:
        release_pages(fill.target)
    log.info("weights_dropped", model_dir=str(loaded.model_dir), tensors=len(dropped.fills))
    return dropped


def reload_weights(loaded: LoadedModel, dropped: DroppedWeights) -> None:
    """Reads the weights back from the model's files where the drop left them. Raises
    ModelLoadError when the files changed since (another tensor, shape or dtype)."""
    sources = _open_sources(dropped.model_dir)
    if _entries(sources) != dropped.entries:
        raise ModelLoadError(f"the weights in {dropped.model_dir} changed since this replica slept")
    if dropped.parameters:
        for name, (parameter, _, dtype) in dropped.parameters.items():
            parameter.data = sources[name].get(name).to(dtype, copy=True)
        return
    from shoal.kernels import cpu_kernels
    from shoal.kernels.cpu_model import pack_into
    from shoal.services.worker.engine.packed_load import add_pack_jobs, copy_weight, fill_bias, get_copy_pool

    kernels = cpu_kernels.try_load()
    jobs: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for fill in dropped.fills:
        source = sources[fill.names[0]] if fill.names else sources[fill.modules[0] + ".weight"]
        if fill.kind == "pack":
            add_pack_jobs(source, fill.names, fill.target, fill.silu_mul, jobs)
        elif fill.kind == "bias":
            fill_bias(source, fill.modules, fill.target, rounded=dropped.rounded)
        else:
            copies.append((fill.target, source.get(fill.names[0])))
    if kernels is None and jobs:
        raise ModelLoadError("the native CPU library is gone: packed weights cannot be reloaded")
    pool = get_copy_pool()
    futures = [pool.submit(pack_into, kernels, w, panels, silu_mul=silu)  # type: ignore[arg-type]
               for w, panels, silu in jobs]
    futures += [pool.submit(copy_weight, target, source, rounded=dropped.rounded) for target, source in copies]
    for future in futures:
        future.result()
    log.info("weights_reloaded", model_dir=str(dropped.model_dir))

