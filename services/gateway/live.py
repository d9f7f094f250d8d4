"""What a gateway listens to for operators: the workers' stats, the dashboard's history, events.

* ``shoal.stats.>``: every worker's `WorkerStats`, kept in a `WorkerStatsStore`; served on
  ``/metrics`` by a `WorkerMetricsCollector` and on the dashboard.
* every `SAMPLE_INTERVAL_S` a `HistoryPoint` per model (requests/s, tokens/s, TTFT, queue
  depth; history.py), the queue depths read in one call from ``SHOAL_REQUESTS``' consumers.
* ``SHOAL_EVENTS``: one ordered consumer per gateway, starting `EVENT_BACKLOG` events back,
  fanned out to the dashboard's event streams (`EventFeed`).

Created and torn down with the gateway (app.py's ``cleanup_ctx``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy

from shoal.services.gateway.cluster import ClusterView
from shoal.services.gateway.history import History, RateTracker, TtftWindow, make_point
from shoal.services.gateway.worker_metrics import WorkerMetricsCollector, WorkerStatsStore
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import Event, WorkerStats, worker_stats_decoder
from shoal.shared.metrics import Registry
from shoal.shared.periodic import sleep_or_stop

log = structlog.get_logger(__name__)

SAMPLE_INTERVAL_S = 2.0
EVENT_BACKLOG = 200
"""Events a dashboard that opens gets from before it opened."""
MAX_LISTENER_QUEUE = 1000
"""Events a slow event stream may fall behind before it is closed (its client reconnects
with ``Last-Event-ID`` and resumes)."""

_event_decoder = msgspec.json.Decoder(Event)


@dataclass(eq=False)
class EventListener:
    """One open event stream: backlog first, then live events; None when it must close."""

    queue: asyncio.Queue[tuple[int, bytes] | None] = field(
        default_factory=lambda: asyncio.Queue(MAX_LISTENER_QUEUE))


class EventFeed:
    """``SHOAL_EVENTS`` for the dashboard: a backlog and live fan-out, one consumer per gateway."""

    def __init__(self, bus: Bus, backlog: int = EVENT_BACKLOG) -> None:
        self._bus = bus
        self._backlog: deque[tuple[int, bytes]] = deque(maxlen=backlog)
        self._listeners: set[EventListener] = set()
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        state = (await self._bus.js.stream_info(subjects.EVENTS_STREAM)).state
        if state.last_seq:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                    opt_start_seq=max(state.first_seq, state.last_seq - (self._backlog.maxlen or 0) + 1))
        else:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        self._subscription = await self._bus.js.subscribe(
            f"{subjects.EVENT_PREFIX}.>", stream=subjects.EVENTS_STREAM, ordered_consumer=True, config=config,
            cb=self._on_event)

    async def stop(self) -> None:
        self.close_listeners()
        if self._subscription is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._subscription.unsubscribe()

    def listen(self, after_seq: int = 0) -> tuple[EventListener, list[tuple[int, bytes]]]:
        """A new listener and the backlog after `after_seq` (its ``Last-Event-ID``)."""
        listener = EventListener()
        self._listeners.add(listener)
        return listener, [(seq, data) for seq, data in self._backlog if seq > after_seq]

    def forget(self, listener: EventListener) -> None:
        self._listeners.discard(listener)

    def close_listeners(self) -> None:
        """End every open event stream (the gateway stops)."""
        for listener in self._listeners:
            _close(listener)
        self._listeners.clear()

    async def _on_event(self, msg: Msg) -> None:
        try:
            _event_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.error("event_malformed", subject=msg.subject, error=str(exc))
            return
        item = (msg.metadata.sequence.stream, bytes(msg.data))
        self._backlog.append(item)
        for listener in list(self._listeners):
            try:
                listener.queue.put_nowait(item)
            except asyncio.QueueFull:
                self._listeners.discard(listener)
                _close(listener)


def _close(listener: EventListener) -> None:
    while True:
        try:
            listener.queue.put_nowait(None)
            return
        except asyncio.QueueFull:
            listener.queue.get_nowait()  # a closing listener needs no more events


class LiveFeeds:
    """The worker stats, the dashboard's history and the event feed of one gateway."""

    def __init__(self, bus: Bus, cluster: ClusterView, registry: Registry,
                 *, sample_interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self._bus = bus
        self._cluster = cluster
        self._registry = registry
        self.sample_interval_s = sample_interval_s
        self.stats = WorkerStatsStore()
        self.collector = WorkerMetricsCollector(self.stats, self.is_known)
        self.ttft = TtftWindow()
        self.history = History()
        self.events = EventFeed(bus)
        self._rates = RateTracker()
        self._subscription: Subscription | None = None
        self._sampler: asyncio.Task[None] | None = None

    def is_known(self, stats: WorkerStats) -> bool:
        """Whether a replica's record still exists (a stopped or freed replica's figures go)."""
        record = self._cluster.get_replica(stats.replica_id)
        return record is not None and record.model == stats.model

    def get_worker_stats(self) -> Iterator[WorkerStats]:
        yield from self.stats.get_current(self.is_known)

    async def start(self) -> None:
        self._registry.register_collector(self.collector)
        self._subscription = await self._bus.nc.subscribe(subjects.STATS_WILDCARD, cb=self._on_stats)
        await self.events.start()
        self._sampler = asyncio.create_task(self._sample_loop())

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            await asyncio.gather(self._sampler, return_exceptions=True)
        await self.events.stop()
        if self._subscription is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._subscription.unsubscribe()
        self._registry.unregister_collector(self.collector)

    async def _on_stats(self, msg: Msg) -> None:
        try:
            stats = worker_stats_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("worker_stats_malformed", subject=msg.subject, error=str(exc))
            return
        self.stats.put(stats)

    async def _sample_loop(self) -> None:
        while True:
            await sleep_or_stop(self.sample_interval_s)
            try:
                await self.sample()
            except Exception:  # a bug here must not stop the sampling for good
                log.exception("history_sample_failed")

    async def sample(self) -> None:
        """Add one history point for every registered model."""
        stats = list(self.get_worker_stats())
        queues = await self._get_queued()
        for replica in stats:
            queues[replica.model] = queues.get(replica.model, 0) + replica.num_requests_waiting
        at = time.time()
        point = make_point(at, list(self._cluster.models), self._rates.take_rates(at, stats),
                           self.ttft.take_means(), queues)
        self.history.add(point)

    async def _get_queued(self) -> dict[str, int]:
        """Per model, requests in ``SHOAL_REQUESTS`` no replica took yet (one call for all)."""
        try:
            consumers = await self._bus.js.consumers_info(subjects.REQUESTS_STREAM)
        except (nats.errors.Error, TimeoutError) as exc:
            log.debug("queue_depth_unavailable", error=str(exc))
            return {}
        queued: dict[str, int] = {}
        for consumer in consumers:
            name = consumer.name or ""
            if name.startswith(subjects.CONSUMER_PREFIX):
                token = name[len(subjects.CONSUMER_PREFIX):]
            elif name.startswith(subjects.REPLICA_CONSUMER_PREFIX):  # turns sent to one replica
                token = (consumer.config.filter_subject or "").removeprefix(subjects.INFER_PREFIX + ".").split(".")[0]
            else:
                continue
            try:
                model = subjects.model_key_from_token(token)
            except subjects.InvalidModelToken:
                continue
            queued[model] = queued.get(model, 0) + (consumer.num_pending or 0)
        return queued
