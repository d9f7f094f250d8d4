"""What a node agent and its worker fork server say to each other: one JSON object per line
over the fork server's stdin (agent → server) and stdout (server → agent).

Kept free of torch: the node agent imports it.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct


class Fork(Struct, tag="fork", forbid_unknown_fields=True):
    """Start a worker: fork, write its output to `log_path`, run `launch` (an encoded
    `WorkerLaunch`, secrets included: it never shows on a command line or in an environment)."""

    request_id: int
    launch: bytes
    log_path: str
    title: str
    """The worker's process title (`ps`)."""


class ServerReady(Struct, tag="ready"):
    """The fork server has imported the worker's libraries and takes forks."""

    pid: int


class Forked(Struct, tag="forked"):
    request_id: int
    pid: int


class ForkFailed(Struct, tag="fork_failed"):
    request_id: int
    error: str


class WorkerExited(Struct, tag="exited"):
    pid: int
    exit_code: int
    """As `asyncio.subprocess.Process.returncode`: negative for the signal that killed it."""


ServerMessage = ServerReady | Forked | ForkFailed | WorkerExited

request_decoder = msgspec.json.Decoder(Fork)
server_message_decoder = msgspec.json.Decoder(ServerMessage)


def encode_line(message: Struct) -> bytes:
    return msgspec.json.encode(message) + b"\n"
