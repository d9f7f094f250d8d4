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

Failover (docs/reliability.md): a worker names the replica and the ack subject of each
attempt it starts (`AttemptNotice`). When that replica's record turns ``failed`` (its node
agent saw the process exit), the gateway NAKs the delivery, so the request runs again at
once instead of after ``ack_wait``; a stream that can neither resume nor restart ends with
its error event then. A request that two replicas died running is given up (TERM, 500).
Replies are checked: a gap in chunk numbers, a final reply whose count differs, or a final
reply that never came although the message was acked, publish the request again under a
new wire id (a new *try*), which restarts or resumes as above — never a 200 with text
missing. JetStream's max-deliveries advisory ends a request at once.

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
from dataclasses import dataclass, field
from typing import TypeAlias

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

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
from shoal.services.gateway.router import DeliveriesExhausted, InboxItem, ReplicaDied, ReplyInbox, ReplyRouter
from shoal.services.gateway.service_calls import ask_scheduler
from shoal.services.gateway.session_routes import SessionRoutes
from shoal.services.gateway.worker_metrics import WorkerStatsStore
from shoal.shared import subjects
from shoal.shared.bus import MOVED_ATTEMPT_OFFSET, Bus, is_message_gone
from shoal.shared.config import GatewayConfig
from shoal.shared.messages import (
    CancelRequest,
    EnsureModel,
    ErrorReply,
    FinalReply,
    InferenceRequest,
    PingWorker,
    ReplicaRecord,
    TokenChunk,
    encode_msgpack,
    worker_reply_decoder,
)
from shoal.shared.metrics import Registry
from shoal.shared.micro import ServiceCallError, request_json

log = structlog.get_logger(__name__)

FAILURE_CHECK_S = 1.0
"""While waiting, how often a request checks whether its model's replicas keep failing."""
LOST_CHECK_S = 5.0
"""A running attempt silent this long: check that its message is still queued (if it was acked,
its final reply was lost)."""
MAX_TRIES = 3
"""Times a request is published when its replies keep getting lost."""
MAX_REPLICA_DEATHS = 2
"""Replicas a request may see die while running it; then it is given up (a poison request)."""
PUBLISH_RETRY_S = 30.0
"""How long a request's publish is retried while the stream cannot take it (a NATS cluster
electing a leader, the gateway reconnecting), within its deadline."""
PUBLISH_RETRY_PAUSE_S = 0.25
LOST_PING_TRIES = 3
LOST_PING_TIMEOUT_S = 2.0
LOST_PING_PAUSE_S = 1.0
"""A lost replica's worker is pinged up to `LOST_PING_TRIES` times, this far apart (a worker
reconnecting to NATS has no responders for a moment), before its requests fail over."""
WAITED_OUT_STATUSES = frozenset({"no_victim", "contended"})
"""Scheduler refusals that clear by themselves (an occupant's minimum runtime ends, a CAS race
is lost), which `GatewayConfig.capacity_wait_s` lets a request wait out."""
MIN_CAPACITY_RETRY_S = 0.5
CAPACITY_POLL_S = 1.0
"""A request waiting out a refusal looks this often for a replica placed meanwhile."""
MAX_DELIVERIES_ADVISORY = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{subjects.REQUESTS_STREAM}.>"


class MaxDeliveriesAdvisory(msgspec.Struct):
    """JetStream's io.nats.jetstream.advisory.v1.max_deliver (the fields Shoal reads)."""

    stream_seq: int
    deliveries: int = 0


