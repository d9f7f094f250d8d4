"""One request's trip through NATS: admission, placement, publish, replies, deadline, cancel.

Redelivery vs streaming (DESIGN.md, "Hard parts"): a worker that dies leaves
its message un-acked and JetStream redelivers it to another replica, whose
replies carry a higher attempt number. Replies of an older attempt are
dropped. When a new attempt begins after the client already holds text:

* the request is reproducible (greedy or seeded): the new attempt's chunks are
  skipped up to the sequence number already delivered, so the stream resumes
  where it stopped — no duplicate, no gap;
* otherwise a non-streamed request starts over silently (its partial text was
  never sent), and a streamed one ends with a clear error event.

That rule is `attempts.AttemptTracker` (pure); `Dispatcher.run` does the I/O around it.

Session affinity (docs/sessions.md): a turn of a chat session goes to the replica holding
the session's KV, on that replica's own subject, when `affinity.choose_route` says so, else
to the model's shared queue; its final reply's replica becomes the session's route
(``shoal_sessions``). A turn waiting on a replica that goes away (`affinity.must_move`) is
moved to the shared queue: deleted from the stream by its sequence number (which fails if the
replica acked it, or moved it itself) and published again with its attempts numbered after
the first replica's, so the redelivery rule above covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import TypeAlias

import msgspec
import nats.errors
import nats.js.errors
import structlog

from shoal.services.gateway.affinity import SHARED_QUEUE, Route, choose_route, must_move
from shoal.services.gateway.attempts import AttemptTracker
from shoal.services.gateway.cluster import ClusterView
from shoal.services.gateway.errors import (
    ApiError,
    DeadlineExceeded,
    NotFound,
    TooManyRequests,
    Unavailable,
    error_for_status,
)
from shoal.services.gateway.router import ReplyInbox, ReplyRouter
from shoal.services.gateway.session_routes import SessionRoutes
from shoal.services.gateway.worker_metrics import WorkerStatsStore
from shoal.shared import subjects
from shoal.shared.bus import JS_NO_MESSAGE_FOUND, MOVED_ATTEMPT_OFFSET, Bus
from shoal.shared.config import GatewayConfig
from shoal.shared.messages import (
    CancelRequest,
    EnsureModel,
    ErrorReply,
    FinalReply,
    InferenceRequest,
    Reply,
    TokenChunk,
    encode_msgpack,
    scheduler_reply_decoder,
)
from shoal.shared.metrics import Registry
from shoal.shared.micro import ServiceCallError, ServiceError, ServiceUnavailable, request_json

log = structlog.get_logger(__name__)

FAILURE_CHECK_S = 1.0
"""While waiting, how often a request checks whether its model's replicas keep failing."""
PUBLISH_RETRY_S = 30.0
"""How long a request's publish is retried while the stream cannot take it (a NATS cluster
electing a leader, the gateway reconnecting), within its deadline."""
PUBLISH_RETRY_PAUSE_S = 0.25


class StreamBroken(ApiError):
    """The replica serving a non-reproducible stream died after text was sent."""

    status = 503
    error_type = "service_unavailable"


@dataclass(frozen=True)
class Restart:
    """A non-streamed request starts over (a new attempt, not reproducible): drop the text so far."""


DispatchEvent: TypeAlias = TokenChunk | FinalReply | Restart


@dataclass
class _Published:
    """Where a request's message is now: a replica's own subject (`replica_id`) or the shared
    queue (None), at stream sequence `sequence`."""

    replica_id: str | None
    sequence: int


