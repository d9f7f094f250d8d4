"""Loads a model for the native forward straight from its safetensors file: one copy.

The ordinary load (`loader.load_model` through transformers' ``from_pretrained``) builds
and initialises every module, maps the file, and hands the engine parameters that
`native_forward.pack_model` then copies again: the q/k/v and gate/up weights are joined
with `torch.cat` (a fresh tensor each), then transposed into the products' panels, and the
parameters are released. Here the file is mapped (`WeightsFile`: each tensor a view of the
page cache) and each weight is copied once, from the mapping to where it is used:

    products (q/k/v, o, gate/up, down, an untied lm_head)  -> their panels
    embedding, norms, biases                               -> plain tensors, the only copy

`start_load` makes the layout from the file's header and starts the copies on a thread per
core (C code and torch copies, without the GIL); the loader reads the tokenizer meanwhile;
`PendingLoad.finish` builds the module tree on the meta device (no weights, no
initialisation), waits for the copies and gives the model its tensors. All of them live in
one allocation that asks the kernel for transparent huge pages (`allocate_weights`): on the
development VM, faulting in fresh 4 KiB pages was most of the time a copy into new memory
took (docs/benchmarks.md, "Sleep and wake"). The panels hold what `pack_model` would have
put there, bit for bit (tests/unit/test_packed_load.py); the model's product parameters are
released as `pack_model` releases them, and the `PackedModel` is attached to the model, so
the engine's `pack_model` call returns it.

Bfloat16 weights (a model served with ``dtype = "bfloat16"``, or ``"auto"`` with a bfloat16
checkpoint): the products' panels hold bfloat16 (`cpu_model.PANEL_DTYPES`: half the bytes a
decode step streams), packed from the file's float32 rounded to nearest even or from its
bfloat16 as it is; the embedding, norms and biases are float32 tensors holding the
bfloat16-rounded values. The model is then exactly the file's model with every parameter
rounded to bfloat16, run in float32 (activations, KV cache, sums): what
`get_weights_dtype` says, and what a cold sleep's reload and `restore_parameters` rebuild.

A model this path does not take (not float32 or bfloat16 on the CPU, another architecture, weights
split over several files, names or shapes that are not the modules', anything
`native_forward.get_unsupported_reason` refuses) loads through the ordinary path. An engine
that then does not run the native forward (its `native_forward` setting off, or the CPU
settings changed since) gets the parameters back from the file (`restore_parameters`).
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import AutoModelForCausalLM
from transformers.initialization import no_init_weights

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
from shoal.services.worker.page_advice import MADV_HUGEPAGE, advise

log = structlog.get_logger(__name__)

WEIGHTS_FILE = "model.safetensors"
HUGE_PAGE_BYTES = 2 << 20
_ALIGN_FLOATS = 16
"""Each tensor in the shared allocation starts on a 64-byte boundary."""
_SOURCE_ATTR = "_shoal_packed_source"
_ALLOCATION_ATTR = "_shoal_packed_allocation"
_FILE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_WEIGHTS_DTYPE_ATTR = "_shoal_weights_dtype"
WEIGHTS_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes this path loads weights in (the products' panels; the rest float32)."""


