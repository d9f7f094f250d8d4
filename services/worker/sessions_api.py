"""The sessions a replica holds, listed and dropped on request (the admin API's
``/admin/sessions`` asks every replica, services/gateway/routes_sessions.py).

Two endpoints of the replica's ``shoal-worker`` micro service:

    shoal.worker.<replica>.sessions       ListSessions -> SessionList
    shoal.worker.<replica>.drop_session   DropSession  -> DropSessionReply

A replica without a session cache (the ``hf`` engine, sessions off, parked WARM) answers
with no sessions and ``enabled: false``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from nats.micro.service import Service

from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.generation import Engine
from shoal.services.worker.service import WorkerIdentity
from shoal.shared.messages import (
    DropSession,
    DropSessionReply,
    ListSessions,
    SessionList,
    SessionSummary,
    drop_session_decoder,
    list_sessions_decoder,
)
from shoal.shared.micro import RequestError, add_json_endpoint
from shoal.shared.subjects import InvalidSessionId, validate_session_id, worker_subject


def _session_engine(engine: Engine | None) -> PagedEngine | None:
    """`engine` if it keeps sessions."""
    if isinstance(engine, PagedEngine) and engine.config.sessions is not None:
        return engine
    return None


def list_sessions(engine: Engine | None, identity: WorkerIdentity,
                  clock: Callable[[], float] = time.monotonic) -> SessionList:
    """What `engine` holds: cached sessions (least recently active first), then those with a
    turn running. `clock` is the engine's session clock (idle times)."""
    reply = SessionList(replica_id=identity.replica_id, model=identity.model, node_id=identity.node_id)
    paged = _session_engine(engine)
    if paged is None:
        return reply
    infos = paged.list_sessions()
    active = paged.get_active_session_ids()
    stats = paged.get_stats()
    block_size, block_bytes = paged.config.block_size, stats.pool.block_bytes
    at = clock()
    reply.enabled = True
    reply.stats = stats.sessions
    reply.sessions = [
        SessionSummary(
            session_id=info.session_id,
            num_tokens=info.num_blocks * block_size,
            gpu_bytes=info.num_gpu_blocks * block_bytes,
            cpu_bytes=info.num_cpu_blocks * block_bytes,
            num_dropped_tokens=info.num_dropped_blocks * block_size,
            idle_s=round(max(0.0, at - info.last_active), 3),
        )
        for info in infos
        if info.session_id not in active
    ]
    reply.sessions += [SessionSummary(session_id=session_id, active=True) for session_id in sorted(active)]
    return reply


def drop_session(engine: Engine | None, identity: WorkerIdentity, session_id: str) -> DropSessionReply:
    """Forget `session_id`'s cached KV in `engine` (a running turn keeps its own)."""
    try:
        validate_session_id(session_id)
    except InvalidSessionId as exc:
        raise RequestError(400, str(exc)) from exc
    paged = _session_engine(engine)
    if paged is None:
        return DropSessionReply(replica_id=identity.replica_id)
    return DropSessionReply(replica_id=identity.replica_id, dropped=paged.drop_session(session_id),
                            active=session_id in paged.get_active_session_ids())


async def add_session_endpoints(service: Service, identity: WorkerIdentity,
                                get_engine: Callable[[], Engine | None]) -> None:
    """Serve the two endpoints on the replica's micro `service` (see the module doc)."""

    async def on_list(_: ListSessions) -> SessionList:
        return list_sessions(get_engine(), identity)

    async def on_drop(command: DropSession) -> DropSessionReply:
        return drop_session(get_engine(), identity, command.session_id)

    replica_id = identity.replica_id
    await add_json_endpoint(service, "sessions", worker_subject(replica_id, "sessions"),
                            list_sessions_decoder.decode, on_list)
    await add_json_endpoint(service, "drop_session", worker_subject(replica_id, "drop_session"),
                            drop_session_decoder.decode, on_drop)
