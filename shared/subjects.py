"""Every NATS name Shoal uses, and the model-key <-> subject-token mapping.

Model keys such as ``meta-llama/Llama-3.1-8B`` are not subject tokens (``.``
separates tokens, and KV keys allow only ``[-/_=.a-zA-Z0-9]``). `model_token`
maps a key to a token of ``[A-Za-z0-9_-]`` plus ``=XX`` escapes (the hex of
each UTF-8 byte of any other character), reversibly and readably:
``meta-llama/Llama-3.1-8B`` -> ``meta-llama=2FLlama-3=2E1-8B``.
"""

from __future__ import annotations

import functools
import re

from shoal.shared.errors import ShoalError

# Streams and buckets (the NATS contract in DESIGN.md).
REQUESTS_STREAM = "SHOAL_REQUESTS"
EVENTS_STREAM = "SHOAL_EVENTS"
MODELS_BUCKET = "shoal_models"
GPUS_BUCKET = "shoal_gpus"
REPLICAS_BUCKET = "shoal_replicas"
NODES_BUCKET = "shoal_nodes"
SESSIONS_BUCKET = "shoal_sessions"
"""Which replica holds each chat session's KV (``<model token>.<session id>``); gateways
create it (services/gateway/session_routes.py)."""
RESPONSES_BUCKET = "shoal_responses"
"""Stored Responses API answers (``<response id>``); gateways create it
(services/gateway/response_store.py)."""
BATCHES_BUCKET = "shoal_batches"
"""The Batch API's records: ``files.<file id>`` and ``batches.<batch id>``; gateways create it
(services/gateway/batch_store.py)."""
FILES_BUCKET = "shoal_files"
"""An object store: the Batch API's files (``<file id>``), read and written by gateways
(services/gateway/file_store.py)."""

INFER_PREFIX = "shoal.infer"
EVENT_PREFIX = "shoal.event"
REPLY_PREFIX = "shoal.reply"
CANCEL_PREFIX = "shoal.cancel"
SCHEDULER_PREFIX = "shoal.scheduler"
NODE_PREFIX = "shoal.node"
WORKER_PREFIX = "shoal.worker"
STATS_PREFIX = "shoal.stats"
STATS_WILDCARD = f"{STATS_PREFIX}.>"
"""Every worker's stats (``shoal.stats.<model token>.<replica id>``): what gateways subscribe to."""
NODE_INSPECT = f"{NODE_PREFIX}.inspect"
"""Queue-grouped: any node agent sizes a model from the files it can see."""

# Headers carried on inference requests (a JetStream message's reply subject is
# its ack subject, so the gateway's reply subject travels in a header).
HDR_REPLY_TO = "Shoal-Reply-To"
HDR_REQUEST_ID = "Shoal-Request-Id"
HDR_DEADLINE = "Shoal-Deadline"
HDR_MSG_ID = "Nats-Msg-Id"
MOVED_MSG_ID_SUFFIX = ".moved"
"""A request moved from a replica's own subject to the shared one is published again with
``Nats-Msg-Id: <request id>.moved``: whoever moves it (the replica, or the gateway when the
replica is gone), the stream's duplicate window keeps one copy."""

_SAFE = re.compile(r"[A-Za-z0-9_-]")
_TOKEN = re.compile(r"(?:[A-Za-z0-9_-]|=[0-9A-F]{2})+")
MAX_MODEL_KEY_CHARS = 256
CONSUMER_PREFIX = "infer-"
"""Prefix of the per-model durable consumer's name (`consumer_name`)."""
MAX_CONSUMER_NAME_CHARS = 255
"""JetStream refuses longer consumer names."""
MAX_MODEL_TOKEN_CHARS = MAX_CONSUMER_NAME_CHARS - len(CONSUMER_PREFIX)
"""A model's token must leave room for `CONSUMER_PREFIX` in its consumer name. Each
character outside ``[A-Za-z0-9_-]`` takes 3 per UTF-8 byte (``日`` -> ``=E6=97=A5``)."""
REPLICA_CONSUMER_PREFIX = "replica-"
"""Prefix of a replica's own durable consumer (`replica_consumer_name`)."""
MAX_SESSION_ID_CHARS = 128
_SESSION_ID = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_SESSION_ID_CHARS}}}")
_REPLICA_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class InvalidModelKey(ShoalError, ValueError):
    """A model key that Shoal cannot name (empty, too long, its token too long, or control characters)."""


