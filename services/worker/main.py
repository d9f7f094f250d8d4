"""`shoal worker`: one process per replica, spawned by the node agent.

Loads the model within the replica's allocation, reports to its node agent,
serves requests until SIGTERM, then drains and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

import nats.errors
import structlog
import torch

from shoal.kernels.cuda_ext import KernelBuildError
from shoal.services.worker.args import WorkerArgs, add_worker_arguments, parse_worker_args
from shoal.services.worker.control import ReplicaRuntime, serve_control
from shoal.services.worker.generation import Engine
from shoal.services.worker.loader import LoadedModel, MinEngineBytes, ModelLoadError, load_model
from shoal.services.worker.prompts import eos_token_ids
from shoal.services.worker.service import WorkerIdentity, WorkerService
from shoal.shared import subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.logs import configure_logging
from shoal.shared.messages import (
    WorkerEvent,
    encode_json,
)

log = structlog.get_logger(__name__)


def build_engine(args: WorkerArgs, loaded: LoadedModel) -> tuple[Engine, int]:
    """The engine and the bytes it holds beyond the weights (KV pool and activation reserve)."""
    if args.engine == "hf":
        from shoal.services.worker.hf_engine import HFGenerateEngine

        return HFGenerateEngine(loaded.model, loaded.tokenizer, loaded.max_model_len), 0
    from shoal.services.worker.engine.factory import build_paged_engine

    engine = build_paged_engine(loaded, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                kv_cache_tokens=args.model.kv_cache_tokens)
    return engine, engine.kv_cache_bytes + engine.reserve_bytes


def get_min_engine_bytes(args: WorkerArgs) -> MinEngineBytes:
    """What the worker's engine needs besides the weights (the loader checks it on virtual
    GPUs, so a model that cannot hold even the engine's minimal pool fails at load)."""
    if args.engine == "hf":
        return 0  # no pool: generate() grows its own cache
    from shoal.services.worker.engine.factory import get_min_engine_bytes_for

    return get_min_engine_bytes_for(
        torch.device(args.device), block_size=args.block_size, max_num_seqs=args.max_num_seqs
    )


def measure_replica_bytes(loaded: LoadedModel, engine_bytes: int) -> int:
    """What this replica really holds on its GPU(s): torch's reservation on CUDA; on
    virtual GPUs its weights plus what its engine holds (KV pool, activation reserve)."""
    if loaded.device.type == "cuda":
        return int(torch.cuda.memory_reserved(loaded.device))
    return loaded.weight_bytes + engine_bytes


async def report(bus: Bus, node_id: str, event: WorkerEvent) -> None:
    """Tell the node agent; a missing agent (a worker run by hand) is logged, not fatal."""
    try:
        await bus.nc.request(subjects.node_subject(node_id, "worker_event"), encode_json(event), timeout=5.0)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
        log.warning("node_agent_unreachable", node=node_id, error=type(exc).__name__)


async def serve(args: WorkerArgs) -> int:
    replica = args.replica
    structlog.contextvars.bind_contextvars(model=replica.model, replica=replica.replica_id)
    bus = await connect(args.nats_url, f"worker-{replica.replica_id}")
    pid = os.getpid()
    try:
        await report(bus, args.node_id, WorkerEvent(replica.replica_id, "loading", pid=pid))
        device = torch.device(args.device)
        attn = "shoal_paged" if args.engine == "paged" else None
        if attn:
            from shoal.services.worker.engine.attention import register_attention

            register_attention()
        try:
            loaded = await asyncio.to_thread(
                load_model, args.models_root, args.model, replica, device=device, attn_implementation=attn,
                min_kv_reserve_bytes=get_min_engine_bytes(args),
            )
            engine, engine_bytes = await asyncio.to_thread(build_engine, args, loaded)
        except (ModelLoadError, KernelBuildError, ValueError, MemoryError) as exc:
            log.error("model_load_failed", error=str(exc))
            await report(bus, args.node_id, WorkerEvent(replica.replica_id, "failed", str(exc), pid=pid))
            return 3
        measured = measure_replica_bytes(loaded, engine_bytes)
        service = WorkerService(
            bus,
            engine,
            loaded.tokenizer,
            WorkerIdentity(replica.model, replica.replica_id, args.node_id),
            eos_token_ids=eos_token_ids(loaded.tokenizer, loaded.model),
            max_model_len=loaded.max_model_len,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runtime = ReplicaRuntime(replica, loaded, engine, service, lambda model: build_engine(args, model),
                                 measure_replica_bytes, args.drain_timeout_s,
                                 min_engine_bytes=get_min_engine_bytes(args))
        control = await serve_control(bus, runtime)
        run_task = asyncio.create_task(service.run())
        await report(
            bus,
            args.node_id,
            WorkerEvent(replica.replica_id, "ready", measured_bytes=measured, weight_bytes=loaded.weight_bytes, pid=pid),
        )
        log.info("worker_ready", measured_bytes=measured, weight_bytes=loaded.weight_bytes)
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait([run_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
        await control.stop()
        await service.stop(args.drain_timeout_s)
        run_task.cancel()
        await asyncio.gather(run_task, return_exceptions=True)
        if runtime.engine is not None:
            await runtime.engine.close()
        await report(bus, args.node_id, WorkerEvent(replica.replica_id, "stopped", pid=pid))
        return 0
    finally:
        await bus.close()


def run_worker(ns: argparse.Namespace) -> int:
    args = parse_worker_args(ns)
    configure_logging(ns.log_format, ns.log_level, service="worker")
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    return asyncio.run(serve(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal worker", description=__doc__)
    add_worker_arguments(parser)
    return run_worker(parser.parse_args(argv))
