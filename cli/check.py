"""``shoal check``: what would go wrong with a configuration, found before anything starts.

An operator runs it before a restart (as ``nginx -t`` or ``promtool check config``): the
config file parses and validates (load_config), the admin API is not left open to the
network, each model's files are readable under the models root, and each model fits this
node's GPUs by the scheduler's own placement rules (shared/placement): one replica at all,
and the replicas kept up (``min_replicas``) all together.
It reads model configs only (no weights, no NATS) and exits 1 when something is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TextIO

from shoal.services.gateway.auth import check_admin_exposure
from shoal.services.node_agent.gpus import GpuDiscoveryError, discover_gpus
from shoal.services.node_agent.model_files import ModelInspectionError, inspect_model
from shoal.shared.config import ConfigError, ShoalConfig
from shoal.shared.messages import InspectModel, ModelSpec
from shoal.shared.model_settings import max_model_len_error
from shoal.shared.placement.config import PlacementConfig
from shoal.shared.placement.memory_figure import UnknownModelMemory, get_memory_figure
from shoal.shared.placement.node_eval import count_whole_gpus, get_multi_gpu_need, get_single_gpu_allocation
from shoal.shared.placement.snapshot import ModelDemand

Level = Literal["ok", "warning", "error"]
GIB = 1 << 30


@dataclass(frozen=True)
class Finding:
    level: Level
    subject: str
    message: str


def check(config: ShoalConfig, specs: list[ModelSpec]) -> list[Finding]:
    """Every finding on `config` and the models it serves (`specs`), worst first."""
    findings = [_admin_exposure(config)]
    try:
        gpus = discover_gpus(config.node.gpus)
    except (GpuDiscoveryError, ConfigError) as exc:
        findings.append(Finding("error", "gpus", f"{exc}: the node agent cannot start; model fit not checked"))
        totals: list[int] = []
        virtual = config.node.gpus.startswith("virtual:")
    else:
        totals = sorted((gpu.total_bytes for gpu in gpus.gpus), reverse=True)
        virtual = gpus.virtual
        findings.append(Finding("ok", "gpus", f"{len(totals)} {'virtual' if virtual else 'NVIDIA'} GPU(s): "
                                f"{', '.join(f'{size / GIB:.1f} GiB' for size in totals)}"))
    demands: list[ModelDemand] = []
    for spec in specs:
        finding, demand = _model(config, spec, totals, on_cpu=virtual)
        findings.append(finding)
        if demand is not None:
            demands.append(demand)
    if totals:
        findings.append(_kept_up(demands, totals, config.scheduler.placement))
    order = {"error": 0, "warning": 1, "ok": 2}
    return sorted(findings, key=lambda finding: order[finding.level])


def unservable_models(config: ShoalConfig, specs: list[ModelSpec]) -> list[Finding]:
    """The models `shoal up` refuses to start with, as vLLM refuses a model it cannot load:
    files not readable under the models root (a path that does not exist, a config that does
    not parse), or a replica larger than every GPU of this node. Started anyway, their requests
    would get 503s that say "retry" for ever."""
    try:
        gpus = discover_gpus(config.node.gpus)
    except (GpuDiscoveryError, ConfigError):
        return []  # the node agent says so when it starts
    totals = sorted((gpu.total_bytes for gpu in gpus.gpus), reverse=True)
    findings = [_model(config, spec, totals, on_cpu=gpus.virtual)[0] for spec in specs]
    return [finding for finding in findings if finding.level == "error"]


def _admin_exposure(config: ShoalConfig) -> Finding:
    try:
        warning = check_admin_exposure(config.gateway)
    except ConfigError as exc:
        return Finding("error", "gateway", str(exc))
    return Finding("warning", "gateway", warning) if warning else Finding("ok", "gateway", "the admin API is guarded")


def _model(config: ShoalConfig, spec: ModelSpec, totals: list[int], *, on_cpu: bool
           ) -> tuple[Finding, ModelDemand | None]:
    """A model's finding: its files read, and whether one replica can be placed on GPUs of
    `totals` bytes (largest first), by the scheduler's own rules."""
    command = InspectModel(spec.path, spec.dtype, spec.kv_cache_tokens)
    try:
        facts = inspect_model(config.node.models_root, command, config.worker.runtime_overhead_bytes, on_cpu=on_cpu)
        figure = get_memory_figure(weight_bytes=facts.weight_bytes, config=config.scheduler.placement,
                                   override_bytes=spec.memory_override_bytes, estimated_bytes=facts.estimated_bytes)
    except (ModelInspectionError, UnknownModelMemory, ValueError) as exc:
        return Finding("error", spec.key, str(exc)), None
    if error := max_model_len_error(spec.max_model_len, facts.max_model_len):
        return Finding("error", spec.key, error), None
    demand = ModelDemand(spec.key, figure, spec.min_replicas, spec.fairness.popular, spec.num_gpus)
    what = (f"{facts.architecture}, {facts.num_parameters / 1e6:.1f}M parameters, needs "
            f"{figure.required_bytes / GIB:.2f} GiB ({figure.source})")
    if totals and _reserve(demand, [(total, total) for total in totals], config.scheduler.placement) is None:
        return Finding("error", spec.key, f"{what}: it never fits: this node's {len(totals)} GPU(s) of "
                       f"{totals[0] / GIB:.2f} GiB at most cannot hold one replica"
                       + (f" on {spec.num_gpus} GPUs" if spec.num_gpus > 1 else "")), demand
    return Finding("ok", spec.key, what), demand


