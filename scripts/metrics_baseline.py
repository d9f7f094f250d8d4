"""The hand-written Prometheus registry Shoal used before `prometheus_client` (shared/metrics.py
until the library replaced it), kept here only as the baseline of scripts/bench_gateway.py's
metrics comparison. Not used by Shoal.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

PREFIX = "shoal_"
DEFAULT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

LabelValues = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        assert name.startswith(PREFIX), f"metric {name!r} must use the {PREFIX!r} prefix"
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> LabelValues:
        assert set(labels) == set(self.labelnames), (
            f"{self.name}: labels {sorted(labels)} != declared {sorted(self.labelnames)}"
        )
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.documentation}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> Iterable[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self._values: dict[LabelValues, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        assert amount >= 0, f"{self.name}: counters only go up"
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def samples(self) -> Iterable[str]:
        with self._lock:
            items = list(self._values.items())
        for key, value in items:
            yield f"{self.name}{_format_labels(self.labelnames, key)} {_format_value(value)}"


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self._values: dict[LabelValues, float] = {}

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = value

    def get(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def samples(self) -> Iterable[str]:
        with self._lock:
            items = list(self._values.items())
        for key, value in items:
            yield f"{self.name}{_format_labels(self.labelnames, key)} {_format_value(value)}"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS_S,
    ) -> None:
        super().__init__(name, documentation, labelnames)
        self.buckets = (*sorted(buckets), math.inf)
        self._counts: dict[LabelValues, list[int]] = {}
        self._sums: dict[LabelValues, float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            counts = self._counts.setdefault(key, [0] * len(self.buckets))
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    counts[i] += 1
                    break
            self._sums[key] = self._sums.get(key, 0.0) + value

    def samples(self) -> Iterable[str]:
        with self._lock:
            items = [(k, list(c), self._sums[k]) for k, c in self._counts.items()]
        for key, counts, total in items:
            cumulative = 0
            for bound, count in zip(self.buckets, counts, strict=True):
                cumulative += count
                le = f'le="{_format_value(bound)}"'
                yield f"{self.name}_bucket{_format_labels(self.labelnames, key, le)} {cumulative}"
            yield f"{self.name}_sum{_format_labels(self.labelnames, key)} {_format_value(total)}"
            yield f"{self.name}_count{_format_labels(self.labelnames, key)} {cumulative}"


class Registry:
    """Holds a process's metrics; each service registers its own at start."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _register(self, metric: _Metric) -> _Metric:
        existing = self._metrics.get(metric.name)
        if existing is not None:
            assert type(existing) is type(metric), f"metric {metric.name} registered twice with different types"
            return existing
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._register(Counter(name, documentation, labelnames))  # type: ignore[return-value]

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._register(Gauge(name, documentation, labelnames))  # type: ignore[return-value]

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS_S,
    ) -> Histogram:
        return self._register(Histogram(name, documentation, labelnames, buckets))  # type: ignore[return-value]

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines += metric.header()
            lines += metric.samples()
        return "\n".join(lines) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
