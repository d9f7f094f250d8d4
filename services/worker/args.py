"""`shoal worker` command-line arguments (kept free of torch so `shoal --help` stays fast)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import msgspec

from shoal.shared import subjects
from shoal.shared.messages import ModelSpec, ReplicaRecord, model_spec_decoder, replica_record_decoder


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
