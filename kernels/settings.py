"""The kernels' settings: one typed Struct, applied process-wide by `configure`.

Shoal's configuration nests `KernelSettings` under the worker's section
(``[worker.kernels]`` in ``shoal.toml``, ``SHOAL_WORKER_KERNELS_<FIELD>`` in the
environment) and the worker calls `configure` when it starts, before its engine
builds or loads any kernel. No kernel module reads Shoal's environment variables
itself. The defaults are what a process that never calls `configure` runs with.

This module imports neither torch nor any kernel module: the config loader imports
it. The kernel modules that cache a decision made from the settings (which CPU
library is loaded, whether CUDA tensors go to the kernels) subscribe to changes
with `on_configure`.
"""

from __future__ import annotations

import threading
import typing
from collections.abc import Callable
from typing import Literal

import msgspec

CudaOps = Literal["kernels", "reference"]
CpuOps = Literal["native", "torch"]


class KernelSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How the KV-cache ops run: which implementation serves each device, and what is checked."""

    cuda: CudaOps = "kernels"
    """What runs the ops on CUDA tensors. ``kernels``: Shoal's CUDA kernels, built when the
    worker starts (a worker whose kernels do not build refuses to start, with the
    compiler's message). ``reference``: the torch implementation, much slower (it gathers
    every context token's K/V per layer and step); for debugging, or a machine where the
    kernels cannot be built. Was ``SHOAL_KERNELS``."""

    cpu: CpuOps = "native"
    """What runs `write_kv` and decode attention on CPU tensors. ``native``: the C kernels
    (kernels/csrc/*.c), built by the machine's C compiler on first use; where they cannot
    be built or loaded the torch implementation serves and the reason is logged.
    ``torch``: the torch implementation only, nothing is compiled. Was
    ``SHOAL_CPU_KERNELS``."""

    cpu_attention: CpuOps = "native"
    """What runs decode attention on CPU tensors while `cpu` is ``native``: ``native``, the
    C kernel that reads K/V straight from the blocks, or ``torch``, the torch decode
    groups (gather, then SDPA), with the native `write_kv` still on. Was
    ``SHOAL_CPU_ATTENTION``."""

    check_cuda_indices: bool = False
    """Check the index values of every `paged_attention` call on CUDA tensors on the host
    before the launch, as the CPU path always does (``query_start_loc`` from 0 to the
    query's rows and never decreasing, ``q_len <= seq_len``, ``seq_len`` within its block
    table row), raising `KVContractError`. It copies the index tensors to the host, which
    synchronizes the stream on every call and layer: for debugging. Off, the kernel stops
    with a device-side assert on those mistakes (docs/kernels.md). New: no variable
    before."""

    def __post_init__(self) -> None:
        # msgspec validates types when it decodes or converts (the config loader), not when
        # the Struct is built in code: check here so both get the same clear error.
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"kernels.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}"
                )
        if not isinstance(self.check_cuda_indices, bool):
            raise ValueError(f"kernels.check_cuda_indices must be true or false, got {self.check_cuda_indices!r}")


_CHOICES: dict[str, tuple[str, ...]] = {
    name: typing.get_args(hint)
    for name, hint in typing.get_type_hints(KernelSettings).items()
    if typing.get_origin(hint) is Literal
}
"""Each Literal field's allowed values, read from the annotations."""

Listener = Callable[[KernelSettings, KernelSettings], None]
"""Called with (previous, new) settings after each `configure`."""

_lock = threading.Lock()
_current = KernelSettings()
_listeners: list[Listener] = []


def configure(settings: KernelSettings) -> None:
    """Applies `settings` to this process's kernels, from the next op on.

    The worker calls it once at start, before building its engine. Calling it again
    (tests, benchmarks) replaces the settings: a changed CPU choice is made anew by
    the next op, which loads (or builds) the native library or drops it.

    Args:
        settings: the kernels' settings (``[worker.kernels]`` of Shoal's configuration).

    Raises:
        TypeError: `settings` is not a `KernelSettings`.
    """
    global _current
    if not isinstance(settings, KernelSettings):
        raise TypeError(f"configure takes a KernelSettings, got {type(settings).__name__}")
    with _lock:
        previous, _current = _current, settings
        listeners = list(_listeners)
    for listener in listeners:
        listener(previous, settings)


def get_settings() -> KernelSettings:
    """The settings the kernels run with now: the last `configure`'s, or the defaults."""
    return _current


def on_configure(listener: Listener) -> Callable[[], None]:
    """Calls `listener(previous, new)` after every later `configure` (for kernel modules that
    cache a decision made from the settings).

    Returns:
        A function that stops the calls.
    """
    with _lock:
        _listeners.append(listener)

    def remove() -> None:
        with _lock:
            _listeners.remove(listener)

    return remove