def _reserve(demand: ModelDemand, gpus: list[tuple[int, int]], config: PlacementConfig) -> list[tuple[int, int]] | None:
    """`gpus` ((total, free) bytes each, largest first) after placing one replica of `demand`
    as the scheduler reserves it — a share of one GPU, one whole GPU, or several whole
    GPUs — first fit; None when it fits nowhere."""
    for index, (total, free) in enumerate(gpus):
        allocation = get_single_gpu_allocation(demand, total, config)
        if allocation is not None and allocation[1] <= free and (allocation[0] != "full_gpu" or free == total):
            return [*gpus[:index], (total, free - allocation[1]), *gpus[index + 1:]]
    whole = [index for index, (total, free) in enumerate(gpus) if free == total]
    need_bytes, num_extra = get_multi_gpu_need(demand, config)
    num_gpus = count_whole_gpus([gpus[index][0] for index in whole], need_bytes, num_extra, demand.min_num_gpus)
    if num_gpus is None:
        return None
    taken = set(whole[:num_gpus])
    return [(total, 0 if index in taken else free) for index, (total, free) in enumerate(gpus)]


def _kept_up(demands: list[ModelDemand], totals: list[int], config: PlacementConfig) -> Finding:
    """Whether the replicas every model keeps up (``min_replicas``) fit this node's GPUs
    together, largest first, first fit (the scheduler's search may do better: a warning);
    the other models sleep and wake in turn."""
    replicas = sorted((demand for demand in demands for _ in range(demand.desired_replicas)),
                      key=lambda demand: -demand.figure.required_bytes)
    gpus: list[tuple[int, int]] = [(total, total) for total in totals]
    for demand in replicas:
        placed = _reserve(demand, gpus, config)
        if placed is None:
            need = sum(replica.figure.required_bytes for replica in replicas) / GIB
            return Finding("warning", "min_replicas", f"the replicas kept up ({len(replicas)}, {need:.2f} GiB) do "
                           f"not all fit this node's GPUs ({sum(totals) / GIB:.2f} GiB): {demand.model} is left "
                           "out unless other nodes take some")
        gpus = placed
    used = sum(total - free for total, free in gpus)
    return Finding("ok", "min_replicas", f"{len(replicas)} replica(s) kept up fit this node's GPUs"
                   + (f" ({used / GIB:.2f} GiB of {sum(totals) / GIB:.2f} reserved)" if replicas else ""))


def report(findings: list[Finding], out: TextIO) -> int:
    """Print `findings`; the exit status: 1 when one is an error."""
    width = max((len(finding.subject) for finding in findings), default=0)
    for finding in findings:
        print(f"{finding.level:<8} {finding.subject:<{width}}  {finding.message}", file=out)
    errors = sum(finding.level == "error" for finding in findings)
    warnings = sum(finding.level == "warning" for finding in findings)
    print(f"{errors} error(s), {warnings} warning(s)", file=out)
    return 1 if errors else 0
