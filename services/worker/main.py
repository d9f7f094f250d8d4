"""`shoal worker`: one process per replica, spawned by the node agent.

Reads its `WorkerLaunch` (launch.py) from stdin, loads the model within the
replica's allocation, reports to its node agent, serves requests until SIGTERM,
then drains and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import nats.errors
import structlog
import torch
from nats.micro.service import Service

from shoal.kernels.cpu_build import default_cache_dirs
from shoal.kernels.cuda_ext import KernelBuildError
from shoal.kernels.settings import configure as configure_kernels
from shoal.services.worker.control import ReplicaRuntime, serve_control
from shoal.services.worker.generation import Engine
from shoal.services.worker.launch import (
    WORKER_EXIT_DEVICE_ERROR,
    WorkerLaunch,
    add_worker_arguments,
    read_launch,
)
from shoal.services.worker.loader import (
    LoadedModel,
    MinEngineBytes,
    ModelLoadError,
    join_restored_weights,
    load_model,
)
from shoal.services.worker.prompts import eos_token_ids
from shoal.services.worker.service import WorkerIdentity, WorkerService
from shoal.services.worker.sessions_api import add_session_endpoints
from shoal.services.worker.stats import StatsPublisher
from shoal.services.worker.tokenize_api import add_tokenize_endpoints
from shoal.shared import event_loop, subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.config import SessionConfig
from shoal.shared.gc_freeze import freeze_startup_objects
from shoal.shared.kv_cache.session_settings import SessionSettings
from shoal.shared.logs import configure_logging
from shoal.shared.messages import (
    WorkerEvent,
    encode_json,
)

log = structlog.get_logger(__name__)

GIL_SWITCH_INTERVAL_S = 0.0002
"""The worker's `sys.setswitchinterval` (Python's default: 5 ms). Its event loop and the engine's
step thread hand each step's outputs over many times a second; a thread that wants the GIL
while the other runs Python waits until that one blocks or this interval passes. At 5 ms a
step thread waking the loop (`call_soon_threadsafe`) waited for the loop's whole burst of
work, and under load for the loop's time off the CPU (docs/engine.md, "Threads")."""


def get_session_settings(launch: WorkerLaunch) -> SessionSettings | None:
    """The engine's session cache from ``[worker.sessions]`` (see `resolve_session_settings`)."""
    return resolve_session_settings(launch.worker.sessions, launch.model.key)


def resolve_session_settings(sessions: SessionConfig, model_key: str) -> SessionSettings | None:
    """`sessions` for `model_key`'s engine (None when off). A ``{model}`` in
    `cost_profile_path` becomes the model's subject token (one saved profile per model); none
    given: the per-user cache directory's ``cost-profiles/{model}.json``, so only a model's
    first start on a machine pays for measuring it."""
    if not sessions.enabled:
        return None
    template = sessions.cost_profile_path or str(default_cache_dirs()[0] / "cost-profiles" / "{model}.json")
    path = template.replace("{model}", subjects.model_token(model_key))
    return msgspec.structs.replace(sessions, cost_profile_path=path)


def build_engine(launch: WorkerLaunch, loaded: LoadedModel, *, restoring: bool = False) -> tuple[Engine, int]:
    """The engine and the bytes it holds beyond the weights (KV pool and activation reserve;
    the session cache's host pool is host memory besides the replica's allocation).
    `restoring`: rebuilt after a park, in a process that has run the model (no warm-up pass)."""
    worker = launch.worker
    if worker.engine == "hf":
        from shoal.services.worker.hf_engine import HFGenerateEngine

        join_restored_weights(loaded)
        return HFGenerateEngine(loaded.model, loaded.tokenizer, loaded.max_model_len), 0
    from shoal.services.worker.engine.factory import build_paged_engine

    engine = build_paged_engine(loaded, worker, kv_cache_tokens=launch.model.kv_cache_tokens,
                                sessions=get_session_settings(launch), warm_up=not restoring)
    return engine, engine.held_bytes


def get_min_engine_bytes(launch: WorkerLaunch) -> MinEngineBytes:
    """What the worker's engine needs besides the weights (the loader checks it on virtual
    GPUs, so a model that cannot hold even the engine's minimal pool fails at load)."""
    worker = launch.worker
    if worker.engine == "hf":
        return 0  # no pool: generate() grows its own cache
    from shoal.services.worker.engine.factory import get_min_engine_bytes_for

    return get_min_engine_bytes_for(torch.device(launch.device), worker)


def embedding_rows(model: object) -> int | None:
    """How many token ids the model's input embedding holds (None if it has none to ask)."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    rows = getattr(embeddings, "num_embeddings", None)
    return int(rows) if isinstance(rows, int) else None


def get_unsupported_reason(launch: WorkerLaunch) -> Callable[[Any, int], str | None] | None:
    """What refuses, before its weights load, a model the worker's engine would serve wrong."""
    if launch.worker.engine == "hf":
        return None  # transformers' own attention: whatever the model needs
    from shoal.services.worker.engine.model_support import get_unsupported_attention

    return get_unsupported_attention


def measure_replica_bytes(loaded: LoadedModel, engine_bytes: int) -> int:
    """What this replica really holds on its GPU(s): torch's reservation on CUDA; on
    virtual GPUs its weights plus what its engine holds (KV pool, activation reserve)."""
    if loaded.device.type == "cuda":
        return int(torch.cuda.memory_reserved(loaded.device))
    return loaded.weight_bytes + engine_bytes