def get_skip_reason(model_dir: Path, config: Any, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `load_packed` does not load this model (None: it may; it can still decline)."""
    if device.type != "cpu" or dtype not in WEIGHTS_DTYPES:
        return f"{dtype} on {device} (packed load: float32 or bfloat16 on the CPU)"
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r}"
    if not (model_dir / WEIGHTS_FILE).is_file():
        return f"no single {WEIGHTS_FILE}"
    return None


class _Allocation:
    """Consecutive 64-byte-aligned float32 (or bfloat16) tensors cut from one buffer."""

    def __init__(self, num_floats: int) -> None:
        self.buffer = allocate_weights(num_floats)
        self.used = 0

    def take(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        num_elements = math.prod(shape)
        num_floats = _get_floats(num_elements, dtype)
        start = self.used
        self.used += _get_aligned_floats(num_floats)
        assert self.used <= self.buffer.numel(), "the allocation was sized for every tensor it holds"
        return self.buffer[start : start + num_floats].view(dtype)[:num_elements].view(*shape)


def _get_floats(num_elements: int, dtype: torch.dtype) -> int:
    """Float32 slots that hold `num_elements` of `dtype` (float32 or bfloat16)."""
    return -(-num_elements * dtype.itemsize // 4)


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
    advise(start, (address + raw.numel() - start) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, MADV_HUGEPAGE)
    offset = start - address
    return raw[offset : offset + num_bytes].view(torch.float32)


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
        if len(self._mapping) < 8 or 8 + header_bytes > len(self._mapping):
            raise ValueError(f"{path} is not a safetensors file (its header runs past its end)")
        header = json.loads(self._mapping[8 : 8 + header_bytes])
        header.pop("__metadata__", None)
        self._bytes = torch.frombuffer(self._mapping, dtype=torch.uint8)
        data_start = 8 + header_bytes
        self.entries = {
            name: (entry["dtype"], tuple(entry["shape"]), data_start + entry["data_offsets"][0],
                   data_start + entry["data_offsets"][1])
            for name, entry in header.items()
        }
        for name, (dtype, shape, begin, end) in self.entries.items():
            size = _FILE_DTYPES[dtype].itemsize * math.prod(shape) if dtype in _FILE_DTYPES else end - begin
            if not data_start <= begin <= end <= len(self._mapping) or end - begin != size:
                raise ValueError(f"{path}: {name}'s bytes are not where its header says (a truncated file?)")

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` (a view of the mapping; float32, float16 or bfloat16)."""
        dtype, shape, begin, end = self.entries[name]
        if dtype not in _FILE_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} is not one Shoal reads")
        return self._bytes[begin:end].view(_FILE_DTYPES[dtype]).view(shape)

    def join(self, names: list[str]) -> torch.Tensor | None:
        """The matrices `names` stacked by rows, as one view when each follows the previous in
        the file and all have one dtype (None otherwise)."""
        spans = [self.entries[name] for name in names]
        if any(end != next_begin for (_, _, _, end), (_, _, next_begin, _) in itertools.pairwise(spans)):
            return None
        if len({dtype for dtype, _, _, _ in spans}) != 1 or spans[0][0] not in _FILE_DTYPES:
            return None
        num_rows = sum(shape[0] for _, shape, _, _ in spans)
        dtype = _FILE_DTYPES[spans[0][0]]
        return self._bytes[spans[0][2] : spans[-1][3]].view(dtype).view(num_rows, spans[0][1][1])


def load_packed(
    model_dir: Path, config: Any, *, attn_implementation: str | None, weights_dtype: torch.dtype = torch.float32
) -> tuple[Any, int] | None:
    """The model of `model_dir` with its products packed for the native forward, and the bytes
    its weights take (as `loader.model_weight_bytes` counts them in an ordinary load; the
    products' at 2 bytes each with bfloat16 weights), or None when this path does not take
    it: `start_load` then `PendingLoad.finish`."""
    pending = start_load(model_dir, config, weights_dtype=weights_dtype)
    return None if pending is None else pending.finish(config, attn_implementation=attn_implementation)


_Product = tuple[list[str], bool]
"""A packed product: its modules' names (q/k/v, gate/up: several, joined by rows) and
whether it is a gate/up pair (the SiLU * up epilogue)."""


def get_products(num_layers: int, tied: bool) -> list[_Product]:
    """The packed products of a Llama-style decoder, in `PackedModel.linears`' order."""
    products: list[_Product] = []
    for index in range(num_layers):
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


def start_load(model_dir: Path, config: Any, *, weights_dtype: torch.dtype = torch.float32) -> PendingLoad | None:
    """Starts copying `model_dir`'s weights into their places, on the copy threads (`get_copy_pool`),
    and returns at once: the caller reads the tokenizer meanwhile, then calls `finish`. None
    when the file is not what this path reads (float32 tensors, or float32 and bfloat16 ones
    for bfloat16 `weights_dtype`; the products of a Llama-style decoder of `config`'s layers);
    `get_skip_reason` is asked first."""
    kernels = cpu_kernels.try_load()
    if kernels is None or weights_dtype not in WEIGHTS_DTYPES:
        return None
    weights_file = WeightsFile(model_dir / WEIGHTS_FILE)
    entries = weights_file.entries
    products = get_products(int(config.num_hidden_layers), tied="lm_head.weight" not in entries)
    weight_names = [m + ".weight" for modules, _ in products for m in modules]
    file_dtypes = {"F32", "BF16"} if weights_dtype == torch.bfloat16 else {"F32"}
    if any(dtype not in file_dtypes for dtype, _, _, _ in entries.values()) or any(
        name not in entries or len(entries[name][1]) != 2 for name in weight_names
    ):
        log.info("packed_load.declined", reason=f"not {weights_dtype}, or not the products of a Llama-style decoder")
        return None
    rounded = weights_dtype == torch.bfloat16
    product_tensors = {module + suffix for modules, _ in products for module in modules for suffix in (".weight", ".bias")}
    plain = [name for name in entries if name not in product_tensors]
    num_floats = sum(_get_aligned_floats(weights_file.get(name).numel()) for name in plain)
    for modules, _ in products:
        num_out = sum(entries[m + ".weight"][1][0] for m in modules)
        num_panel_elements = get_num_panels(num_out) * entries[modules[0] + ".weight"][1][1] * PANEL
        num_floats += _get_aligned_floats(_get_floats(num_panel_elements, weights_dtype))
        if any(m + ".bias" in entries for m in modules):
            num_floats += _get_aligned_floats(num_out)
    allocation = _Allocation(num_floats)
    jobs: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (weight rows, their panels, silu_mul)
    packed = [_plan_product(allocation, kernels, weights_file, modules, silu_mul, jobs, weights_dtype)
              for modules, silu_mul in products]
    copies = {name: allocation.take(*weights_file.get(name).shape) for name in plain}
    pool = get_copy_pool()
    futures = [pool.submit(pack_into, kernels, weight, panels, silu_mul=silu_mul) for weight, panels, silu_mul in jobs]
    futures += [pool.submit(copy_weight, target, weights_file.get(name), rounded=rounded)
                for name, target in copies.items()]
    shapes = {name: shape for name, (_, shape, _, _) in entries.items()}
    return PendingLoad(model_dir / WEIGHTS_FILE, products, packed, copies, futures, shapes, allocation.buffer,
                       weights_dtype)


