"""What a worker process is started with: one typed `WorkerLaunch`, read from stdin as JSON.

The node agent writes it to the new process's stdin and closes it, so nothing a worker
is told (its NATS URL and credentials, its event token) appears on a command line (`ps`)
or in its environment. Run by hand: ``shoal worker < launch.json`` or
``shoal worker --launch launch.json`` (the file then holds the secrets: keep it private).

Kept free of torch so `shoal --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

import msgspec
from msgspec import Struct

from shoal.shared.config import LoggingConfig, NatsConfig, WorkerConfig
from shoal.shared.messages import ModelSpec, ReplicaRecord
from shoal.shared.subjects import validate_node_id

WORKER_EXIT_DEVICE_ERROR = 75
"""A worker's exit status after a CUDA error poisoned its context (`device_errors`): its
requests went back to the queue; its node agent starts a new worker (a bounded number of
times), whatever the log's last lines say."""


class WorkerLaunch(Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything one worker process needs, from its node agent."""

    nats_url: str
    """The server(s) to connect to (comma-separated for a cluster)."""
    nats: NatsConfig = msgspec.field(default_factory=NatsConfig)
    """Credentials, TLS and the rest of the connection settings (its `url` is not read)."""
    event_token: str = ""
    """Sent back with every `WorkerEvent`: the node agent acts only on events that carry the
    token it gave this process (nobody else on the bus can report for its replica)."""
    node_id: str
    models_root: str
    """Absolute; the model's path is relative to it."""
    device: str
    """``cpu`` (virtual GPUs) or ``cuda``."""
    replica: ReplicaRecord
    model: ModelSpec
    worker: WorkerConfig
    logging: LoggingConfig

    def __post_init__(self) -> None:
        validate_node_id(self.node_id)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")


_decoder = msgspec.json.Decoder(WorkerLaunch)


def encode_launch(launch: WorkerLaunch) -> bytes:
    return msgspec.json.encode(launch)


def read_launch(source: str | None, stdin: TextIO = sys.stdin) -> WorkerLaunch:
    """The launch from file `source`, or from `stdin` when None; SystemExit naming what is wrong."""
    try:
        raw = Path(source).read_bytes() if source else stdin.buffer.read()
    except OSError as exc:
        raise SystemExit(f"shoal worker: cannot read the launch: {exc}") from exc
    try:
        return decode_launch(raw)
    except ValueError as exc:
        raise SystemExit(f"shoal worker: {exc}") from exc


def decode_launch(raw: bytes) -> WorkerLaunch:
    """`raw` as a `WorkerLaunch`; ValueError naming what is wrong."""
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"the launch is not a valid WorkerLaunch (JSON): {exc}") from exc


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--launch", metavar="FILE",
                        help="the WorkerLaunch as JSON (default: read it from stdin, as the node agent sends it)")