async def report(bus: Bus, launch: WorkerLaunch, event: WorkerEvent) -> None:
    """Tell the node agent (with the launch's event token); a missing agent (a worker run by
    hand) is logged, not fatal."""
    event = msgspec.structs.replace(event, token=launch.event_token)
    node_id = launch.node_id
    try:
        await bus.nc.request(subjects.node_subject(node_id, "worker_event"), encode_json(event), timeout=5.0)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
        log.warning("node_agent_unreachable", node=node_id, error=type(exc).__name__)


async def serve(launch: WorkerLaunch) -> int:
    replica = launch.replica
    structlog.contextvars.bind_contextvars(model=replica.model, replica=replica.replica_id)
    bus = await connect(launch.nats_url, f"worker-{replica.replica_id}", nats_config=launch.nats, role="worker")
    pid = os.getpid()
    try:
        await report(bus, launch, WorkerEvent(replica.replica_id, "loading", pid=pid, phase="loading_weights"))
        device = torch.device(launch.device)
        attn = "shoal_paged" if launch.worker.engine == "paged" else None
        if attn:
            from shoal.services.worker.engine.attention import register_attention

            register_attention()
        try:
            loaded = await asyncio.to_thread(
                load_model, launch.models_root, launch.model, replica, device=device, attn_implementation=attn,
                min_kv_reserve_bytes=get_min_engine_bytes(launch), get_unsupported_reason=get_unsupported_reason(launch),
                native_pack=launch.worker.engine == "paged",
            )
            if launch.worker.engine == "paged":
                from shoal.kernels import ops

                await report(bus, launch, WorkerEvent(replica.replica_id, "loading", pid=pid,
                                                              phase="building_kernels"))
                await asyncio.to_thread(ops.prepare, device)  # the engine finds them built
                await report(bus, launch, WorkerEvent(replica.replica_id, "loading", pid=pid,
                                                              phase="warming_up"))
            log.info("startup_objects_frozen", num_objects=freeze_startup_objects())
            engine, engine_bytes = await asyncio.to_thread(build_engine, launch, loaded)
        except (ModelLoadError, KernelBuildError, MemoryError) as exc:
            log.error("model_load_failed", error=str(exc))
            await report(bus, launch, WorkerEvent(replica.replica_id, "failed", str(exc), pid=pid))
            return 3
        measured = measure_replica_bytes(loaded, engine_bytes)
        identity = WorkerIdentity(replica.model, replica.replica_id, launch.node_id)
        service = WorkerService(
            bus,
            engine,
            loaded.tokenizer,
            identity,
            eos_token_ids=eos_token_ids(loaded.tokenizer, loaded.model),
            max_model_len=loaded.max_model_len,
            vocab_size=embedding_rows(loaded.model),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runtime = ReplicaRuntime(replica, loaded, engine, service, lambda model: build_engine(launch, model, restoring=True),
                                 measure_replica_bytes, launch.model.sleep.drain_timeout_s,
                                 min_engine_bytes=get_min_engine_bytes(launch))
        control = await serve_control(bus, runtime)
        await add_session_endpoints(control, identity, lambda: runtime.engine)
        await add_tokenize_endpoints(control, identity, loaded.tokenizer, embedding_rows(loaded.model),
                                     service.served_context)
        run_task = asyncio.create_task(service.run())
        stats = StatsPublisher(bus, identity, service, lambda: runtime.engine, engine_kind=launch.worker.engine,
                               interval_s=launch.worker.stats_interval_s)
        stats_task = asyncio.create_task(stats.run())
        await report(
            bus,
            launch,
            WorkerEvent(replica.replica_id, "ready", measured_bytes=measured, weight_bytes=loaded.weight_bytes, pid=pid,
                        kv_cache_tokens=getattr(engine, "kv_cache_tokens", None)),
        )
        log.info("worker_ready", measured_bytes=measured, weight_bytes=loaded.weight_bytes)
        stop_task = asyncio.create_task(stop.wait())
        failed_task = asyncio.create_task(service.failed.wait())
        await asyncio.wait([run_task, stop_task, failed_task], return_when=asyncio.FIRST_COMPLETED)
        failed_task.cancel()
        if service.failure is not None:
            return await _exit_after_device_error(service, control, [run_task, stats_task, stop_task])
        await control.stop()
        await service.stop(launch.model.sleep.drain_timeout_s)
        run_task.cancel()
        stats_task.cancel()
        await asyncio.gather(run_task, stats_task, return_exceptions=True)
        if runtime.engine is not None:
            await runtime.engine.close()
        await report(bus, launch, WorkerEvent(replica.replica_id, "stopped", pid=pid))
        return 0
    finally:
        await bus.close()


async def _exit_after_device_error(service: WorkerService, control: Service, tasks: list[asyncio.Task[Any]]) -> int:
    """The engine died of a CUDA error: no request may run here again. What is in flight
    has been handed back (`WorkerService`); the worker exits with `WORKER_EXIT_DEVICE_ERROR`
    without reporting, and its node agent, seeing the exit, starts a new worker."""
    failure = service.failure
    log.error("worker_device_error", error=str(failure.__cause__ or failure) if failure else None)
    await control.stop()
    await service.stop(drain_timeout_s=5.0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return WORKER_EXIT_DEVICE_ERROR


def run_worker(ns: argparse.Namespace) -> int:
    return run_launch(read_launch(ns.launch))


def run_launch(launch: WorkerLaunch) -> int:
    """Serve `launch`'s replica until stopped; the process's exit status (a fork server's
    child runs this too: services/worker/forkserver.py)."""
    configure_logging(launch.logging.format, launch.logging.level, service="worker")
    configure_kernels(launch.worker.kernels)
    if launch.worker.torch_threads > 0:
        torch.set_num_threads(launch.worker.torch_threads)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    return event_loop.run(serve(launch))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal worker", description=__doc__)
    add_worker_arguments(parser)
    return run_worker(parser.parse_args(argv))