def copy_weight(target: torch.Tensor, source: torch.Tensor, *, rounded: bool = False) -> None:
    """target = source (converted to target's dtype); `rounded`: source rounded to bfloat16 first."""
    with torch.no_grad():
        target.copy_(source.to(torch.bfloat16) if rounded else source)


@dataclass
class PendingLoad:
    """A load whose copies are under way (`start_load`)."""

    path: Path
    products: list[_Product]
    packed: list[PackedLinear]
    """The products' packed weights, in `products`' order (their panels being filled)."""
    copies: dict[str, torch.Tensor]
    """The other tensors (embedding, norms): where they are being copied."""
    futures: list[Future[None]]
    shapes: dict[str, tuple[int, ...]]
    """Every tensor of the file: the model's parameters must be these."""
    allocation: torch.Tensor
    """The one buffer every weight lives in (`allocate_weights`)."""
    weights_dtype: torch.dtype = torch.float32
    """The panels' dtype (bfloat16: every weight rounded to it, `get_weights_dtype`)."""

    def wait(self) -> None:
        """Until every copy is done (raising the first copy's error, if one failed)."""
        for future in self.futures:
            future.result()

    def finish(self, config: Any, *, attn_implementation: str | None) -> tuple[Any, int] | None:
        """The model (its modules built on the meta device, given the copies as parameters and
        the packed products) and its weight bytes, once the copies are done; None when the
        file's tensors are not the model's parameters or `get_unsupported_reason` has one."""
        kwargs: dict[str, Any] = {"dtype": torch.float32, "trust_remote_code": False}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        # No initialisation either (a uniform_ per product, even on meta tensors: 40 ms for
        # llama-100m on a busy host); transformers' own loads patch it out the same way.
        with no_init_weights(), torch.device("meta"):
            model: Any = AutoModelForCausalLM.from_config(config, **kwargs)
        model.tie_weights()  # which the patched initialisation skips
        inner = model.model
        inner.rotary_emb = type(inner.rotary_emb)(config=model.config)  # its buffers, computed on the CPU
        parameters = dict(model.named_parameters())
        mismatch = sorted(set(self.shapes) ^ set(parameters)) or [
            name for name, shape in self.shapes.items() if shape != tuple(parameters[name].shape)
        ]
        tied = model.lm_head.weight is inner.embed_tokens.weight  # else lm_head.weight was one more name
        self.wait()
        if mismatch:
            log.info("packed_load.declined", reason="the file's tensors are not the model's parameters",
                     names=mismatch[:5])
            return None
        product_weights = {m + ".weight" for modules, _ in self.products for m in modules}
        product_bytes = self.weights_dtype.itemsize
        weight_bytes = sum(p.numel() * (product_bytes if name in product_weights else 4)
                           for name, p in parameters.items()) + sum(
            b.numel() * b.element_size() for b in model.buffers()
        )
        for name, target in self.copies.items():  # embedding, norms: the only copy
            _set_parameter(model, name, target)
        if tied:
            model.lm_head.weight = inner.embed_tokens.weight
        for modules, _ in self.products:
            for module_name in modules:
                module = model.get_submodule(module_name)
                module.weight = _released(module.weight)
                if module.bias is not None:
                    module.bias = _released(module.bias)
        packed = self.packed
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
        reason = get_unsupported_reason(model)
        if reason is not None:  # the config's other checks: back to the ordinary path
            log.info("packed_load.declined", reason=reason)
            return None
        setattr(model, _SOURCE_ATTR, self.path)
        setattr(model, _ALLOCATION_ATTR, self.allocation)
        setattr(model, _WEIGHTS_DTYPE_ATTR, self.weights_dtype)
        model.eval()
        return model, weight_bytes


