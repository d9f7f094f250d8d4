"""Loads a model for the native forward straight from its safetensors file: one copy.

The ordinary load (`loader.load_model` through transformers' ``from_pretrained``) builds
and initialises every module, maps the file, and hands the engine parameters that
`native_forward.pack_model` then copies again: the q/k/v and gate/up weights are joined
with `torch.cat` (a fresh tensor each), then transposed into the products' panels, and the
parameters are released. Here the module tree is built on the meta device (no weights,
no initialisation), the file is mapped (`safetensors.safe_open`: tensors are views of the
page cache), and each weight is copied once, from the mapping to where it is used:

    products (q/k/v, o, gate/up, down, an untied lm_head)  -> their panels
    embedding, norms, biases                               -> plain tensors, the only copy

All of them live in one allocation that asks the kernel for transparent huge pages
(`allocate_weights`): on the development VM, faulting in fresh 4 KiB pages was most of
the time a copy into new memory took (docs/benchmarks.md, "Sleep and wake"), and the
products read the panels with fewer TLB misses. The panels hold what `pack_model` would
have put there, bit for bit (tests/unit/test_packed_load.py); the model's product
parameters are released as `pack_model` releases them, and the `PackedModel` is attached to
the model, so the engine's `pack_model` call returns it.

A model this path does not take (not float32 on the CPU, another architecture, weights
split over several files, names or shapes that are not the modules', anything
`native_forward.get_unsupported_reason` refuses) loads through the ordinary path. An engine
that then does not run the native forward (its `native_forward` setting off, or the CPU
settings changed since) gets the parameters back from the file (`restore_parameters`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import json
import mmap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import AutoModelForCausalLM

from shoal.kernels import cpu_kernels
from shoal.kernels.cpu_model import (
    EPILOGUE_SILU_MUL,
    EPILOGUE_STORE,
    PANEL,
    LayerWeights,
    PackedLinear,
    pack_into,
)
from shoal.services.worker.engine.native_forward import (
    SUPPORTED_MODEL_TYPES,
    attach_packed_model,
    get_unsupported_reason,
)

log = structlog.get_logger(__name__)

WEIGHTS_FILE = "model.safetensors"
HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
_ALIGN_FLOATS = 16
"""Each tensor in the shared allocation starts on a 64-byte boundary."""
_SOURCE_ATTR = "_shoal_packed_source"


def get_skip_reason(model_dir: Path, config: Any, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `load_packed` does not load this model (None: it may; it can still decline)."""
    if device.type != "cpu" or dtype != torch.float32:
        return f"{dtype} on {device} (packed load: float32 on the CPU)"
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r}"
    if not (model_dir / WEIGHTS_FILE).is_file():
        return f"no single {WEIGHTS_FILE}"
    return None


