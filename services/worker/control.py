"""The worker's control endpoints: park WARM (to_cache) and come back (from_cache).

Served as the ``shoal-worker`` micro service on ``shoal.worker.<replica id>.<verb>``,
called by the replica's node agent. Parking raises the barrier first (no new
requests; in-flight ones drain up to the drain timeout), suspends the engine (its KV pool
freed, everything cached in it forgotten, the rest kept), and moves the weights to CPU RAM
(or, told to drop them, gives their memory back: `weight_drop`); restoring reloads dropped
weights from the model's files, moves them onto the new allocation, resumes the kept engine
when the allocation is the one it was sized for (else builds a fresh one), and serves again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from nats.micro import add_service
from nats.micro.service import Service

from shoal.kernels.cuda_ext import KernelBuildError
from shoal.services.worker.generation import Engine, SuspendableEngine
from shoal.services.worker.loader import (
    LoadedModel,
    MinEngineBytes,
    ModelLoadError,
    park_weights,
    restore_weights,
    resume_engine,
)
from shoal.services.worker.service import WorkerService
from shoal.services.worker.weight_drop import DroppedWeights, drop_weights, reload_weights
from shoal.shared.bus import Bus
from shoal.shared.messages import (
    CacheReplica,
    PingWorker,
    ReplicaRecord,
    RestoreReplica,
    WorkerReply,
    cache_replica_decoder,
    ping_worker_decoder,
    restore_replica_decoder,
)
from shoal.shared.micro import RequestError, add_json_endpoint
from shoal.shared.subjects import worker_subject
from shoal.shared.version import SHOAL_VERSION

log = structlog.get_logger(__name__)

EngineFactory = Callable[[LoadedModel], tuple[Engine, int]]
"""Rebuilds an engine for the loaded model's new allocation after a park; returns it and the bytes it
holds."""


def measure_residual_bytes(loaded: LoadedModel) -> int:
    """What a parked replica still holds on its GPU as torch sees it (its node agent adds the
    CUDA context with NVML); nothing on a virtual GPU, whose tensors live in host RAM."""
    if loaded.device.type != "cuda":
        return 0
    import torch

    return int(torch.cuda.memory_reserved(loaded.device))


@dataclass
class ReplicaRuntime:
    """What a serving replica holds, and how it parks and comes back."""

    replica: ReplicaRecord
    loaded: LoadedModel
    engine: Engine | None
    service: WorkerService
    build_engine: EngineFactory
    measure: Callable[[LoadedModel, int], int]
    drain_timeout_s: float = 30.0
    min_engine_bytes: MinEngineBytes = 0
    """What the engine needs besides the weights: checked before a restore rebuilds it."""
    dropped: DroppedWeights | None = None
    """Set while parked cold: the weights are dropped, a restore reloads them first."""
    suspended: SuspendableEngine | None = None
    """While parked: the engine kept across the sleep (its device memory freed), resumed by a
    restore onto the same allocation instead of building a new one."""

    async def to_cache(self, *, drop: bool = False) -> WorkerReply:
        if self.engine is None and (not drop or self.dropped is not None):
            return WorkerReply(ok=True, message="already parked", weights_dropped=self.dropped is not None)
        if self.engine is not None:
            await self.service.pause(self.drain_timeout_s)
            engine, self.engine = self.engine, None
            if isinstance(engine, SuspendableEngine):
                await engine.suspend()
                self.suspended = engine
            else:
                await engine.close()
        message = "parked"
        if drop:
            try:
                self.dropped = await asyncio.to_thread(drop_weights, self.loaded)
                message = "parked, weights dropped"
            except ModelLoadError as exc:  # nothing dropped: it sleeps warm
                log.warning("weights_kept", error=str(exc))
                message = f"parked, weights kept: {exc}"
        await asyncio.to_thread(park_weights, self.loaded, self.replica)
        residual_bytes = measure_residual_bytes(self.loaded)
        log.info("replica_parked", residual_bytes=residual_bytes, weights_dropped=self.dropped is not None)
        return WorkerReply(ok=True, message=message, residual_bytes=residual_bytes,
                           weights_dropped=self.dropped is not None)

    async def from_cache(self, replica: ReplicaRecord) -> WorkerReply:
        if self.engine is not None:
            return WorkerReply(ok=True, message="already serving")
        try:
            if self.dropped is not None:
                await asyncio.to_thread(reload_weights, self.loaded, self.dropped)
                self.dropped = None
            await asyncio.to_thread(
                restore_weights, self.loaded, replica, min_kv_reserve_bytes=self.min_engine_bytes
            )
            engine, engine_bytes = await self._resume_or_build(replica)
        except (ModelLoadError, KernelBuildError, MemoryError) as exc:
            raise RequestError(507, f"cannot restore on the new allocation: {exc}") from exc
        self.replica, self.engine = replica, engine
        self.service.resume(engine)
        measured = self.measure(self.loaded, engine_bytes)
        log.info("replica_restored", measured_bytes=measured)
        return WorkerReply(ok=True, message="serving", measured_bytes=measured)

    async def _resume_or_build(self, replica: ReplicaRecord) -> tuple[Engine, int]:
        """The engine kept across the sleep when the wake is onto the allocation it was sized
        for (the same GPUs, the same bytes on each: the same pool on the same devices), else
        a new one (the kept one closed)."""
        kept, self.suspended = self.suspended, None
        if kept is not None and replica.gpu_bytes == self.replica.gpu_bytes:
            await asyncio.to_thread(resume_engine, kept, self.loaded)
            return kept, kept.held_bytes
        if kept is not None:
            await kept.close()
        return await asyncio.to_thread(self.build_engine, self.loaded)

    async def on_to_cache(self, command: CacheReplica) -> WorkerReply:
        return await self.to_cache(drop=command.drop_weights)

    async def on_from_cache(self, command: RestoreReplica) -> WorkerReply:
        return await self.from_cache(command.replica)

    async def on_ping(self, command: PingWorker) -> WorkerReply:
        if command.replica_id != self.replica.replica_id:
            raise RequestError(404, f"this worker serves {self.replica.replica_id}, not {command.replica_id}")
        return WorkerReply(ok=True, message="serving" if self.engine is not None else "parked")


async def serve_control(bus: Bus, runtime: ReplicaRuntime) -> Service:
    replica_id = runtime.replica.replica_id
    service = await add_service(bus.nc, name="shoal-worker", version=SHOAL_VERSION,
                                description=f"Shoal replica {runtime.replica.name}: park WARM, restore, ping",
                                metadata={"replica_id": replica_id, "model": runtime.replica.model})
    # The node agent relays its own to_cache / from_cache commands: same types, same decoders.
    await add_json_endpoint(service, "to_cache", worker_subject(replica_id, "to_cache"),
                            cache_replica_decoder.decode, runtime.on_to_cache)
    await add_json_endpoint(service, "from_cache", worker_subject(replica_id, "from_cache"),
                            restore_replica_decoder.decode, runtime.on_from_cache)
    await add_json_endpoint(service, "ping", worker_subject(replica_id, "ping"),
                            ping_worker_decoder.decode, runtime.on_ping)
    return service
