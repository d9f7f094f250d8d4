"""An index of sessions by the retention value of their next victim chunk.

Retention value (Pensieve's): what losing the chunk costs, divided by how long its session has
been idle::

    value(now) = cost / (now - last_active + min_idle_s)

`min_idle_s` (> 0) defines the value of a session active right now (no division by zero) and
smooths the ranking of sessions that were active within about that long. The lowest value is
evicted first; equal values are broken by the older `last_active`, then by the lower `order`
(the order sessions were stored in).

Each session enters with ONE entry: the cost of its next victim chunk. Its chunks leave in a
fixed order (see `session_cache`), so a session is re-entered only when its victim changes;
no chunk is ever rescored.

The ranking of two sessions changes with time (`c1 / (now - t1)` against `c2 / (now - t2)`),
so no static key orders them. Entries are grouped by cost into geometric buckets (bucket `b`
holds costs in ``[r**b, r**(b+1))``, `r` = `bucket_ratio`); inside a bucket they are kept in
a heap by `last_active`. `get_min` compares the head (the longest idle entry) of each bucket:
O(buckets) per call, however many sessions. Within one bucket the head may not be the exact
minimum (a more recent entry with a lower cost), but its value is at most `bucket_ratio`
times the minimum: for any other entry ``c' >= c / r`` and ``idle' <= idle``. With the default
ratio, 2**(1/16), that is within 4.4%; entries in different buckets, and entries of equal
cost, are ordered exactly.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

_ZERO_BUCKET = -(1 << 30)
"""The bucket of entries whose cost is zero (or less): their value is 0 whatever the time."""


@dataclass(slots=True)
class _Entry:
    cost: float
    last_active: float
    order: int
    bucket: int
    version: int


class RetentionIndex:
    """Keys (session ids) ordered by retention value at query time (see module doc).

    Args:
        min_idle_s: added to every idle time; the value of a session active now is
            ``cost / min_idle_s``. Must be positive.
        bucket_ratio: width of a cost bucket (> 1): the bound on how far from the exact
            minimum `get_min` may choose.
    """

    __slots__ = ("_buckets", "_entries", "_log_ratio", "_num_stale", "_version", "bucket_ratio", "min_idle_s")

    def __init__(self, min_idle_s: float, bucket_ratio: float = 2 ** (1 / 16)) -> None:
        assert min_idle_s > 0, f"min_idle_s must be positive, got {min_idle_s}"
        assert bucket_ratio > 1, f"bucket_ratio must exceed 1, got {bucket_ratio}"
        self.min_idle_s = min_idle_s
        self.bucket_ratio = bucket_ratio
        self._log_ratio = math.log(bucket_ratio)
        self._entries: dict[str, _Entry] = {}
        # bucket -> heap of (last_active, order, version, key); entries of an older version
        # of the key (or of a removed key) are stale and skipped when they surface.
        self._buckets: dict[int, list[tuple[float, int, int, str]]] = {}
        self._num_stale = 0
        self._version = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def set(self, key: str, cost: float, last_active: float, order: int) -> None:
        """Add `key`, or move it to a new cost or activity time. O(log n)."""
        entry = self._entries.get(key)
        if entry is not None:
            if entry.cost == cost and entry.last_active == last_active and entry.order == order:
                return
            self._num_stale += 1
        bucket = self._get_bucket(cost)
        self._version += 1
        self._entries[key] = _Entry(cost, last_active, order, bucket, self._version)
        heapq.heappush(self._buckets.setdefault(bucket, []), (last_active, order, self._version, key))
        if self._num_stale > 2 * len(self._entries) + 64:
            self._compact()

    def discard(self, key: str) -> None:
        """Remove `key` if present. O(1) (its heap item is dropped lazily)."""
        if self._entries.pop(key, None) is not None:
            self._num_stale += 1

    def get_value(self, key: str, now: float) -> float:
        """The retention value of `key`'s entry at time `now`."""
        entry = self._entries[key]
        return self._value(entry.cost, entry.last_active, now)

    def get_min(self, now: float) -> str | None:
        """The key with the lowest retention value at `now` (within `bucket_ratio`), or None."""
        best: tuple[float, float, int] | None = None
        best_key: str | None = None
        empty: list[int] = []
        entries = self._entries
        for bucket, heap in self._buckets.items():
            while heap:
                last_active, order, version, key = heap[0]
                entry = entries.get(key)
                if entry is not None and entry.version == version:
                    break
                heapq.heappop(heap)
                self._num_stale -= 1
            if not heap:
                empty.append(bucket)
                continue
            last_active, order, _, key = heap[0]
            rank = (self._value(entries[key].cost, last_active, now), last_active, order)
            if best is None or rank < best:
                best, best_key = rank, key
        for bucket in empty:
            del self._buckets[bucket]
        return best_key

    def _value(self, cost: float, last_active: float, now: float) -> float:
        if cost <= 0.0:
            return 0.0
        return cost / (max(0.0, now - last_active) + self.min_idle_s)

    def _get_bucket(self, cost: float) -> int:
        if cost <= 0.0:
            return _ZERO_BUCKET
        return math.floor(math.log(cost) / self._log_ratio)

    def _compact(self) -> None:
        """Rebuild the heaps from the live entries (bounds the memory of stale items)."""
        buckets: dict[int, list[tuple[float, int, int, str]]] = {}
        for key, entry in self._entries.items():
            buckets.setdefault(entry.bucket, []).append((entry.last_active, entry.order, entry.version, key))
        for heap in buckets.values():
            heapq.heapify(heap)
        self._buckets = buckets
        self._num_stale = 0
