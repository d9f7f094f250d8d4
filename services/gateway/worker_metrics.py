"""The workers' stats, as a gateway hears them, and their Prometheus metrics.

Every worker publishes a `WorkerStats` every few seconds (services/worker/stats.py);
`WorkerStatsStore` keeps the latest per replica, and `WorkerMetricsCollector` serves
them at each scrape of the gateway's ``/metrics``, labelled by ``model``, ``replica``
and ``node``, so one Prometheus scrape sees the whole cluster.

A replica leaves the metrics when its record leaves ``shoal_replicas`` (stopped,
evicted, failed and freed) or when it has been silent for `STALE_INTERVALS` of its
own publishing interval (a worker that died without its record being cleaned up yet).

Pure: no NATS, no asyncio; the clock is injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from shoal.shared.messages import SessionStats, WorkerStats

STALE_INTERVALS = 3.0
"""A replica silent for this many of its publishing intervals is dropped."""
MIN_STALE_S = 5.0
LABELS = ("model", "replica", "node")


@dataclass(frozen=True)
class MetricSpec:
    """One worker metric as the table in docs/operations.md documents it."""

    name: str
    kind: str
    documentation: str


WORKER_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("shoal_worker_requests_running", "gauge", "Requests in the replica's running batch"),
    MetricSpec("shoal_worker_requests_waiting", "gauge",
               "Requests the replica took from the queue that wait for room in a batch"),
    MetricSpec("shoal_worker_requests_total", "counter", "Requests the replica finished, by outcome"),
    MetricSpec("shoal_worker_prompt_tokens_total", "counter", "Prompt tokens of finished requests"),
    MetricSpec("shoal_worker_generation_tokens_total", "counter", "Tokens generated"),
    MetricSpec("shoal_worker_last_request_timestamp_seconds", "gauge",
               "When the replica last took a request (unix time)"),
    MetricSpec("shoal_worker_serving", "gauge", "1 while the replica takes requests, 0 while parked or draining"),
    MetricSpec("shoal_worker_kv_cache_blocks", "gauge", "KV blocks in the replica's pool"),
    MetricSpec("shoal_worker_kv_cache_used_blocks", "gauge", "KV blocks held by sequences"),
    MetricSpec("shoal_worker_kv_cache_free_blocks", "gauge",
               "KV blocks an allocation may take (free, or cached and unused)"),
    MetricSpec("shoal_worker_kv_cache_usage_ratio", "gauge", "Used KV blocks over all KV blocks (0-1)"),
    MetricSpec("shoal_worker_kv_cache_bytes", "gauge", "Bytes of the replica's KV pool"),
    MetricSpec("shoal_worker_prefix_cache_queries_total", "counter", "Full KV blocks looked up in the prefix cache"),
    MetricSpec("shoal_worker_prefix_cache_hits_total", "counter", "Full KV blocks found in the prefix cache"),
    MetricSpec("shoal_worker_preemptions_total", "counter",
               "Sequences preempted (their KV dropped, recomputed later)"),
    MetricSpec("shoal_worker_batch_size", "gauge", "Mean sequences per engine step over the last interval"),
    MetricSpec("shoal_worker_step_duration_seconds", "summary", "Engine steps (forward pass and sampling)"),
    MetricSpec("shoal_worker_sessions", "gauge", "Chat sessions whose KV the replica keeps between turns"),
    MetricSpec("shoal_worker_session_bytes", "gauge", "Bytes of cached sessions' KV, by tier (gpu, cpu)"),
    MetricSpec("shoal_worker_session_host_pool_bytes", "gauge", "Bytes of the replica's host pool (the CPU tier)"),
    MetricSpec("shoal_worker_session_turns_total", "counter",
               "Turns with a session id, by result: hit (reused cached KV) or miss"),
    MetricSpec("shoal_worker_session_tokens_total", "counter",
               "Prompt tokens of returning turns, by source (gpu, cpu, prefix_cache, recomputed, new)"),
    MetricSpec("shoal_worker_session_swap_bytes_total", "counter",
               "Session KV bytes copied between tiers, by direction (in: CPU to GPU, out: GPU to CPU)"),
    MetricSpec("shoal_worker_session_swap_exposed_seconds_total", "counter",
               "Time forward passes waited for session KV copied back to the GPU"),
    MetricSpec("shoal_worker_session_chunks_total", "counter",
               "Session chunks moved by the eviction policy, by event (demoted to CPU, dropped)"),
    MetricSpec("shoal_worker_session_expired_total", "counter", "Sessions forgotten after their idle timeout"),
)
"""Every metric the collector serves (the docs table and the Grafana dashboard are checked
against it)."""
_DOCS = {spec.name: spec.documentation for spec in WORKER_METRICS}


def _stale_after(stats: WorkerStats) -> float:
    return max(MIN_STALE_S, STALE_INTERVALS * stats.interval_s)


@dataclass
class _Heard:
    stats: WorkerStats
    received_at: float
    batch_size: float | None


class WorkerStatsStore:
    """The latest stats of each replica, by replica id."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heard: dict[str, _Heard] = {}

    def put(self, stats: WorkerStats) -> None:
        previous = self._heard.get(stats.replica_id)
        batch_size = None
        if previous is not None and stats.num_steps > previous.stats.num_steps:
            batch_size = (stats.num_step_seqs - previous.stats.num_step_seqs) / (
                stats.num_steps - previous.stats.num_steps)
        elif previous is not None and stats.num_steps == previous.stats.num_steps:
            batch_size = 0.0
        self._heard[stats.replica_id] = _Heard(stats, self._clock(), batch_size)

    def forget(self, replica_id: str) -> None:
        self._heard.pop(replica_id, None)

    def get_current(self, is_known: Callable[[WorkerStats], bool] = lambda _: True) -> list[WorkerStats]:
        """Stats of the replicas heard recently that `is_known` still accepts (their record
        exists); drops the others for good."""
        return [heard.stats for heard in self._current(is_known)]

    def get_latest(self, replica_id: str) -> WorkerStats | None:
        """The latest stats of `replica_id`, if heard recently."""
        heard = self._heard.get(replica_id)
        if heard is None or self._clock() - heard.received_at > _stale_after(heard.stats):
            return None
        return heard.stats

    def get_batch_size(self, replica_id: str) -> float | None:
        heard = self._heard.get(replica_id)
        return heard.batch_size if heard is not None else None

    def _current(self, is_known: Callable[[WorkerStats], bool]) -> list[_Heard]:
        at = self._clock()
        current = []
        for replica_id, heard in list(self._heard.items()):
            if at - heard.received_at > _stale_after(heard.stats) or not is_known(heard.stats):
                del self._heard[replica_id]
            else:
                current.append(heard)
        return current

    def collect_heard(self, is_known: Callable[[WorkerStats], bool]) -> list[tuple[WorkerStats, float | None]]:
        return [(heard.stats, heard.batch_size) for heard in self._current(is_known)]