class InvalidModelToken(ShoalError, ValueError):
    """A subject token that no model key maps to."""


class InvalidSessionId(ShoalError, ValueError):
    """A session id that is empty, too long or has characters outside ``[A-Za-z0-9_-]``."""


def validate_session_id(session_id: str) -> str:
    """Return `session_id` if it can name a session, else raise InvalidSessionId.

    1 to `MAX_SESSION_ID_CHARS` characters of ``[A-Za-z0-9_-]`` (UUIDs, ULIDs, base64url
    ids): a session id becomes part of a KV key (``shoal_sessions``) and of log lines."""
    if _SESSION_ID.fullmatch(session_id):
        return session_id
    if not session_id:
        raise InvalidSessionId("session id is empty")
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidSessionId(f"session id is longer than {MAX_SESSION_ID_CHARS} characters")
    raise InvalidSessionId("session id may only hold the characters A-Z a-z 0-9 _ -")


def validate_model_key(model_key: str) -> str:
    """Return `model_key` if Shoal can serve a model under that name, else raise InvalidModelKey."""
    if not model_key:
        raise InvalidModelKey("model key is empty")
    if len(model_key) > MAX_MODEL_KEY_CHARS:
        raise InvalidModelKey(f"model key is longer than {MAX_MODEL_KEY_CHARS} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in model_key):
        raise InvalidModelKey(f"model key {model_key!r} contains whitespace or control characters")
    num_token_chars = len(_encode(model_key))
    if num_token_chars > MAX_MODEL_TOKEN_CHARS:
        raise InvalidModelKey(
            f"model key is too long once escaped for NATS: its subject token has {num_token_chars} characters, "
            f"at most {MAX_MODEL_TOKEN_CHARS} fit in a JetStream consumer name (characters other than "
            f"A-Z a-z 0-9 _ - take 3 per UTF-8 byte)"
        )
    return model_key


@functools.lru_cache(maxsize=4096)
def model_token(model_key: str) -> str:
    """Map a model key to a subject- and KV-key-safe token (reversible, see module doc).

    Cached: the gateway maps the same few keys on every request (invalid keys raise,
    and exceptions are not cached)."""
    validate_model_key(model_key)
    return _encode(model_key)


def _encode(model_key: str) -> str:
    parts: list[str] = []
    for ch in model_key:
        if _SAFE.fullmatch(ch):
            parts.append(ch)
        else:
            parts.extend(f"={byte:02X}" for byte in ch.encode())
    return "".join(parts)


def model_key_from_token(token: str) -> str:
    """Inverse of `model_token`; raises InvalidModelToken for strings it never produces."""
    if not _TOKEN.fullmatch(token):
        raise InvalidModelToken(f"{token!r} is not a model token")
    raw = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "=":
            raw.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.extend(token[i].encode())
            i += 1
    try:
        key = raw.decode()
    except UnicodeDecodeError as exc:
        raise InvalidModelToken(f"{token!r} does not decode to UTF-8") from exc
    try:
        canonical = model_token(key)
    except InvalidModelKey as exc:
        raise InvalidModelToken(f"{token!r} decodes to a key Shoal cannot serve: {exc}") from exc
    if canonical != token:
        raise InvalidModelToken(f"{token!r} is not the canonical token of {key!r}")
    return key


def infer_subject(model_key: str) -> str:
    return f"{INFER_PREFIX}.{model_token(model_key)}"


def replica_infer_subject(model_key: str, replica_id: str) -> str:
    """A replica's own request subject (session affinity): ``shoal.infer.<model token>.<replica
    id>``. Its filter does not overlap the model's shared ``shoal.infer.<model token>``, which a
    work-queue stream requires of two consumers."""
    return f"{INFER_PREFIX}.{model_token(model_key)}.{_replica_token(replica_id)}"


def replica_consumer_name(replica_id: str) -> str:
    """The durable pull consumer of a replica's own subject (only that replica fetches from it)."""
    return f"{REPLICA_CONSUMER_PREFIX}{_replica_token(replica_id)}"


def _replica_token(replica_id: str) -> str:
    assert _REPLICA_ID.fullmatch(replica_id), f"replica id {replica_id!r} is not a subject token"
    return replica_id


def session_route_key(model_key: str, session_id: str) -> str:
    """Key of a session's route in ``shoal_sessions``: ``<model token>.<session id>``."""
    return f"{model_token(model_key)}.{validate_session_id(session_id)}"


def cancel_subject(model_key: str) -> str:
    return f"{CANCEL_PREFIX}.{model_token(model_key)}"


def reply_subject(gateway_id: str, request_id: str) -> str:
    return f"{REPLY_PREFIX}.{gateway_id}.{request_id}"


def reply_wildcard(gateway_id: str) -> str:
    return f"{REPLY_PREFIX}.{gateway_id}.>"


def event_subject(kind: str) -> str:
    return f"{EVENT_PREFIX}.{kind}"


def consumer_name(model_key: str) -> str:
    """Durable pull consumer shared by every replica of one model."""
    return f"{CONSUMER_PREFIX}{model_token(model_key)}"


def replica_name(model_key: str, replica_id: str) -> str:
    """The replica naming contract of seed 002: ``ModelActor:<model_key>:<replica_id>``."""
    return f"ModelActor:{model_key}:{replica_id}"


def replica_kv_key(model_key: str, replica_id: str) -> str:
    """Key of a replica in `shoal_replicas`: ``<model token>.<replica id>`` (watchable per model)."""
    return f"{model_token(model_key)}.{replica_id}"


def gpu_kv_key(node_id: str, gpu_index: int) -> str:
    return f"{node_id}.{gpu_index}"


def node_subject(node_id: str, verb: str) -> str:
    return f"{NODE_PREFIX}.{node_id}.{verb}"


def worker_subject(replica_id: str, verb: str) -> str:
    """A replica's control endpoint: to_cache and from_cache, called by its node agent; ping,
    asked by gateways when its node is lost."""
    return f"{WORKER_PREFIX}.{replica_id}.{verb}"


def stats_subject(model_key: str, replica_id: str) -> str:
    """Where a replica's worker publishes its `WorkerStats`."""
    return f"{STATS_PREFIX}.{model_token(model_key)}.{replica_id}"


def scheduler_subject(verb: str) -> str:
    return f"{SCHEDULER_PREFIX}.{verb}"


_NODE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
REPLICA_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""Replica ids (uuid hex when Shoal makes them) become subject tokens, KV key parts and log
file names: every message and record that carries one checks it against this pattern."""
_REPLICA_ID = re.compile(REPLICA_ID_PATTERN)
_REPLY_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def validate_node_id(node_id: str) -> str:
    """Node ids become subject tokens and KV key parts: ``[A-Za-z0-9_-]{1,64}``."""
    if not _NODE_ID.fullmatch(node_id):
        raise ValueError(f"node id {node_id!r} must match [A-Za-z0-9_-]{{1,64}}")
    return node_id


def validate_replica_id(replica_id: str) -> str:
    """Replica ids become subject tokens, KV key parts and file names: `REPLICA_ID_PATTERN`."""
    if not _REPLICA_ID.fullmatch(replica_id):
        raise ValueError(f"replica id {replica_id!r} must match [A-Za-z0-9_-]{{1,64}}")
    return replica_id


def is_reply_subject(subject: str, gateway_id: str, request_id: str) -> bool:
    """Whether `subject` is exactly ``shoal.reply.<gateway_id>.<request_id>`` with both ids
    valid subject tokens (`[A-Za-z0-9_-]{1,64}`): the only subjects a worker answers on.
    A request naming any other reply subject (``$KV.…``, ``shoal.node.…``, a wildcard) is
    forged or broken, and gets no reply."""
    return (bool(_REPLY_TOKEN.fullmatch(gateway_id)) and bool(_REPLY_TOKEN.fullmatch(request_id))
            and subject == reply_subject(gateway_id, request_id))