class _Allocation:
    """Consecutive 64-byte-aligned float32 tensors cut from one buffer."""

    def __init__(self, num_floats: int) -> None:
        self.buffer = allocate_weights(num_floats)
        self.used = 0

    def take(self, *shape: int) -> torch.Tensor:
        num_floats = 1
        for extent in shape:
            num_floats *= extent
        start = self.used
        self.used += -(-num_floats // _ALIGN_FLOATS) * _ALIGN_FLOATS
        assert self.used <= self.buffer.numel(), "the allocation was sized for every tensor it holds"
        return self.buffer[start : start + num_floats].view(*shape)


def _get_aligned_floats(num_floats: int) -> int:
    return -(-num_floats // _ALIGN_FLOATS) * _ALIGN_FLOATS


def allocate_weights(num_floats: int) -> torch.Tensor:
    """An uninitialised float32 buffer whose whole 2 MiB pages are marked for transparent huge
    pages before anything touches them (Linux; elsewhere, or when the kernel refuses, plain
    pages): one page fault and one clear per 2 MiB instead of 512."""
    num_bytes = num_floats * 4
    if num_bytes < HUGE_PAGE_BYTES:
        return torch.empty(num_floats, dtype=torch.float32)
    raw = torch.empty(num_bytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    address = raw.data_ptr()
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    _advise_huge_pages(start, (address + raw.numel() - start) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    offset = start - address
    return raw[offset : offset + num_bytes].view(torch.float32)


_libc: Any = None


def _advise_huge_pages(address: int, num_bytes: int) -> None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name, use_errno=True) if name else False
        if _libc:
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
    if _libc and num_bytes > 0:
        _libc.madvise(address, num_bytes, _MADV_HUGEPAGE)  # a refusal only leaves plain pages


def get_num_panels(num_out: int) -> int:
    """Panels of a product of `num_out` weight rows (`PackedLinear`'s layout)."""
    return -(-num_out // PANEL)


class WeightsFile:
    """A safetensors file mapped copy-on-write: each tensor a view of the page cache, tensors
    that lie next to each other in the file joinable without a copy (`join`).

    The format: 8 bytes of little-endian header length, a JSON header of ``name: {dtype,
    shape, data_offsets: [begin, end]}`` (offsets after the header), the tensors' bytes."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as file:
            self._mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        header_bytes = int.from_bytes(self._mapping[:8], "little")
        header = json.loads(self._mapping[8 : 8 + header_bytes])
        header.pop("__metadata__", None)
        self._bytes = torch.frombuffer(self._mapping, dtype=torch.uint8)
        data_start = 8 + header_bytes
        self.entries = {
            name: (entry["dtype"], tuple(entry["shape"]), data_start + entry["data_offsets"][0],
                   data_start + entry["data_offsets"][1])
            for name, entry in header.items()
        }

    def get(self, name: str) -> torch.Tensor:
        """The float32 tensor `name` (a view of the mapping)."""
        dtype, shape, begin, end = self.entries[name]
        assert dtype == "F32", "load_packed reads float32 files only"
        return self._bytes[begin:end].view(torch.float32).view(shape)

    def join(self, names: list[str]) -> torch.Tensor | None:
        """The matrices `names` stacked by rows, as one view when each follows the previous in
        the file (None otherwise)."""
        spans = [self.entries[name] for name in names]
        if any(end != next_begin for (_, _, _, end), (_, _, next_begin, _) in itertools.pairwise(spans)):
            return None
        num_rows = sum(shape[0] for _, shape, _, _ in spans)
        return self._bytes[spans[0][2] : spans[-1][3]].view(torch.float32).view(num_rows, spans[0][1][1])


def load_packed(model_dir: Path, config: Any, *, attn_implementation: str | None) -> tuple[Any, int] | None:
    """The model of `model_dir` with its products packed for the native forward, and the bytes
    its weights take (as `loader.model_weight_bytes` counts them in an ordinary load), or
    None when this path does not take it (`get_skip_reason` first; then the file must hold
    float32 tensors named and shaped as the model's parameters, and `get_unsupported_reason`
    must have no objection).
    """
    kernels = cpu_kernels.try_load()
    if kernels is None:
        return None
    kwargs: dict[str, Any] = {"dtype": torch.float32, "trust_remote_code": False}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(config, **kwargs)
    inner = model.model
    inner.rotary_emb = type(inner.rotary_emb)(config=model.config)  # its buffers, computed on the CPU
    parameters = dict(model.named_parameters())
    weights_file = WeightsFile(model_dir / WEIGHTS_FILE)
    mismatch = sorted(set(parameters) ^ set(weights_file.entries)) or [
        name for name, (dtype, shape, _, _) in weights_file.entries.items()
        if dtype != "F32" or shape != tuple(parameters[name].shape)
    ]
    if mismatch:
        log.info("packed_load.declined", reason="tensors that are not the model's float32 parameters",
                 names=mismatch[:5])
        return None
    weight_bytes = sum(p.numel() * 4 for p in parameters.values()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    _fill_model(model, weights_file, kernels)
    reason = get_unsupported_reason(model)
    if reason is not None:  # the config's other checks: back to the ordinary path
        log.info("packed_load.declined", reason=reason)
        return None
    setattr(model, _SOURCE_ATTR, model_dir / WEIGHTS_FILE)
    model.eval()
    return model, weight_bytes


_Product = tuple[list[str], bool]
"""A packed product: its modules' names (q/k/v, gate/up: several, joined by rows) and
whether it is a gate/up pair (the SiLU * up epilogue)."""


def _get_products(model: Any, tied: bool) -> list[_Product]:
    products: list[_Product] = []
    for index in range(len(model.model.layers)):
        prefix = f"model.layers.{index}."
        products += [
            ([prefix + f"self_attn.{p}_proj" for p in "qkv"], False),
            ([prefix + "self_attn.o_proj"], False),
            ([prefix + "mlp.gate_proj", prefix + "mlp.up_proj"], True),
            ([prefix + "mlp.down_proj"], False),
        ]
    if not tied:
        products.append((["lm_head"], False))
    return products


def _fill_model(model: Any, weights_file: WeightsFile, kernels: cpu_kernels.CpuKernels) -> None:
    inner = model.model
    tied = model.lm_head.weight is inner.embed_tokens.weight
    products = _get_products(model, tied)
    product_tensors = {module + suffix for modules, _ in products for module in modules for suffix in (".weight", ".bias")}
    plain = [name for name in weights_file.entries if name not in product_tensors]
    num_floats = sum(_get_aligned_floats(weights_file.get(name).numel()) for name in plain)
    for modules, _ in products:
        num_out = sum(weights_file.entries[m + ".weight"][1][0] for m in modules)
        num_in = weights_file.entries[modules[0] + ".weight"][1][1]
        num_floats += _get_aligned_floats(get_num_panels(num_out) * num_in * PANEL)
        if any(m + ".bias" in weights_file.entries for m in modules):
            num_floats += _get_aligned_floats(num_out)
    allocation = _Allocation(num_floats)
    jobs: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (weight rows, their panels, silu_mul)
    packed: list[PackedLinear] = []
    with torch.no_grad():
        for name in plain:  # embedding, norms: the only copy, where the model reads them
            source = weights_file.get(name)
            target = allocation.take(*source.shape)
            target.copy_(source)
            _set_parameter(model, name, target)
        if tied:
            model.lm_head.weight = inner.embed_tokens.weight
        for modules, silu_mul in products:
            packed.append(_plan_product(allocation, kernels, weights_file, modules, silu_mul, jobs))
        list(_get_pool().map(lambda job: pack_into(kernels, job[0], job[1], silu_mul=job[2]), jobs))
        for modules, _ in products:
            for module_name in modules:
                module = model.get_submodule(module_name)
                module.weight = _released(module.weight)
                if module.bias is not None:
                    module.bias = _released(module.bias)
    layers = [
        LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            qkv=packed[4 * index],
            o=packed[4 * index + 1],
            gate_up=packed[4 * index + 2],
            down=packed[4 * index + 3],
        )
        for index, layer in enumerate(inner.layers)
    ]
    attach_packed_model(model, layers, None if tied else packed[-1])


def _plan_product(
    allocation: _Allocation,
    kernels: cpu_kernels.CpuKernels,
    weights_file: WeightsFile,
    modules: list[str],
    silu_mul: bool,
    jobs: list[tuple[torch.Tensor, torch.Tensor, bool]],
) -> PackedLinear:
    """Takes the product's panels (and bias) from `allocation` and adds the copies that fill
    its panels to `jobs`: one per weight, each straight from the mapping, when every weight but
    the last fills whole panels (q/k/v) or the weights lie next to each other in the file
    (gate/up); else one copy of the weights joined first."""
    names = [m + ".weight" for m in modules]
    weights = [weights_file.get(name) for name in names]
    num_out, num_in = sum(w.shape[0] for w in weights), weights[0].shape[1]
    panels = allocation.take(get_num_panels(num_out) * num_in * PANEL)
    joined = weights[0] if len(weights) == 1 else weights_file.join(names)
    if joined is not None:
        jobs.append((joined, panels, silu_mul))
    elif not silu_mul and all(w.shape[0] % PANEL == 0 for w in weights[:-1]):
        row = 0
        for weight in weights:
            jobs.append((weight, panels[row * num_in :], False))
            row += weight.shape[0]
    else:
        jobs.append((torch.cat(weights), panels, silu_mul))
    bias = None
    if any(m + ".bias" in weights_file.entries for m in modules):
        bias = allocation.take(num_out)
        row = 0
        for module, weight in zip(modules, weights, strict=True):
            part = bias[row : row + weight.shape[0]]
            if module + ".bias" in weights_file.entries:
                part.copy_(weights_file.get(module + ".bias"))
            else:
                part.zero_()
            row += weight.shape[0]
    return PackedLinear.from_panels(
        kernels, panels, bias, num_out=num_out, num_in=num_in,
        epilogue=EPILOGUE_SILU_MUL if silu_mul else EPILOGUE_STORE,
    )


_pool: ThreadPoolExecutor | None = None


def _get_pool() -> ThreadPoolExecutor:
    """The threads that copy weights into panels, as many as torch's intra-op threads (a plain
    copy's), kept for the next load: the copies let go of the GIL."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="shoal-packed-load")
    return _pool


def _set_parameter(model: Any, name: str, value: torch.Tensor) -> None:
    module_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(module_name), attribute, torch.nn.Parameter(value, requires_grad=False))


def _released(parameter: torch.nn.Parameter) -> torch.nn.Parameter:
    """What `pack_model` leaves in a packed product's parameter: an empty CPU tensor."""
    return torch.nn.Parameter(torch.empty(0, dtype=parameter.dtype), requires_grad=False)


def restore_parameters(model: Any) -> bool:
    """Gives a model loaded by `load_packed` its product parameters back, from its file, for an
    engine that runs it through transformers instead (the packed weights stay attached, unused).

    Returns:
        Whether it did anything (False: the model was not loaded here, or is restored already).
    """
    source: Path | None = getattr(model, _SOURCE_ATTR, None)
    if source is None:
        return False
    parameters = dict(model.named_parameters())
    weights_file = WeightsFile(source)
    with torch.no_grad():
        for name in weights_file.entries:
            parameter = parameters.get(name)
            if parameter is not None and parameter.numel() == 0:
                parameter.data = weights_file.get(name).clone()
    delattr(model, _SOURCE_ATTR)
    return True