class WorkerMetricsCollector(Collector):
    """Serves `WORKER_METRICS` for every current replica at each scrape."""

    def __init__(self, store: WorkerStatsStore, is_known: Callable[[WorkerStats], bool]) -> None:
        self._store = store
        self._is_known = is_known

    def describe(self) -> Iterable[object]:
        return []  # the families exist only while workers report: nothing to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | SummaryMetricFamily]:
        heard = self._store.collect_heard(self._is_known)
        docs = _DOCS

        def gauge(name: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, docs[name], labels=LABELS)

        def counter(name: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(name, docs[name], labels=(*LABELS, *extra))

        running, waiting = gauge("shoal_worker_requests_running"), gauge("shoal_worker_requests_waiting")
        requests = counter("shoal_worker_requests_total", ("outcome",))
        prompt, generated = counter("shoal_worker_prompt_tokens_total"), counter("shoal_worker_generation_tokens_total")
        last_request, serving = gauge("shoal_worker_last_request_timestamp_seconds"), gauge("shoal_worker_serving")
        blocks, used, free = (gauge("shoal_worker_kv_cache_blocks"), gauge("shoal_worker_kv_cache_used_blocks"),
                              gauge("shoal_worker_kv_cache_free_blocks"))
        usage, kv_bytes = gauge("shoal_worker_kv_cache_usage_ratio"), gauge("shoal_worker_kv_cache_bytes")
        queries = counter("shoal_worker_prefix_cache_queries_total")
        hits = counter("shoal_worker_prefix_cache_hits_total")
        preemptions = counter("shoal_worker_preemptions_total")
        batch = gauge("shoal_worker_batch_size")
        steps = SummaryMetricFamily("shoal_worker_step_duration_seconds", docs["shoal_worker_step_duration_seconds"],
                                    labels=LABELS)
        sessions = _SessionFamilies(gauge, counter)
        for stats, batch_size in heard:
            labels = [stats.model, stats.replica_id, stats.node_id]
            running.add_metric(labels, stats.num_requests_running)
            waiting.add_metric(labels, stats.num_requests_waiting)
            for outcome, count in sorted(stats.num_requests_by_outcome.items()):
                requests.add_metric([*labels, outcome], count)
            prompt.add_metric(labels, stats.num_prompt_tokens)
            generated.add_metric(labels, stats.num_generated_tokens)
            if stats.last_request_at is not None:
                last_request.add_metric(labels, stats.last_request_at)
            serving.add_metric(labels, 1.0 if stats.serving else 0.0)
            kv = stats.kv_cache
            if kv is not None:
                blocks.add_metric(labels, kv.num_blocks)
                used.add_metric(labels, kv.num_used_blocks)
                free.add_metric(labels, kv.num_free_blocks)
                usage.add_metric(labels, kv.num_used_blocks / kv.num_blocks if kv.num_blocks else 0.0)
                kv_bytes.add_metric(labels, kv.num_blocks * kv.block_bytes)
                queries.add_metric(labels, kv.num_cache_queries)
                hits.add_metric(labels, kv.num_cache_hits)
            if stats.engine == "paged":
                preemptions.add_metric(labels, stats.num_preemptions)
                steps.add_metric(labels, count_value=stats.num_steps, sum_value=stats.step_seconds)
                if batch_size is not None:
                    batch.add_metric(labels, batch_size)
            if stats.sessions is not None:
                sessions.add(labels, stats.sessions)
        yield from (running, waiting, requests, prompt, generated, last_request, serving, blocks, used, free, usage,
                    kv_bytes, queries, hits, preemptions, batch, steps, *sessions.families())


class _SessionFamilies:
    """The session cache's metric families (docs/sessions.md, "Observability")."""

    def __init__(self, gauge: Callable[[str], GaugeMetricFamily],
                 counter: Callable[[str, tuple[str, ...]], CounterMetricFamily]) -> None:
        self.cached = gauge("shoal_worker_sessions")
        self.bytes = GaugeMetricFamily("shoal_worker_session_bytes", _DOCS["shoal_worker_session_bytes"],
                                       labels=(*LABELS, "tier"))
        self.host_pool = gauge("shoal_worker_session_host_pool_bytes")
        self.turns = counter("shoal_worker_session_turns_total", ("result",))
        self.tokens = counter("shoal_worker_session_tokens_total", ("source",))
        self.swap = counter("shoal_worker_session_swap_bytes_total", ("direction",))
        self.exposed = counter("shoal_worker_session_swap_exposed_seconds_total", ())
        self.chunks = counter("shoal_worker_session_chunks_total", ("event",))
        self.expired = counter("shoal_worker_session_expired_total", ())

    def add(self, labels: list[str], stats: SessionStats) -> None:
        self.cached.add_metric(labels, stats.num_sessions)
        self.bytes.add_metric([*labels, "gpu"], stats.gpu_bytes)
        self.bytes.add_metric([*labels, "cpu"], stats.cpu_bytes)
        self.host_pool.add_metric(labels, stats.host_pool_bytes)
        self.turns.add_metric([*labels, "hit"], stats.num_hits)
        self.turns.add_metric([*labels, "miss"], stats.num_misses)
        for source, count in (("gpu", stats.num_gpu_reused_tokens), ("cpu", stats.num_cpu_restored_tokens),
                              ("prefix_cache", stats.num_prefix_cached_tokens),
                              ("recomputed", stats.num_recomputed_tokens), ("new", stats.num_new_tokens)):
            self.tokens.add_metric([*labels, source], count)
        self.swap.add_metric([*labels, "in"], stats.swap_in_bytes)
        self.swap.add_metric([*labels, "out"], stats.swap_out_bytes)
        self.exposed.add_metric(labels, stats.exposed_swap_seconds)
        self.chunks.add_metric([*labels, "demoted"], stats.num_demoted_chunks)
        self.chunks.add_metric([*labels, "dropped"], stats.num_dropped_chunks)
        self.expired.add_metric(labels, stats.num_expired_sessions)

    def families(self) -> tuple[GaugeMetricFamily | CounterMetricFamily, ...]:
        return (self.cached, self.bytes, self.host_pool, self.turns, self.tokens, self.swap, self.exposed,
                self.chunks, self.expired)
