"""Admin API for chat sessions: list them, drop one (docs/api.md, "Sessions").

    GET    /admin/sessions[?model=M]               every session a serving replica holds
    DELETE /admin/sessions/{session_id}[?model=M]   forget its KV on every replica, and its route

Each replica knows its own sessions, so both ask every serving (or draining) replica, in
parallel, one request each on ``shoal.worker.<replica>.sessions`` / ``.drop_session``. A
replica that does not answer in `REPLICA_TIMEOUT_S` is listed under ``unreachable``: the
answer says what it could not see instead of failing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from aiohttp import web

from shoal.services.gateway.cluster import ClusterView
from shoal.services.gateway.errors import BadRequest, NotFound
from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.state import GATEWAY
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import (
    DropSession,
    DropSessionReply,
    ListSessions,
    ReplicaRecord,
    SessionList,
    SessionSummary,
    drop_session_reply_decoder,
    session_list_decoder,
)
from shoal.shared.micro import ServiceCallError, request_json

routes = web.RouteTableDef()
REPLICA_TIMEOUT_S = 5.0
R = TypeVar("R")


class ListedSession(SessionSummary, omit_defaults=False, kw_only=True):
    """A replica's `SessionSummary`, named with its replica and whether its route points there."""

    model: str
    replica_id: str
    node_id: str = ""
    routed: bool = False
    """``shoal_sessions`` sends its next turn to this replica."""


class Unreachable(msgspec.Struct):
    replica_id: str
    model: str
    error: str


class SessionsReport(msgspec.Struct):
    sessions: list[ListedSession]
    replicas: list[SessionList]
    """Each replica that answered, with its session cache's figures (its `sessions` are
    those of the top-level list)."""
    unreachable: list[Unreachable]


class DropReport(msgspec.Struct):
    session_id: str
    dropped: list[DropSessionReply]
    """Replicas that forgot its KV."""
    active: list[DropSessionReply]
    """Replicas running a turn of it now: that turn's KV is kept when it ends."""
    routes_removed: list[str]
    """Models whose route for it was removed."""
    unreachable: list[Unreachable]


def get_session_replicas(cluster: ClusterView, model: str | None) -> list[ReplicaRecord]:
    """The replicas that may hold sessions: HOT and serving or draining, of `model` if given."""
    return sorted((r for r in cluster.replicas.values()
                   if r.level == "HOT" and r.state in ("ready", "draining") and (model is None or r.model == model)),
                  key=lambda r: (r.model, r.created_at))


async def _ask_all(replicas: list[ReplicaRecord], ask: Callable[[ReplicaRecord], Awaitable[R]]
                   ) -> tuple[list[R], list[Unreachable]]:
    results = await asyncio.gather(*(ask(r) for r in replicas), return_exceptions=True)
    answers: list[R] = []
    unreachable: list[Unreachable] = []
    for replica, result in zip(replicas, results, strict=True):
        if isinstance(result, ServiceCallError):
            unreachable.append(Unreachable(replica.replica_id, replica.model, str(result)))
        elif isinstance(result, BaseException):
            raise result
        else:
            answers.append(result)
    return answers, unreachable


def _model_filter(request: web.Request) -> str | None:
    model = request.query.get("model")
    if model is not None:
        request.app[GATEWAY].cluster.require_model(model)
    return model


@routes.get("/admin/sessions")
async def list_sessions(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    bus = state.bus
    replicas = get_session_replicas(state.cluster, _model_filter(request))

    async def ask(replica: ReplicaRecord) -> SessionList:
        return await _list(bus, replica.replica_id)

    lists, unreachable = await _ask_all(replicas, ask)
    sessions: list[ListedSession] = []
    for answer in lists:
        for summary in answer.sessions:
            holder = await state.session_routes.get_replica(answer.model, summary.session_id)
            sessions.append(ListedSession(model=answer.model, replica_id=answer.replica_id, node_id=answer.node_id,
                                          routed=holder == answer.replica_id,
                                          **msgspec.structs.asdict(summary)))
        answer.sessions = []
    report = SessionsReport(sessions=sessions, replicas=lists, unreachable=unreachable)
    return json_response(report)


@routes.delete("/admin/sessions/{session_id}")
async def drop_session(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    session_id = request.match_info["session_id"]
    try:
        subjects.validate_session_id(session_id)
    except subjects.InvalidSessionId as exc:
        raise BadRequest(f"invalid session_id: {exc}", param="session_id") from exc
    model = _model_filter(request)
    bus = state.bus

    async def ask(replica: ReplicaRecord) -> DropSessionReply:
        return await request_json(bus.nc, subjects.worker_subject(replica.replica_id, "drop_session"),
                                  DropSession(session_id), drop_session_reply_decoder, timeout_s=REPLICA_TIMEOUT_S)

    replies, unreachable = await _ask_all(get_session_replicas(state.cluster, model), ask)
    models = [model] if model is not None else sorted(state.cluster.models)
    routes_removed = [m for m in models if await state.session_routes.delete(m, session_id)]
    report = DropReport(session_id=session_id, dropped=[r for r in replies if r.dropped],
                        active=[r for r in replies if r.active], routes_removed=routes_removed,
                        unreachable=unreachable)
    if not (report.dropped or report.active or report.routes_removed or report.unreachable):
        raise NotFound(f"no replica holds session {session_id!r}", code="session_not_found", param="session_id")
    return json_response(report)


async def _list(bus: Bus, replica_id: str) -> SessionList:
    return await request_json(bus.nc, subjects.worker_subject(replica_id, "sessions"), ListSessions(),
                              session_list_decoder, timeout_s=REPLICA_TIMEOUT_S)
