"""Session affinity: which queue a chat session's turn goes to (pure rules, no I/O).

A returning turn goes to the replica whose KV holds its session (``shoal_sessions`` names it:
the last turn's final reply did), on that replica's own subject; any other request goes to
the model's shared queue, where whichever replica is free takes it. Affinity is an
optimization only: a turn any replica takes is answered the same (it recomputes what it
lacks), so every doubt falls back to the shared queue:

    none        no session id                               -> shared queue
    new         no replica known for the session            -> shared queue
    gone        its replica's record is gone, failed, stopping
    asleep      its replica is not serving (draining, parked WARM, loading)
    no_cache    its replica's engine keeps no sessions (its stats say so)
    saturated   its replica has requests waiting for room (waiting while others run) while
                another replica of the model has none waiting
    affinity    otherwise                                   -> the replica's own subject

A turn sent to a replica that goes away before answering is moved to the shared queue
(`must_move`); one that the replica, going to sleep or stopping, did not start, that replica
moves itself (services/worker/replica_queue.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from shoal.shared.messages import ReplicaRecord, WorkerStats

RouteReason = Literal["none", "new", "gone", "asleep", "no_cache", "saturated", "affinity"]
ROUTE_REASONS: tuple[RouteReason, ...] = ("none", "new", "gone", "asleep", "no_cache", "saturated", "affinity")


@dataclass(frozen=True)
class Route:
    """Where a request is published: a replica's own subject, or (None) the shared queue."""

    replica_id: str | None
    reason: RouteReason


SHARED_QUEUE = {reason: Route(None, reason) for reason in ROUTE_REASONS if reason != "affinity"}


def choose_route(session_id: str | None, holder_id: str | None, holder: ReplicaRecord | None,
                 holder_stats: WorkerStats | None, others: Iterable[WorkerStats]) -> Route:
    """The queue for one request (see the module doc).

    Args:
        session_id: the request's session, if any.
        holder_id: the replica ``shoal_sessions`` names for the session (None: unknown).
        holder: that replica's record as the gateway sees it (None: no record).
        holder_stats: its latest stats, if recent (None: not heard lately).
        others: the latest stats of the model's other replicas.
    """
    if session_id is None:
        return SHARED_QUEUE["none"]
    if holder_id is None:
        return SHARED_QUEUE["new"]
    if holder is None or holder.state in ("failed", "stopping") or holder.replica_id != holder_id:
        return SHARED_QUEUE["gone"]
    if not holder.serving or (holder_stats is not None and not holder_stats.serving):
        return SHARED_QUEUE["asleep"]
    if holder_stats is not None and holder_stats.engine and holder_stats.sessions is None:
        return SHARED_QUEUE["no_cache"]
    if holder_stats is not None and _is_saturated(holder_stats) and any(
        stats.replica_id != holder_id and stats.serving and stats.num_requests_waiting == 0 for stats in others
    ):
        return SHARED_QUEUE["saturated"]
    return Route(holder_id, "affinity")


def _is_saturated(stats: WorkerStats) -> bool:
    """Requests wait while others run: the replica has no room for more. Requests waiting on
    an idle engine are only not yet picked up (a snapshot taken as one arrived), not a sign of
    saturation: acting on one sent a sequential session's turns to another replica."""
    return stats.num_requests_waiting > 0 and stats.num_requests_running > 0


def must_move(record: ReplicaRecord | None) -> bool:
    """Whether a request published on a replica's own subject must move to the shared queue
    because that replica will never answer it: its record is gone or failed, or it was parked
    (a park moves what it did not start, but a turn published after that would wait for the
    wake). A replica that drains or stops still finishes what it started and moves the rest."""
    return record is None or record.state == "failed" or record.level != "HOT" or record.state == "sleeping"
