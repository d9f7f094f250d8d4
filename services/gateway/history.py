"""The dashboard's recent history: per model, one point every few seconds over the last minutes.

Each point holds, for one model:

* ``rps``: requests its replicas finished per second (any outcome), from the workers' stats;
* ``tps``: tokens its replicas generated per second, likewise;
* ``ttft_s``: mean time to first token of the streams and requests *this gateway* served in
  the interval (None when it served none); measured where the client's wait starts;
* ``queue``: requests waiting: in the model's queue in ``SHOAL_REQUESTS`` plus those its
  replicas took and hold waiting for room in a batch.

Rates come from the workers' totals: each replica's increase since the previous point
(a replica seen for the first time adds nothing; a total that went down, a restarted
worker, counts from zero). Pure: no NATS, no asyncio; times are given by the caller.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from shoal.shared.messages import WorkerStats

WINDOW_S = 600.0
"""How far back the history goes."""


class ModelPoint(msgspec.Struct, array_like=True):
    """One model's figures at one point (array-like on the wire: hundreds go to each page)."""

    rps: float
    tps: float
    ttft_s: float | None
    queue: int


class HistoryPoint(msgspec.Struct):
    at: float
    models: dict[str, ModelPoint]


@dataclass
class TtftWindow:
    """Time-to-first-token observations since the last point, per model."""

    _sums: dict[str, tuple[float, int]] = field(default_factory=dict)

    def observe(self, model: str, seconds: float) -> None:
        total, count = self._sums.get(model, (0.0, 0))
        self._sums[model] = (total + seconds, count + 1)

    def take_means(self) -> dict[str, float]:
        """Mean per model since the previous call, and start over."""
        means = {model: total / count for model, (total, count) in self._sums.items() if count}
        self._sums.clear()
        return means


@dataclass
class _Totals:
    num_requests: int
    num_tokens: int


@dataclass
class RateTracker:
    """Per model requests/s and tokens/s from the replicas' totals."""

    _last: dict[str, _Totals] = field(default_factory=dict)
    _last_at: float | None = None

    def take_rates(self, at: float, stats: Iterable[WorkerStats]) -> dict[str, tuple[float, float]]:
        """Model -> (requests/s, tokens/s) since the previous call (zero the first time)."""
        elapsed = at - self._last_at if self._last_at is not None else 0.0
        rates: dict[str, tuple[float, float]] = {}
        current: dict[str, _Totals] = {}
        for replica in stats:
            totals = _Totals(sum(replica.num_requests_by_outcome.values()), replica.num_generated_tokens)
            current[replica.replica_id] = totals
            previous = self._last.get(replica.replica_id)
            num_requests = num_tokens = 0
            if previous is not None:
                # A total that went down belongs to a restarted worker: it counted from zero.
                num_requests = totals.num_requests - (previous.num_requests
                                                      if totals.num_requests >= previous.num_requests else 0)
                num_tokens = totals.num_tokens - (previous.num_tokens
                                                  if totals.num_tokens >= previous.num_tokens else 0)
            rps, tps = rates.get(replica.model, (0.0, 0.0))
            if elapsed > 0:
                rps, tps = rps + num_requests / elapsed, tps + num_tokens / elapsed
            rates[replica.model] = (rps, tps)
        self._last = current
        self._last_at = at
        return rates


class History:
    """The last `window_s` of points."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._points: deque[HistoryPoint] = deque()

    def add(self, point: HistoryPoint) -> None:
        self._points.append(point)
        while self._points and self._points[0].at < point.at - self.window_s:
            self._points.popleft()

    def get_since(self, since: float | None) -> list[HistoryPoint]:
        """Points after `since` (None: all)."""
        if since is None:
            return list(self._points)
        return [p for p in self._points if p.at > since]

    @property
    def latest(self) -> HistoryPoint | None:
        return self._points[-1] if self._points else None


IDLE = ModelPoint(0.0, 0.0, None, 0)
"""What a model missing from a point did: nothing (points leave idle models out: most of a
large cluster's models are idle at any moment, and pages fetch hundreds of points)."""


def make_point(at: float, models: Iterable[str], rates: dict[str, tuple[float, float]],
               ttft_means: dict[str, float], queues: dict[str, int]) -> HistoryPoint:
    """One point for the models in `models` (registered now) that did something in the interval."""
    point = HistoryPoint(at, {})
    for model in models:
        figures = ModelPoint(*rates.get(model, (0.0, 0.0)), ttft_means.get(model), queues.get(model, 0))
        if figures != IDLE:
            point.models[model] = figures
    return point
