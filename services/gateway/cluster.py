"""The gateway's live view of the cluster, kept by KV watchers.

Answers without a NATS round trip: is this model registered, has it any replica
serving or on its way (so the scheduler need not be asked again), is its placement
backing off after failures, how far its loading replicas are. The dashboard reads
the whole view (models, replicas, GPUs, nodes) from here too, so any number of
open dashboards cost NATS nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import nats.errors
import structlog
from nats.js.kv import KV_DEL, KV_PURGE

from shoal.services.gateway.errors import NotFound
from shoal.shared.bus import Bus, TypedBucket
from shoal.shared.messages import GpuRecord, ModelSpec, NodeRecord, ReplicaRecord
from shoal.shared.periodic import sleep_or_stop, stop_if_cancelled

log = structlog.get_logger(__name__)

ReplicaListener = Callable[[ReplicaRecord | None, ReplicaRecord | None], None]
"""Told (previous, current) of every replica record change; None: absent (new, or deleted)."""

_DELETES = (KV_DEL, KV_PURGE)


class ClusterView:
    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self.models: dict[str, ModelSpec] = {}
        """By model key."""
        self.replicas: dict[str, ReplicaRecord] = {}
        """By KV key (``<model token>.<replica id>``)."""
        self.gpus: dict[str, GpuRecord] = {}
        """By KV key (``<node>.<index>``)."""
        self.nodes: dict[str, NodeRecord] = {}
        """By node id. A node whose agent stopped stays until its key expires from the
        bucket, which a watcher is not told of: readers check `heartbeat_at`."""
        self._tasks: list[asyncio.Task[None]] = []
        self._models_by_token: dict[str, str] = {}
        self._active: dict[str, set[str]] = {}
        """Model -> KV keys of its replicas that are active, `ReplicaRecord.is_active` (asked on every request)."""
        self._replica_keys_by_id: dict[str, str] = {}
        self._replica_listeners: list[ReplicaListener] = []

    def add_replica_listener(self, listener: ReplicaListener) -> None:
        """Call `listener` on every change of a replica record from now on (in the watcher's
        task: it must not block)."""
        self._replica_listeners.append(listener)

    async def start(self) -> None:
        watches: list[tuple[TypedBucket, Callable[[str, object | None], None]]] = [
            (self._bus.models, self._on_model),  # type: ignore[list-item]
            (self._bus.replicas, self._on_replica),  # type: ignore[list-item]
            (self._bus.gpus, self._on_gpu),  # type: ignore[list-item]
            (self._bus.nodes, self._on_node),  # type: ignore[list-item]
        ]
        ready = [asyncio.Event() for _ in watches]
        self._tasks = [asyncio.create_task(self._watch(bucket, apply, event))
                       for (bucket, apply), event in zip(watches, ready, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ready)), timeout=15.0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def get_model(self, model: str) -> ModelSpec | None:
        return self.models.get(model)

    async def wait_for_model(self, model: str, timeout_s: float) -> bool:
        """Whether `model` is in this view, waiting up to `timeout_s` for the ``shoal_models``
        watch to bring it (a registration's write reaches the watch a moment later)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while model not in self.models:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def require_model(self, model: str) -> ModelSpec:
        """The registered model, or a 404 naming ``model``."""
        spec = self.models.get(model)
        if spec is None:
            raise NotFound(f"model {model[:256]!r} does not exist", code="model_not_found", param="model")
        return spec

    def has_active_replica(self, model: str) -> bool:
        return bool(self._active.get(model))

    def get_replica(self, replica_id: str) -> ReplicaRecord | None:
        key = self._replica_keys_by_id.get(replica_id)
        return self.replicas.get(key) if key is not None else None

    def get_active_replicas(self, model: str) -> list[ReplicaRecord]:
        """The model's replicas that serve or are on their way, oldest first."""
        found = [self.replicas[key] for key in self._active.get(model, ()) if key in self.replicas]
        return sorted(found, key=lambda r: r.created_at)

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
        previous = self.replicas.pop(key, None)
        if previous is not None:
            self._replica_keys_by_id.pop(previous.replica_id, None)
            if previous.model in self._active:
                self._active[previous.model].discard(key)
        if value is not None:
            self.replicas[key] = value
            self._replica_keys_by_id[value.replica_id] = key
            if value.is_active:
                self._active.setdefault(value.model, set()).add(key)
        for listener in self._replica_listeners:
            listener(previous, value)

    def _on_gpu(self, key: str, value: GpuRecord | None) -> None:
        if value is None:
            self.gpus.pop(key, None)
        else:
            self.gpus[key] = value

    def _on_node(self, key: str, value: NodeRecord | None) -> None:
        if value is None:
            self.nodes.pop(key, None)
        else:
            self.nodes[key] = value

    async def _watch(self, bucket: TypedBucket, apply, ready: asyncio.Event) -> None:  # type: ignore[no-untyped-def]
        while True:
            try:
                watcher = await bucket.kv.watchall()
            except nats.errors.Error as exc:
                log.warning("watch_failed", bucket=bucket.name, error=str(exc))
                await sleep_or_stop(1.0)
                continue
            try:
                stop_if_cancelled()  # the watch waits on a queue: it would not see a lost cancel
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
