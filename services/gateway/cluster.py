"""The gateway's live view of models and replicas, kept by KV watchers.

Answers without a NATS round trip: is this model registered, has it any replica
serving or on its way (so the scheduler need not be asked again), is its placement
backing off after failures.
"""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
import structlog
from nats.js.kv import KV_DEL, KV_PURGE

from shoal.shared.bus import Bus, TypedBucket
from shoal.shared.messages import ModelSpec, ReplicaRecord

log = structlog.get_logger(__name__)

_DELETES = (KV_DEL, KV_PURGE)


class ClusterView:
    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self.models: dict[str, ModelSpec] = {}
        """By model key."""
        self._tasks: list[asyncio.Task[None]] = []
        self._models_by_token: dict[str, str] = {}
        self._model_by_replica_key: dict[str, str] = {}
        self._active: dict[str, set[str]] = {}
        """Model -> KV keys of its replicas that are active, `ReplicaRecord.is_active` (asked on every request)."""

    async def start(self) -> None:
        ready = [asyncio.Event(), asyncio.Event()]
        self._tasks = [
            asyncio.create_task(self._watch(self._bus.models, self._on_model, ready[0])),
            asyncio.create_task(self._watch(self._bus.replicas, self._on_replica, ready[1])),
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ready)), timeout=15.0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def get_model(self, model: str) -> ModelSpec | None:
        return self.models.get(model)

    def has_active_replica(self, model: str) -> bool:
        return bool(self._active.get(model))

    def failing_reason(self, model: str, at: float) -> str | None:
        """Why `model` cannot serve now: its replicas keep failing and placement is backing
        off, with none on its way. None while it may still come up."""
        spec = self.models.get(model)
        if spec is None or not spec.is_held(at) or self.has_active_replica(model):
            return None
        return spec.last_error or "its replicas keep failing"

    def _on_model(self, key: str, value: ModelSpec | None) -> None:
        if value is None:
            model = self._models_by_token.pop(key, None)
            if model is not None:
                self.models.pop(model, None)
        else:
            self._models_by_token[key] = value.key
            self.models[value.key] = value

    def _on_replica(self, key: str, value: ReplicaRecord | None) -> None:
        previous_model = self._model_by_replica_key.pop(key, None)
        if previous_model is not None and previous_model in self._active:
            self._active[previous_model].discard(key)
        if value is not None:
            self._model_by_replica_key[key] = value.model
            if value.is_active:
                self._active.setdefault(value.model, set()).add(key)

    async def _watch(self, bucket: TypedBucket, apply, ready: asyncio.Event) -> None:  # type: ignore[no-untyped-def]
        while True:
            try:
                watcher = await bucket.kv.watchall()
            except nats.errors.Error as exc:
                log.warning("watch_failed", bucket=bucket.name, error=str(exc))
                await asyncio.sleep(1.0)
                continue
            try:
                async for entry in watcher:
                    if entry is None:
                        ready.set()
                        continue
                    if entry.operation in _DELETES:
                        apply(entry.key, None)
                        continue
                    value = bucket.decode(entry.key, entry.value)
                    if value is not None:
                        apply(entry.key, value)
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()