max_deliveries_decoder = msgspec.json.Decoder(MaxDeliveriesAdvisory)


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
    at: float = field(default_factory=time.time)
    """When it was published (unix time): a waiting request's capacity wait counts from then."""
    tracked: bool = True
    """`sequence` is the request's message; False once its replica moved it (the copy's
    sequence is unknown here), so a missing message then says nothing."""


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
        self._capacity_waits = metrics.counter(
            "shoal_gateway_capacity_waits_total",
            "Times a request waited out a refusal to place its model (gateway.capacity_wait_s)", ["model"])
        self._session_turns = metrics.counter(
            "shoal_gateway_session_turns_total", "Turns of chat sessions, by where they were sent", ["model", "route"]
        )
        self._moved = metrics.counter(
            "shoal_gateway_requests_moved_total",
            "Requests moved from a replica's own subject to the shared queue (the replica went away)", ["model"]
        )
        self._failovers = metrics.counter("shoal_gateway_failovers_total",
                                          "Deliveries NAKed because the replica running them died", ["model"])
        self._lost_replies = metrics.counter("shoal_gateway_lost_replies_total",
                                             "Attempts whose replies were lost on the way (published again)",
                                             ["model"])
        self._queued_gone = metrics.counter(
            "shoal_gateway_queued_requests_gone_total",
            "Waiting requests whose queued message vanished (a model removed meanwhile: published again)", ["model"])
        self._running_on: dict[str, set[str]] = {}
        """Replica id -> wire ids of the requests whose current attempt runs there."""
        self._lost_checks: set[asyncio.Task[None]] = set()
        self._replica_of: dict[str, str] = {}
        self._wire_by_seq: dict[int, str] = {}
        """Stream sequence -> wire id of every request waiting for replies."""
        self._advisories: Subscription | None = None

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
                                  code="rate_limit_exceeded", retry_after_s=1.0)
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
        model at a time); 504 if `deadline` (unix time) passes first. A refusal that will
        clear (`WAITED_OUT_STATUSES`) is asked again after its Retry-After for up to
        `capacity_wait_s`, within the deadline; then it is the request's 503."""
        give_up_at = min(deadline, time.time() + self._config.capacity_wait_s)
        while True:
            try:
                return await self._ensure_placed_once(model, deadline)
            except Unavailable as exc:
                delay_s = max(MIN_CAPACITY_RETRY_S, exc.retry_after_s or MIN_CAPACITY_RETRY_S)
                self._wait_out(model, exc, time.time() + delay_s <= give_up_at)
                log.info("capacity_wait", model=model, reason=exc.message, retry_after_s=round(delay_s, 1))
                await self._until_placed(model, delay_s)

    def _wait_out(self, model: str, refusal: Unavailable, in_time: bool) -> None:
        """Count `refusal` as one a request waits out, or raise it: it will not clear by itself
        (`WAITED_OUT_STATUSES`), or the wait would not end `in_time`."""
        if refusal.code not in WAITED_OUT_STATUSES or not in_time:
            raise refusal
        self._capacity_waits.inc(model=model)

    async def _until_placed(self, model: str, timeout_s: float) -> None:
        """Wait `timeout_s`, or less if a replica of `model` is placed meanwhile (by another
        request, another gateway): a waiter is not left behind newer arrivals."""
        waited_until = time.monotonic() + timeout_s
        while (left := waited_until - time.monotonic()) > 0 and not self._cluster.has_active_replica(model):
            await asyncio.sleep(min(CAPACITY_POLL_S, left))

    async def _keep_placed(self, model: str, deadline: float, waiting_since: float) -> None:
        """For a published request waiting for a replica: ask for one once; a refusal that will
        clear is waited out (the caller asks again a second later) for `capacity_wait_s` from
        `waiting_since`, then it is the request's 503."""
        try:
            await self._ensure_placed_once(model, deadline)
        except Unavailable as exc:
            self._wait_out(model, exc, time.time() < min(deadline, waiting_since + self._config.capacity_wait_s))
            log.debug("capacity_wait", model=model, reason=exc.message, retry_after_s=exc.retry_after_s)

    async def _ensure_placed_once(self, model: str, deadline: float) -> None:
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

    async def serving_replica(self, model: str, deadline: float) -> ReplicaRecord:
        """A replica of `model` whose worker runs (ready, or draining), placed or woken first if
        there is none; 504 if `deadline` (unix time) passes first."""
        while True:
            serving = [r for r in self._cluster.get_active_replicas(model) if r.state in ("ready", "draining")]
            if serving:
                return min(serving, key=lambda r: r.state != "ready")  # a draining one is about to go
            await self.ensure_placed(model, deadline)
            if time.time() >= deadline:
                raise DeadlineExceeded(f"no replica of {model!r} was serving within the request's deadline")
            await asyncio.sleep(0.1)

    def _ensured(self, model: str, done: asyncio.Future[None]) -> None:
        self._ensuring.pop(model, None)
        if not done.cancelled():
            done.exception()  # retrieved: every waiter may have given up at its deadline

    def _deadline_exceeded(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"the request did not finish within its deadline ({self._config.request_timeout_s:g}s)"
        )

    async def _ask_scheduler(self, model: str) -> None:
        reply = await ask_scheduler(self._bus, "ensure", EnsureModel(model), timeout_s=60.0)
        if not reply.ok:
            raise Unavailable(f"model {model!r} cannot be placed now: {reply.message}",
                              code=reply.status, retry_after_s=reply.retry_after_s or 5.0)

    async def start(self) -> None:
        """Follow replica failures (to fail over at once) and JetStream's max-deliveries
        advisories (to answer at once when a request's deliveries run out)."""
        self._cluster.add_replica_listener(self._on_replica_changed)
        self._advisories = await self._bus.nc.subscribe(MAX_DELIVERIES_ADVISORY, cb=self._on_max_deliveries)

    async def stop(self) -> None:
        if self._advisories is not None:
            await self._advisories.unsubscribe()
        for task in list(self._lost_checks):
            task.cancel()

    async def run(self, request: InferenceRequest, *, restartable: bool) -> AsyncGenerator[DispatchEvent, None]:
        """Publish `request` and yield its chunks and final reply (see the module doc).

        Args:
            restartable: the caller has sent nothing yet and can drop text on `Restart`.

        Raises:
            ApiError: the worker's error, 504 at the deadline, StreamBroken.
        """
        started = time.monotonic()
        tracker = AttemptTracker(reproducible=request.params.is_reproducible, restartable=restartable,
                                 max_deaths=MAX_REPLICA_DEATHS)
        for try_number in range(MAX_TRIES):
            wire = request if try_number == 0 else self._next_try(request, try_number)
            tracker.begin_try()
            inbox = self._router.open(wire.request_id)
            finished = False
            published: _Published | None = None
            try:
                route = await self._route(wire) if try_number == 0 else SHARED_QUEUE["none"]
                published = _Published(route.replica_id, await self._publish(wire, route.replica_id))
                self._wire_by_seq[published.sequence] = wire.request_id
                while True:
                    item = await self._next_reply(inbox, wire, tracker, published)
                    if item is None:  # the attempt's last reply was lost: next try
                        break
                    if isinstance(item, ReplicaDied):
                        await self._on_death(wire, tracker, item.replica_id)
                        continue
                    if isinstance(item, DeliveriesExhausted):
                        raise ApiError(f"the request was delivered {item.num_deliveries} times and never "
                                          "finished; it is not retried", code="deliveries_exhausted")
                    actions = tracker.on_reply(item)
                    self._follow_attempt(wire.request_id, tracker)
                    if "lost" in actions:
                        log.warning("reply_lost", request_id=request.request_id, attempt=item.attempt,
                                    try_number=try_number)
                        self._lost_replies.inc(model=request.model)
                        break
                    for action in actions:
                        match action:
                            case "resume":
                                log.warning("stream_resumed", request_id=request.request_id, attempt=item.attempt)
                            case "restart":
                                yield Restart()
                            case "broken":
                                raise StreamBroken("the replica serving this stream failed; retry the request")
                            case "deliver":
                                assert isinstance(item, TokenChunk), "only chunks are delivered"
                                if tracker.num_sent == 1:
                                    self._observe_first_token(request.model, time.monotonic() - started)
                                yield item
                            case "finish":
                                assert isinstance(item, FinalReply), "only a final reply finishes"
                                finished = True
                                if request.session_id is not None and item.replica_id and self._session_routes:
                                    await self._session_routes.put(request.model, request.session_id,
                                                                   item.replica_id)
                                yield item
                                return
                            case "error":
                                assert isinstance(item, ErrorReply), "only an error reply is an error"
                                finished = True
                                raise self._worker_error(request, item)
            finally:
                self._router.close(wire.request_id)
                self._forget_attempt(wire.request_id)
                if published is not None:
                    self._wire_by_seq.pop(published.sequence, None)
                if not finished:
                    await self._cancel(wire, "client disconnected, deadline passed or replies lost",
                                       published.sequence if published else None)
        raise StreamBroken("the request's replies kept getting lost on the way; retry the request")

    def _next_try(self, request: InferenceRequest, try_number: int) -> InferenceRequest:
        """The request published again under a new wire id (its own reply subject, queue
        de-duplication id and cancel id)."""
        wire_id = f"{request.request_id}-try{try_number}"
        return msgspec.structs.replace(request, request_id=wire_id, reply_to=self._router.reply_subject(wire_id))

    def _observe_first_token(self, model: str, ttft_s: float) -> None:
        self._ttft.observe(ttft_s, model=model)
        if self._on_first_token is not None:
            self._on_first_token(model, ttft_s)

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
            if not is_message_gone(exc):
                log.warning("request_move_failed", request_id=request.request_id, error=str(exc))
                return
            published.replica_id = None  # acked (answered), or moved by its replica already
            published.tracked = False
            return
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("request_move_failed", request_id=request.request_id, error=str(exc))
            return
        log.warning("request_moved_to_shared_queue", request_id=request.request_id, replica=published.replica_id)
        self._moved.inc(model=request.model)
        moved = msgspec.structs.replace(request, attempt_offset=MOVED_ATTEMPT_OFFSET)
        self._wire_by_seq.pop(published.sequence, None)
        published.sequence = await self._publish(moved, None, msg_id=request.request_id + subjects.MOVED_MSG_ID_SUFFIX)
        published.replica_id = None
        self._wire_by_seq[published.sequence] = request.request_id

    # ------------------------------------------------------------------ failover

    def _follow_attempt(self, wire_id: str, tracker: AttemptTracker) -> None:
        """Index the request by the replica running its current attempt (for `_on_replica_changed`)."""
        self._forget_attempt(wire_id)
        if tracker.is_running and tracker.replica_id:
            self._running_on.setdefault(tracker.replica_id, set()).add(wire_id)
            self._replica_of[wire_id] = tracker.replica_id

    def _forget_attempt(self, wire_id: str) -> None:
        replica_id = self._replica_of.pop(wire_id, None)
        if replica_id is not None:
            wire_ids = self._running_on.get(replica_id)
            if wire_ids is not None:
                wire_ids.discard(wire_id)
                if not wire_ids:
                    del self._running_on[replica_id]

    def _on_replica_changed(self, previous: ReplicaRecord | None, current: ReplicaRecord | None) -> None:
        """A replica record changed (ClusterView): when it turns failed, every request whose
        current attempt runs there hears of it at once. When it turns lost (its node agent went
        silent), its worker may still be serving, so it is asked first (`_check_lost`)."""
        if current is None or (previous is not None and previous.state == current.state):
            return
        if current.state == "failed":
            self._signal_died(current.replica_id)
        elif current.state == "lost" and current.replica_id in self._running_on:
            task = asyncio.create_task(self._check_lost(current.replica_id))
            self._lost_checks.add(task)
            task.add_done_callback(self._lost_checks.discard)

    def _signal_died(self, replica_id: str) -> None:
        for wire_id in list(self._running_on.get(replica_id, ())):
            self._router.signal(wire_id, ReplicaDied(replica_id))

    async def _check_lost(self, replica_id: str) -> None:
        """A lost replica's requests fail over when its worker does not answer a ping either
        (its node died with it): at once, not after ``ack_wait``. A worker that answers keeps
        them (only its agent is cut off; it serves on)."""
        for _ in range(LOST_PING_TRIES):
            try:
                await request_json(self._bus.nc, subjects.worker_subject(replica_id, "ping"), PingWorker(replica_id),
                                   worker_reply_decoder, timeout_s=LOST_PING_TIMEOUT_S)
                return
            except ServiceCallError as exc:
                log.info("lost_replica_ping_failed", replica=replica_id, error=str(exc))
            except nats.errors.Error as exc:  # the gateway's own connection: try again
                log.warning("lost_replica_ping_error", replica=replica_id, error=str(exc))
            await asyncio.sleep(LOST_PING_PAUSE_S)
        log.warning("lost_replica_worker_gone", replica=replica_id)
        self._signal_died(replica_id)

    async def _on_death(self, wire: InferenceRequest, tracker: AttemptTracker, replica_id: str) -> None:
        """The replica running `wire`'s current attempt died (see `AttemptTracker.on_replica_failed`)."""
        ack_subject = tracker.ack_subject
        action = tracker.on_replica_failed(replica_id)
        self._forget_attempt(wire.request_id)
        logger = log.bind(request_id=wire.request_id, replica=replica_id, action=action)
        match action:
            case "ignore":
                return
            case "nak":
                logger.warning("replica_died_failing_over")
                self._failovers.inc(model=wire.model)
                await self._ack(ack_subject, b"-NAK")
            case "broken":
                logger.warning("replica_died_stream_broken")
                raise StreamBroken("the replica serving this stream failed; retry the request")
            case "poison":
                logger.error("request_poison", deaths=tracker.num_deaths)
                await self._ack(ack_subject, b"+TERM")
                raise ApiError(f"the request was running on {tracker.num_deaths} replicas that failed while "
                                  "running it; it is not retried", code="replicas_failed")

    async def _ack(self, ack_subject: str, verb: bytes) -> None:
        """NAK or TERM a JetStream delivery on behalf of a replica that died."""
        if not ack_subject.startswith("$JS.ACK."):
            return
        try:
            await self._bus.nc.publish(ack_subject, verb)
        except nats.errors.Error as exc:  # it is redelivered after ack_wait anyway
            log.warning("failover_ack_failed", verb=verb.decode(), error=str(exc))

    async def _on_max_deliveries(self, msg: Msg) -> None:
        try:
            advisory = max_deliveries_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("advisory_malformed", subject=msg.subject, error=str(exc))
            return
        wire_id = self._wire_by_seq.get(advisory.stream_seq)
        if wire_id is not None:
            self._router.signal(wire_id, DeliveriesExhausted(advisory.deliveries))

    @staticmethod
    def _worker_error(request: InferenceRequest, reply: ErrorReply) -> ApiError:
        error = error_for_status(reply.status, reply.message, code=reply.code)
        if reply.status == 400:
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

    async def _next_reply(self, inbox: ReplyInbox, request: InferenceRequest, tracker: AttemptTracker,
                          published: _Published) -> InboxItem | None:
        """The next reply or signal; 504 at the deadline, 503 if the model's replicas keep failing
        meanwhile. None when the running attempt's final reply was lost (its message is gone from
        the queue: acked) or the waiting request's message is gone (purged), nothing having come
        for `LOST_CHECK_S`: the caller publishes it again. A request stranded on a replica that
        went away is moved meanwhile."""
        silent_since = time.monotonic()
        while True:
            remaining = request.deadline - time.time()
            if remaining <= 0:
                raise self._deadline_exceeded()
            reply = await inbox.get(timeout_s=min(remaining, FAILURE_CHECK_S))
            if reply is not None:
                return reply
            if tracker.is_running:
                if time.monotonic() - silent_since >= LOST_CHECK_S:
                    if not await self._still_queued(published.sequence):
                        log.warning("final_reply_lost", request_id=request.request_id)
                        self._lost_replies.inc(model=request.model)
                        return None
                    silent_since = time.monotonic()
                continue
            if published.replica_id is None and published.tracked and time.monotonic() - silent_since >= LOST_CHECK_S:
                # Waiting in the shared queue, no replica took it: its message must still be
                # there. A model removed and registered again meanwhile purged it; publish again.
                if not await self._still_queued(published.sequence):
                    log.warning("queued_request_gone", request_id=request.request_id)
                    self._queued_gone.inc(model=request.model)
                    return None
                silent_since = time.monotonic()
            await self._move_if_stranded(request, published)
            reason = self._cluster.failing_reason(request.model, time.time())
            if reason is not None:
                raise Unavailable(f"model {request.model!r} cannot start: {reason}",
                                  code="model_failing", retry_after_s=10.0)
            # The replica this request waits for may have failed before serving: ask again
            # (once: the inbox is read meanwhile), a refusal that will clear waited out.
            await self._keep_placed(request.model, request.deadline, published.at)

    async def _still_queued(self, sequence: int) -> bool:
        """Whether the request's message is still in ``SHOAL_REQUESTS`` (a work queue: its ack
        removes it). True when NATS cannot tell now."""
        try:
            await self._bus.js.get_msg(subjects.REQUESTS_STREAM, sequence)
        except nats.js.errors.NotFoundError:
            return False
        except nats.js.errors.APIError as exc:
            return not is_message_gone(exc)
        except (TimeoutError, nats.errors.Error):
            return True
        return True

    async def _cancel(self, request: InferenceRequest, reason: str, sequence: int | None) -> None:
        """Take the request out of the queue if no replica took it yet (a replica still loading
        subscribes to cancels only when it serves, so it would never hear of this one), then
        tell the replicas: one that took it meanwhile subscribed before it fetched, so it hears
        the cancel published after the delete."""
        if sequence is not None:
            try:
                await self._bus.js.delete_msg(subjects.REQUESTS_STREAM, sequence)
            except nats.js.errors.APIError as exc:
                if not is_message_gone(exc):
                    log.warning("cancel_delete_failed", request_id=request.request_id, error=str(exc))
                # else: a replica took it and acked it, or it is gone already
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("cancel_delete_failed", request_id=request.request_id, error=str(exc))
        try:
            await self._bus.nc.publish(subjects.cancel_subject(request.model),
                                       encode_msgpack(CancelRequest(request.request_id, reason)))
        except nats.errors.Error as exc:
            log.warning("cancel_publish_failed", request_id=request.request_id, error=str(exc))
