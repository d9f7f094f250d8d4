"""The worker's stats: what its replica is doing, published every few seconds.

Every `worker.stats_interval_s` the worker publishes one `WorkerStats` (JSON) on
``shoal.stats.<model token>.<replica id>``: requests running and waiting, finished
requests by outcome, prompt and generated tokens, its engine's KV pool and prefix
cache, its session cache, preemptions and steps. Gateways subscribe to ``shoal.stats.>`` and serve the
figures on ``/metrics`` (per model and replica) and on the dashboard. Core NATS, no
JetStream: a stats message nobody hears is simply superseded by the next one.

Counts are totals since the worker started. A park (to_cache) drops the engine and a
restore builds a new one whose own counts start at zero: `EngineTotals` carries the
old engine's last reading forward, so the totals never go down.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.errors
import structlog

from shoal.services.worker.engine.engine_config import EngineStats
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.generation import Engine
from shoal.services.worker.service import WorkerIdentity, WorkerService
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import SESSION_GAUGES, KvCacheStats, SessionStats, WorkerStats, encode_json, now
from shoal.shared.periodic import sleep_or_stop

log = structlog.get_logger(__name__)

SESSION_COUNTS = tuple(name for name in SessionStats.__struct_fields__ if name not in SESSION_GAUGES)
"""The session cache's counts (hits, tokens, swapped bytes...): totals like the engine's."""
ENGINE_COUNTS = ("num_preemptions", "num_steps", "num_step_seqs", "step_seconds", "num_cache_queries",
                 "num_cache_hits", *(f"sessions.{name}" for name in SESSION_COUNTS))


def _engine_counts(stats: EngineStats) -> dict[str, float]:
    pool = stats.pool
    sessions = stats.sessions or SessionStats()
    return {
        "num_preemptions": stats.num_preemptions,
        "num_steps": stats.num_steps,
        "num_step_seqs": stats.num_step_seqs,
        "step_seconds": stats.step_seconds,
        "num_cache_queries": pool.num_cache_hits + pool.num_cache_misses,
        "num_cache_hits": pool.num_cache_hits,
        **{f"sessions.{name}": getattr(sessions, name) for name in SESSION_COUNTS},
    }


def _session_stats(current: SessionStats, totals: dict[str, float]) -> SessionStats:
    """The engine's current session figures, with its counts replaced by the worker's totals."""
    fields = {name: getattr(current, name) for name in SESSION_GAUGES}
    for name in SESSION_COUNTS:
        total = totals[f"sessions.{name}"]
        fields[name] = total if isinstance(getattr(current, name), float) else int(total)
    return SessionStats(**fields)


@dataclass
class EngineTotals:
    """Engine counts since the worker started, across the engines a park and restore make."""

    _base: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ENGINE_COUNTS, 0.0))
    _last: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ENGINE_COUNTS, 0.0))
    _generation: int | None = None

    def update(self, generation: int | None, counts: dict[str, float] | None) -> dict[str, float]:
        """The totals after reading `counts` from the engine numbered `generation` (each new
        engine gets a new number; None: no engine now)."""
        if generation != self._generation:
            # A new engine (or none): what the old one counted stays in the totals.
            self._base = {k: self._base[k] + self._last[k] for k in ENGINE_COUNTS}
            self._last = dict.fromkeys(ENGINE_COUNTS, 0.0)
            self._generation = generation
        if counts is not None:
            self._last = {k: counts[k] for k in ENGINE_COUNTS}
        return {k: self._base[k] + self._last[k] for k in ENGINE_COUNTS}


class StatsPublisher:
    """Publishes `WorkerStats` for one replica every `interval_s` until cancelled."""

    def __init__(self, bus: Bus, identity: WorkerIdentity, service: WorkerService,
                 get_engine: Callable[[], Engine | None], *, engine_kind: str, interval_s: float) -> None:
        """Args:
        get_engine: the replica's engine now (None while parked WARM).
        """
        self._bus = bus
        self._identity = identity
        self._service = service
        self._get_engine = get_engine
        self._engine_kind = engine_kind
        self.interval_s = interval_s
        self._totals = EngineTotals()
        self._engine_ref: weakref.ref[Engine] | None = None
        self._generation = 0
        self._subject = subjects.stats_subject(identity.model, identity.replica_id)

    def get_stats(self) -> WorkerStats:
        """What the replica is doing now (reads the engine's counters under its lock)."""
        service = self._service
        engine = self._get_engine()
        engine_stats = engine.get_stats() if isinstance(engine, PagedEngine) else None
        totals = self._totals.update(self._get_generation(engine),
                                     _engine_counts(engine_stats) if engine_stats is not None else None)
        kv_cache = None
        sessions = None
        if engine_stats is not None:
            pool = engine_stats.pool
            kv_cache = KvCacheStats(num_blocks=pool.num_blocks, num_used_blocks=pool.num_used_blocks,
                                    num_free_blocks=pool.num_free_blocks, block_bytes=pool.block_bytes,
                                    num_cache_queries=int(totals["num_cache_queries"]),
                                    num_cache_hits=int(totals["num_cache_hits"]))
            num_running, num_waiting = engine_stats.num_running, engine_stats.num_waiting
            if engine_stats.sessions is not None:
                sessions = _session_stats(engine_stats.sessions, totals)
        else:
            num_running, num_waiting = service.num_in_flight, 0
        return WorkerStats(
            replica_id=self._identity.replica_id,
            model=self._identity.model,
            node_id=self._identity.node_id,
            at=now(),
            interval_s=self.interval_s,
            engine=self._engine_kind,
            serving=engine is not None and service.is_serving,
            num_requests_running=num_running,
            num_requests_waiting=num_waiting,
            num_requests_by_outcome=dict(service.num_requests_by_outcome),
            num_prompt_tokens=service.num_prompt_tokens,
            num_generated_tokens=service.num_generated_tokens,
            last_request_at=service.last_request_at or None,
            kv_cache=kv_cache,
            num_preemptions=int(totals["num_preemptions"]),
            num_steps=int(totals["num_steps"]),
            num_step_seqs=int(totals["num_step_seqs"]),
            step_seconds=totals["step_seconds"],
            sessions=sessions,
        )

    def _get_generation(self, engine: Engine | None) -> int | None:
        """A number that changes whenever the engine is replaced (a weak reference: a parked
        engine's KV pool must not be kept alive by its stats)."""
        if engine is None:
            return None
        if self._engine_ref is None or self._engine_ref() is not engine:
            self._engine_ref = weakref.ref(engine)
            self._generation += 1
        return self._generation

    async def publish(self) -> None:
        try:
            await self._bus.nc.publish(self._subject, encode_json(self.get_stats()))
        except nats.errors.Error as exc:  # reconnecting: the next interval tries again
            log.debug("stats_publish_failed", error=str(exc))

    async def run(self) -> None:
        """Publish now, then every `interval_s`."""
        while True:
            await self.publish()
            await sleep_or_stop(self.interval_s)