def _plan_product(
    allocation: _Allocation,
    kernels: cpu_kernels.CpuKernels,
    weights_file: WeightsFile,
    modules: list[str],
    silu_mul: bool,
    jobs: list[tuple[torch.Tensor, torch.Tensor, bool]],
    weights_dtype: torch.dtype,
) -> PackedLinear:
    """Takes the product's panels (and bias) from `allocation`, adds the copies that fill its
    panels to `jobs` (`add_pack_jobs`) and copies its bias."""
    names = [m + ".weight" for m in modules]
    num_out, num_in = sum(weights_file.entries[n][1][0] for n in names), weights_file.entries[names[0]][1][1]
    panels = allocation.take(get_num_panels(num_out) * num_in * PANEL, dtype=weights_dtype)
    add_pack_jobs(weights_file, names, panels, silu_mul, jobs)
    bias = None
    if any(m + ".bias" in weights_file.entries for m in modules):
        bias = allocation.take(num_out)
        fill_bias(weights_file, modules, bias, rounded=weights_dtype == torch.bfloat16)
    return PackedLinear.from_panels(
        kernels, panels, bias, num_out=num_out, num_in=num_in,
        epilogue=EPILOGUE_SILU_MUL if silu_mul else EPILOGUE_STORE,
    )


def add_pack_jobs(
    weights_file: WeightsFile,
    names: list[str],
    panels: torch.Tensor,
    silu_mul: bool,
    jobs: list[tuple[torch.Tensor, torch.Tensor, bool]],
) -> None:
    """Adds the copies that fill `panels` with the weights `names` (joined by rows) to `jobs`:
    one per weight, each straight from the mapping, when every weight but the last fills whole
    panels (q/k/v) or the weights lie next to each other in the file (gate/up); else one copy
    of the weights joined first. Float32 panels take float32 weights, bfloat16 panels float32
    or bfloat16 ones (`pack_into`); weights in another dtype, or in several, are converted to
    float32 first."""
    weights = [weights_file.get(name) for name in names]
    taken = (torch.float32, torch.bfloat16) if panels.dtype == torch.bfloat16 else (torch.float32,)
    if len({w.dtype for w in weights}) != 1 or weights[0].dtype not in taken:
        weights = [w.to(torch.float32) for w in weights]
        jobs.append((weights[0] if len(weights) == 1 else torch.cat(weights), panels, silu_mul))
        return
    num_in = weights[0].shape[1]
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


def fill_bias(weights_file: WeightsFile, modules: list[str], bias: torch.Tensor, *, rounded: bool = False) -> None:
    """Copies the modules' biases into `bias`, joined by rows (zeros for a module without one);
    `rounded`: the values rounded to bfloat16."""
    row = 0
    for module in modules:
        num_rows = weights_file.entries[module + ".weight"][1][0]
        part = bias[row : row + num_rows]
        if module + ".bias" in weights_file.entries:
            copy_weight(part, weights_file.get(module + ".bias"), rounded=rounded)
        else:
            part.zero_()
        row += num_rows


def get_weights_dtype(model: Any) -> torch.dtype:
    """The dtype a model loaded here holds its weights in: bfloat16 (every weight rounded to it;
    the products' panels bfloat16, the other tensors float32) or float32 (also a model loaded
    the ordinary way)."""
    return getattr(model, _WEIGHTS_DTYPE_ATTR, torch.float32)


def get_allocation(model: Any) -> torch.Tensor | None:
    """The buffer a model loaded here keeps every weight in (None: not loaded here)."""
    return getattr(model, _ALLOCATION_ATTR, None)


_pool: ThreadPoolExecutor | None = None


def get_copy_pool() -> ThreadPoolExecutor:
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
    rounded = get_weights_dtype(model) == torch.bfloat16
    with torch.no_grad():
        for name in weights_file.entries:
            parameter = parameters.get(name)
            if parameter is not None and parameter.numel() == 0:
                value = weights_file.get(name)
                # float32, as the rest of the model (with bfloat16 weights: their values, rounded)
                parameter.data = value.to(torch.bfloat16).float() if rounded else value.float().clone()
    delattr(model, _SOURCE_ATTR)
    return True