class Dispatcher:
    def __init__(self, bus: Bus, router: ReplyRouter, cluster: ClusterView, config: GatewayConfig,
                 metrics: Registry, *, on_first_token: Callable[[str, float], None] | None = None,
                 session_routes: SessionRoutes | None = None, worker_stats: WorkerStatsStore | None = None) -> None:
        """Args:
        on_first_token: told (model, seconds) when a request's first token arrives (the
            dashboard's TTFT history), besides the TTFT histogram.
        session_routes: which replica holds each session (None: no affinity, every request
            goes to the shared queue).
        worker_stats: the replicas' latest stats (saturation, whether they keep sessions).
        """
        self._bus = bus
        self._session_routes = session_routes
        self._worker_stats = worker_stats or WorkerStatsStore()
        self._on_first_token = on_first_token
        self._router = router
        self._cluster = cluster
        self._config = config
        self._num_queued: defaultdict[str, int] = defaultdict(int)
        self._ensuring: dict[str, asyncio.Future[None]] = {}
        self._ttft = metrics.histogram(
            "shoal_gateway_time_to_first_token_seconds", "From receipt to the first token", ["model"]
        )
        self._queued_gauge = metrics.gauge("shoal_gateway_requests_in_flight", "Requests waiting or running", ["model"])
        self._session_turns = metrics.counter(
            "shoal_gateway_session_turns_total", "Turns of chat sessions, by where they were sent", ["model", "route"]
        )
        self._moved = metrics.counter(
            "shoal_gateway_requests_moved_total",
            "Requests moved from a replica's own subject to the shared queue (the replica went away)", ["model"]
        )

    @contextlib.contextmanager
    def admitted(self, model: str) -> Iterator[None]:
        """Count a request for `model` as queued in this gateway for the whole `with` block:
        404 for an unknown model, 429 when its queue is full. Counted from admission, so
        requests waiting for a cold start's placement count against the bound too."""
        spec = self._cluster.get_model(model)
        if spec is None:
            raise NotFound(f"model {model!r} does not exist; GET /v1/models lists the served models",
                           code="model_not_found", param="model")
        limit = spec.max_queue or self._config.max_queue_per_model
        if self._num_queued[model] >= limit:
            raise TooManyRequests(f"too many requests for {model!r} in flight ({limit}); retry shortly",
                                  retry_after_s=1.0)
        self._num_queued[model] += 1
        self._queued_gauge.set(self._num_queued[model], model=model)
        try:
            yield
        finally:
            self._num_queued[model] -= 1
            self._queued_gauge.set(self._num_queued[model], model=model)

    def get_num_in_flight(self, model: str) -> int:
        """Requests for `model` waiting or running in this gateway."""
        return self._num_queued.get(model, 0)

    async def ensure_placed(self, model: str, deadline: float) -> None:
        """Ask the scheduler for a replica when the model has none on its way (one ask per
        model at a time); 504 if `deadline` (unix time) passes first."""
        if self._cluster.has_active_replica(model):
            return
        pending = self._ensuring.get(model)
        if pending is None:
            pending = asyncio.ensure_future(self._ask_scheduler(model))
            self._ensuring[model] = pending
            pending.add_done_callback(lambda done: self._ensured(model, done))
        done, _ = await asyncio.wait([pending], timeout=max(0.0, deadline - time.time()))
        if not done:
            raise self._deadline_exceeded()
        pending.result()

    def _ensured(self, model: str, done: asyncio.Future[None]) -> None:
        self._ensuring.pop(model, None)
        if not done.cancelled():
            done.exception()  # retrieved: every waiter may have given up at its deadline

    def _deadline_exceeded(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"the request did not finish within its deadline ({self._config.request_timeout_s:g}s)"
        )

    async def _ask_scheduler(self, model: str) -> None:
        try:
            reply = await request_json(self._bus.nc, subjects.scheduler_subject("ensure"), EnsureModel(model),
                                       scheduler_reply_decoder, timeout_s=60.0)
        except ServiceUnavailable as exc:
            raise Unavailable("no scheduler is running; the model cannot be placed", retry_after_s=5.0) from exc
        except ServiceError as exc:
            raise error_for_status(exc.code, exc.description) from exc
        except ServiceCallError as exc:
            raise Unavailable(f"the scheduler did not answer: {exc}", retry_after_s=5.0) from exc
        if not reply.ok:
            raise Unavailable(f"model {model!r} cannot be placed now: {reply.message}",
                              code=reply.status, retry_after_s=reply.retry_after_s or 5.0)

    async def run(self, request: InferenceRequest, *, restartable: bool) -> AsyncGenerator[DispatchEvent, None]:
        """Publish `request` and yield its chunks and final reply (see the module doc).

        Args:
            restartable: the caller has sent nothing yet and can drop text on `Restart`.

        Raises:
            ApiError: the worker's error, 504 at the deadline, StreamBroken.
        """
        model = request.model
        inbox = self._router.open(request.request_id)
        started = time.monotonic()
        finished = False
        tracker = AttemptTracker(reproducible=request.params.is_reproducible, restartable=restartable)
        published: _Published | None = None
        try:
            route = await self._route(request)
            published = _Published(route.replica_id, await self._publish(request, route.replica_id))
            while True:
                reply = await self._next_reply(inbox, request, published)
                for action in tracker.on_reply(reply):
                    match action:
                        case "resume":
                            log.warning("stream_resumed", request_id=request.request_id, attempt=reply.attempt)
                        case "restart":
                            yield Restart()
                        case "broken":
                            raise StreamBroken("the replica serving this stream failed; retry the request")
                        case "deliver":
                            assert isinstance(reply, TokenChunk), "only chunks are delivered"
                            if tracker.num_sent == 1:
                                ttft_s = time.monotonic() - started
                                self._ttft.observe(ttft_s, model=model)
                                if self._on_first_token is not None:
                                    self._on_first_token(model, ttft_s)
                            yield reply
                        case "finish":
                            assert isinstance(reply, FinalReply), "only a final reply finishes"
                            finished = True
                            if request.session_id is not None and reply.replica_id and self._session_routes:
                                await self._session_routes.put(model, request.session_id, reply.replica_id)
                            yield reply
                            return
                        case "error":
                            assert isinstance(reply, ErrorReply), "only an error reply is an error"
                            finished = True
                            raise self._worker_error(request, reply)
        finally:
            self._router.close(request.request_id)
            if not finished:
                await self._cancel(request, "client disconnected or deadline passed",
                                   published.sequence if published else None)

    async def _route(self, request: InferenceRequest) -> Route:
        """Where `request` goes (`affinity.choose_route`), counted for a session's turn."""
        session_id = request.session_id
        if session_id is None or self._session_routes is None:
            return SHARED_QUEUE["none"]  # the hot path of requests without a session: no lookups
        holder_id = await self._session_routes.get_replica(request.model, session_id)
        stats = self._worker_stats
        if holder_id is None:
            route = choose_route(session_id, None, None, None, ())
        else:
            others = [s for s in stats.get_current() if s.model == request.model and s.replica_id != holder_id]
            route = choose_route(session_id, holder_id, self._cluster.get_replica(holder_id),
                                 stats.get_latest(holder_id), others)
        self._session_turns.inc(model=request.model, route=route.reason)
        log.debug("session_routed", request_id=request.request_id, session_id=session_id,
                  replica=route.replica_id, reason=route.reason)
        return route

    async def _move_if_stranded(self, request: InferenceRequest, published: _Published) -> None:
        """Move a request waiting on a replica that will never answer it to the shared queue
        (see the module doc); a no-op for any other request."""
        if published.replica_id is None or not must_move(self._cluster.get_replica(published.replica_id)):
            return
        try:
            await self._bus.js.delete_msg(subjects.REQUESTS_STREAM, published.sequence)
        except nats.js.errors.APIError as exc:
            if exc.err_code != JS_NO_MESSAGE_FOUND:
                log.warning("request_move_failed", request_id=request.request_id, error=str(exc))
                return
            published.replica_id = None  # acked (answered), or moved by its replica already
            return
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("request_move_failed", request_id=request.request_id, error=str(exc))
            return
        log.warning("request_moved_to_shared_queue", request_id=request.request_id, replica=published.replica_id)
        self._moved.inc(model=request.model)
        moved = msgspec.structs.replace(request, attempt_offset=MOVED_ATTEMPT_OFFSET)
        published.sequence = await self._publish(moved, None, msg_id=request.request_id + subjects.MOVED_MSG_ID_SUFFIX)
        published.replica_id = None

    @staticmethod
    def _worker_error(request: InferenceRequest, reply: ErrorReply) -> ApiError:
        error = error_for_status(reply.status, reply.message, code=reply.code)
        if reply.status in (400, 413):
            # Unless the worker names a field, it rejected the prompt (vocabulary, length,
            # chat template).
            error.param = reply.param or ("prompt" if request.messages is None else "messages")
        return error

    async def _publish(self, request: InferenceRequest, replica_id: str | None, *, msg_id: str | None = None) -> int:
        """Publish to ``SHOAL_REQUESTS``, on `replica_id`'s own subject or (None) the model's
        shared one; returns the message's stream sequence number."""
        headers = {
            subjects.HDR_REPLY_TO: request.reply_to,
            subjects.HDR_REQUEST_ID: request.request_id,
            subjects.HDR_DEADLINE: f"{request.deadline:.3f}",
            subjects.HDR_MSG_ID: msg_id or request.request_id,
        }
        subject = (subjects.replica_infer_subject(request.model, replica_id) if replica_id
                   else subjects.infer_subject(request.model))
        payload = encode_msgpack(request)
        give_up_at = min(request.deadline, time.time() + PUBLISH_RETRY_S)
        while True:
            try:
                ack = await self._bus.js.publish(subject, payload,
                                                 headers=headers, timeout=5.0)
                return ack.seq
            except (TimeoutError, nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError,
                    nats.js.errors.ServiceUnavailableError, nats.errors.ConnectionReconnectingError) as exc:
                # The stream's cluster is electing a leader, or this gateway reconnects to another
                # server: publish again (the message id de-duplicates a publish that did land).
                if time.time() >= give_up_at:
                    raise Unavailable(f"the request queue is unavailable: {exc!r}", retry_after_s=2.0) from exc
                log.info("publish_retrying", request_id=request.request_id, error=repr(exc))
                await asyncio.sleep(PUBLISH_RETRY_PAUSE_S)
            except nats.errors.Error as exc:
                raise Unavailable(f"the request queue is unavailable: {exc}", retry_after_s=2.0) from exc

    async def _next_reply(self, inbox: ReplyInbox, request: InferenceRequest, published: _Published) -> Reply:
        """The next reply; 504 at the deadline, 503 if the model's replicas keep failing meanwhile.
        A request stranded on a replica that went away is moved meanwhile."""
        while True:
            remaining = request.deadline - time.time()
            if remaining <= 0:
                raise self._deadline_exceeded()
            reply = await inbox.get(timeout_s=min(remaining, FAILURE_CHECK_S))
            if reply is not None:
                return reply
            await self._move_if_stranded(request, published)
            reason = self._cluster.failing_reason(request.model, time.time())
            if reason is not None:
                raise Unavailable(f"model {request.model!r} cannot start: {reason}",
                                  code="model_failing", retry_after_s=10.0)
            # The replica this request waits for may have failed before serving: ask again.
            await self.ensure_placed(request.model, request.deadline)

    async def _cancel(self, request: InferenceRequest, reason: str, sequence: int | None) -> None:
        """Take the request out of the queue if no replica took it yet (a replica still loading
        subscribes to cancels only when it serves, so it would never hear of this one), then
        tell the replicas: one that took it meanwhile subscribed before it fetched, so it hears
        the cancel published after the delete."""
        if sequence is not None:
            try:
                await self._bus.js.delete_msg(subjects.REQUESTS_STREAM, sequence)
            except nats.js.errors.APIError as exc:
                if exc.err_code != JS_NO_MESSAGE_FOUND:
                    log.warning("cancel_delete_failed", request_id=request.request_id, error=str(exc))
                # else: a replica took it and acked it, or it is gone already
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("cancel_delete_failed", request_id=request.request_id, error=str(exc))
        try:
            await self._bus.nc.publish(subjects.cancel_subject(request.model),
                                       encode_msgpack(CancelRequest(request.request_id, reason)))
        except nats.errors.Error as exc:
            log.warning("cancel_publish_failed", request_id=request.request_id, error=str(exc))
