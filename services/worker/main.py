"""`shoal worker`: one process per replica, spawned by the node agent.

Loads the model within the replica's allocation, reports to its node agent,
serves requests until SIGTERM, then drains and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import structlog
import torch

from shoal.services.worker.generation import Engine
from shoal.services.worker.loader import LoadedModel, ModelLoadError, load_model
from shoal.services.worker.prompts import eos_token_ids
from shoal.services.worker.service import WorkerIdentity, WorkerService
from shoal.shared import subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.logging import configure_logging
from shoal.shared.messages import (
    ModelSpec,
    ReplicaRecord,
    WorkerEvent,
    encode_json,
    model_spec_decoder,
    replica_record_decoder,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WorkerArgs:
    nats_url: str
    node_id: str
    models_root: str
    replica: ReplicaRecord
    model: ModelSpec
    device: str
    engine: str
    block_size: int
    max_num_seqs: int
    torch_threads: int
    drain_timeout_s: float


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--models-root", required=True)
    parser.add_argument("--replica", required=True, help="the ReplicaRecord as JSON")
    parser.add_argument("--model", required=True, help="the ModelSpec as JSON")
    parser.add_argument("--device", default="cpu", help="cpu (virtual GPUs) or cuda")
    parser.add_argument("--engine", default="paged", choices=["paged", "hf"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--torch-threads", type=int, default=0)
    parser.add_argument("--drain-timeout-s", type=float, default=30.0)
    parser.add_argument("--log-format", default="console", choices=["console", "json"])
    parser.add_argument("--log-level", default="info")


def parse_worker_args(ns: argparse.Namespace) -> WorkerArgs:
    try:
        replica = replica_record_decoder.decode(ns.replica)
        model = model_spec_decoder.decode(ns.model)
    except msgspec.DecodeError as exc:
        raise SystemExit(f"shoal worker: --replica/--model must be JSON records: {exc}") from exc
    return WorkerArgs(
        nats_url=ns.nats_url,
        node_id=subjects.validate_node_id(ns.node_id),
        models_root=ns.models_root,
        replica=replica,
        model=model,
        device=ns.device,
        engine=ns.engine,
        block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs,
        torch_threads=ns.torch_threads,
        drain_timeout_s=ns.drain_timeout_s,
    )


def build_engine(args: WorkerArgs, loaded: LoadedModel) -> tuple[Engine, int]:
    """The engine and the KV pool bytes it holds."""
    if args.engine == "hf":
        from shoal.services.worker.hf_engine import HFGenerateEngine

        return HFGenerateEngine(loaded.model, loaded.tokenizer, loaded.max_model_len), 0
    from shoal.services.worker.engine.factory import build_paged_engine

    engine = build_paged_engine(loaded, block_size=args.block_size, max_num_seqs=args.max_num_seqs)
    return engine, engine.kv_cache_bytes


def measure_replica_bytes(loaded: LoadedModel, kv_cache_bytes: int) -> int:
    """What this replica really holds on its GPU(s): torch's reservation on CUDA;
    on virtual GPUs its weights plus its KV pool."""
    if loaded.device.type == "cuda":
        return int(torch.cuda.memory_reserved(loaded.device))
    return loaded.weight_bytes + kv_cache_bytes


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
                load_model, args.models_root, args.model, replica, device=device, attn_implementation=attn
            )
            engine, kv_cache_bytes = await asyncio.to_thread(build_engine, args, loaded)
        except (ModelLoadError, ValueError, MemoryError) as exc:
            log.error("model_load_failed", error=str(exc))
            await report(bus, args.node_id, WorkerEvent(replica.replica_id, "failed", str(exc), pid=pid))
            return 3
        measured = measure_replica_bytes(loaded, kv_cache_bytes)
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
        run_task = asyncio.create_task(service.run())
        await report(
            bus,
            args.node_id,
            WorkerEvent(replica.replica_id, "ready", measured_bytes=measured, weight_bytes=loaded.weight_bytes, pid=pid),
        )
        log.info("worker_ready", measured_bytes=measured, weight_bytes=loaded.weight_bytes)
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait([run_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
        await service.stop(args.drain_timeout_s)
        run_task.cancel()
        await asyncio.gather(run_task, return_exceptions=True)
        await engine.close()
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


def worker_command(nats_url: str, node_id: str, models_root: str, replica: ReplicaRecord, model: ModelSpec,
                   **options: Any) -> list[str]:
    """The argv the node agent spawns for one replica."""
    import sys

    argv = [sys.executable, "-m", "shoal.services.worker", "--nats-url", nats_url, "--node-id", node_id,
            "--models-root", models_root, "--replica", encode_json(replica).decode(),
            "--model", encode_json(model).decode()]  # fmt: skip
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv
