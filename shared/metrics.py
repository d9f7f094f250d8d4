"""Prometheus metrics: a thin facade over `prometheus_client`.

Every service registers its metrics through a `Registry` (one per process, each on its own
`prometheus_client.CollectorRegistry`, so tests and `shoal up`'s services never collide in
the library's global registry):

    requests = registry.counter("shoal_gateway_requests_total", "HTTP inference requests", ["model"])
    requests.inc(model="demo/llama-5m")
    registry.render()          # what GET /metrics serves

Every metric name must start with ``shoal_``; counters end in ``_total`` (the library
adds it when missing, so a counter is always exposed under that name). Figures gathered
elsewhere (the workers' stats, which reach the gateway over NATS) are served by a custom
collector given to `Registry.register_collector`. ``*_created`` series are off: Prometheus
does not need them and they double every counter's lines.
"""

from __future__ import annotations

from collections.abc import Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

PREFIX = "shoal_"
DEFAULT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = prometheus_client.exposition.CONTENT_TYPE_PLAIN_0_0_4
"""What ``GET /metrics`` answers with: the text format every Prometheus version reads."""

prometheus_client.disable_created_metrics()


class _Metric:
    """One metric family: a library metric and the label names it was declared with."""

    def __init__(self, metric: prometheus_client.Counter | prometheus_client.Gauge | prometheus_client.Histogram,
                 name: str, labelnames: Sequence[str]) -> None:
        self._metric = metric
        self.name = name
        self.labelnames = tuple(labelnames)

    def _child(self, labels: dict[str, str]):  # type: ignore[no-untyped-def]
        assert set(labels) == set(self.labelnames), (
            f"{self.name}: labels {sorted(labels)} != declared {sorted(self.labelnames)}"
        )
        return self._metric.labels(**labels) if self.labelnames else self._metric


class Counter(_Metric):
    def inc(self, amount: float = 1.0, **labels: str) -> None:
        assert amount >= 0, f"{self.name}: counters only go up"
        self._child(labels).inc(amount)

    def get(self, **labels: str) -> float:
        """The current value (0 for labels never counted)."""
        return _sample_value(self._metric, self.name, labels)


class Gauge(_Metric):
    def set(self, value: float, **labels: str) -> None:
        self._child(labels).set(value)

    def get(self, **labels: str) -> float:
        return _sample_value(self._metric, self.name, labels)


class Histogram(_Metric):
    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)


def _sample_value(metric: prometheus_client.Counter | prometheus_client.Gauge | prometheus_client.Histogram,
                  name: str, labels: dict[str, str]) -> float:
    for family in metric.collect():
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


class Registry:
    """Holds a process's metrics; each service registers its own at start. Registering a
    name again returns the metric already there (`shoal up` runs several services on one)."""

    def __init__(self) -> None:
        self.collector_registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, _Metric] = {}

    def _existing(self, name: str, kind: type[_Metric], labelnames: Sequence[str]) -> _Metric | None:
        assert name.startswith(PREFIX), f"metric {name!r} must use the {PREFIX!r} prefix"
        existing = self._metrics.get(name)
        if existing is not None:
            assert type(existing) is kind, f"metric {name} registered twice with different types"
            assert existing.labelnames == tuple(labelnames), f"metric {name} registered twice with different labels"
        return existing

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        name = name if name.endswith("_total") else name + "_total"
        if (existing := self._existing(name, Counter, labelnames)) is not None:
            return existing  # type: ignore[return-value]
        metric = prometheus_client.Counter(name, documentation, labelnames, registry=self.collector_registry)
        self._metrics[name] = counter = Counter(metric, name, labelnames)
        return counter

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        if (existing := self._existing(name, Gauge, labelnames)) is not None:
            return existing  # type: ignore[return-value]
        metric = prometheus_client.Gauge(name, documentation, labelnames, registry=self.collector_registry)
        self._metrics[name] = gauge = Gauge(metric, name, labelnames)
        return gauge

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS_S,
    ) -> Histogram:
        if (existing := self._existing(name, Histogram, labelnames)) is not None:
            return existing  # type: ignore[return-value]
        metric = prometheus_client.Histogram(name, documentation, labelnames, buckets=buckets,
                                             registry=self.collector_registry)
        self._metrics[name] = histogram = Histogram(metric, name, labelnames)
        return histogram

    def register_collector(self, collector: Collector) -> None:
        """Serve what `collector.collect()` yields at every scrape (figures kept elsewhere)."""
        self.collector_registry.register(collector)

    def unregister_collector(self, collector: Collector) -> None:
        self.collector_registry.unregister(collector)

    def render(self) -> str:
        """The text exposition of every metric and collector of this registry."""
        return generate_latest(self.collector_registry).decode()
