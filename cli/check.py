"""``shoal check``: what would go wrong with a configuration, found before anything starts.

An operator runs it before a restart (as ``nginx -t`` or ``promtool check config``): the
config file parses and validates (load_config), the admin API is not left open to the
network, each model's files are readable under the models root, and each model fits this
node's GPUs: one replica at all, and the replicas kept up (``min_replicas``) all together.
It reads model configs only (no weights, no NATS) and exits 1 when something is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, TextIO

from shoal.services.gateway.auth import check_admin_exposure
from shoal.services.node_agent.gpus import GpuDiscoveryError, discover_gpus
from shoal.services.node_agent.model_files import ModelInspectionError, inspect_model
from shoal.shared.config import ConfigError, ShoalConfig
from shoal.shared.messages import InspectModel, ModelSpec
from shoal.shared.placement.memory_figure import get_memory_figure

Level = Literal["ok", "warning", "error"]
GIB = 1 << 30


@dataclass(frozen=True)
class Finding:
    level: Level
    subject: str
    message: str


@dataclass(frozen=True)
class _Sized:
    spec: ModelSpec
    required_bytes: int
    """One replica's GPU bytes, all its GPUs together."""

    @property
    def per_gpu_bytes(self) -> int:
        return math.ceil(self.required_bytes / self.spec.num_gpus)


def check(config: ShoalConfig, specs: list[ModelSpec]) -> list[Finding]:
    """Every finding on `config` and the models it serves (`specs`), worst first."""
    findings = [_admin_exposure(config)]
    try:
        gpus = discover_gpus(config.node.gpus)
    except (GpuDiscoveryError, ConfigError) as exc:
        findings.append(Finding("warning", "gpus", f"{exc}; model fit not checked"))
        gpu_bytes: list[int] = []
    else:
        gpu_bytes = [gpu.total_bytes for gpu in gpus.gpus]
        kind = "virtual" if gpus.virtual else "NVIDIA"
        findings.append(Finding("ok", "gpus", f"{len(gpu_bytes)} {kind} GPU(s): "
                                f"{', '.join(f'{size / GIB:.1f} GiB' for size in gpu_bytes)}"))
    usable = [int(size * config.scheduler.placement.max_gpu_memory_fraction) for size in gpu_bytes]
    sized: list[_Sized] = []
    for spec in specs:
        finding, size = _model(config, spec, usable, on_cpu=not gpu_bytes or _virtual(config))
        findings.append(finding)
        if size is not None:
            sized.append(size)
    if usable:
        findings.append(_kept_up(sized, usable))
    order = {"error": 0, "warning": 1, "ok": 2}
    return sorted(findings, key=lambda finding: order[finding.level])


def _virtual(config: ShoalConfig) -> bool:
    return config.node.gpus.startswith("virtual:")


def _admin_exposure(config: ShoalConfig) -> Finding:
    try:
        warning = check_admin_exposure(config.gateway)
    except ConfigError as exc:
        return Finding("error", "gateway", str(exc))
    return Finding("warning", "gateway", warning) if warning else Finding("ok", "gateway", "the admin API is guarded")


def _model(config: ShoalConfig, spec: ModelSpec, usable: list[int], *, on_cpu: bool
           ) -> tuple[Finding, _Sized | None]:
    """A model's finding: its files read, and whether one replica fits a GPU of `usable` bytes."""
    command = InspectModel(spec.path, spec.dtype, spec.kv_cache_tokens)
    try:
        facts = inspect_model(config.node.models_root, command, config.worker.runtime_overhead_bytes, on_cpu=on_cpu)
    except (ModelInspectionError, ValueError) as exc:
        return Finding("error", spec.key, str(exc)), None
    figure = get_memory_figure(weight_bytes=facts.weight_bytes, config=config.scheduler.placement,
                               override_bytes=spec.memory_override_bytes, estimated_bytes=facts.estimated_bytes)
    size = _Sized(spec, figure.required_bytes)
    what = (f"{facts.architecture}, {facts.num_parameters / 1e6:.1f}M parameters, needs "
            f"{figure.required_bytes / GIB:.2f} GiB ({figure.source})")
    if not usable:
        return Finding("ok", spec.key, what), size
    fitting = sorted((room for room in usable if room >= size.per_gpu_bytes), reverse=True)
    if len(fitting) < spec.num_gpus:
        gpus = f"{spec.num_gpus} GPUs with {size.per_gpu_bytes / GIB:.2f} GiB each" if spec.num_gpus > 1 else \
            f"a GPU with {size.per_gpu_bytes / GIB:.2f} GiB"
        return Finding("error", spec.key, f"{what}: it never fits: one replica needs {gpus}; this node has "
                       f"{len(usable)} GPU(s) taking at most {max(usable) / GIB:.2f} GiB "
                       "(placement.max_gpu_memory_fraction of each)"), size
    return Finding("ok", spec.key, what), size


def _kept_up(sized: list[_Sized], usable: list[int]) -> Finding:
    """Whether the replicas of every model's ``min_replicas`` fit this node's GPUs together
    (first fit, largest first: the scheduler packs no worse); the rest sleep and wake in turn."""
    replicas = sorted(((size.spec.key, size.per_gpu_bytes, size.spec.num_gpus)
                       for size in sized for _ in range(size.spec.min_replicas)), key=lambda r: -r[1])
    room = list(usable)
    for key, per_gpu, num_gpus in replicas:
        chosen = [index for index in sorted(range(len(room)), key=lambda i: -room[i]) if room[index] >= per_gpu]
        if len(chosen) < num_gpus:
            need = sum(per_gpu * n for _, per_gpu, n in replicas) / GIB
            return Finding("warning", "min_replicas", f"the replicas kept up ({len(replicas)}, {need:.2f} GiB) do "
                           f"not all fit this node's GPUs ({sum(usable) / GIB:.2f} GiB usable): {key} is left out "
                           "unless other nodes take some")
        for index in chosen[:num_gpus]:
            room[index] -= per_gpu
    return Finding("ok", "min_replicas", f"{len(replicas)} replica(s) kept up fit this node's GPUs"
                   + (f" ({(sum(usable) - sum(room)) / GIB:.2f} GiB of {sum(usable) / GIB:.2f})" if replicas else ""))


def report(findings: list[Finding], out: TextIO) -> int:
    """Print `findings`; the exit status: 1 when one is an error."""
    width = max((len(finding.subject) for finding in findings), default=0)
    for finding in findings:
        print(f"{finding.level:<8} {finding.subject:<{width}}  {finding.message}", file=out)
    errors = sum(finding.level == "error" for finding in findings)
    warnings = sum(finding.level == "warning" for finding in findings)
    print(f"{errors} error(s), {warnings} warning(s)", file=out)
    return 1 if errors else 0
