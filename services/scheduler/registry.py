"""The model registry in ``shoal_models``: models from the config file and the admin API.

What a registration stores is pure (`merge_registration`,
`with_facts`); `ModelRegistry` carries out the scheduler's register / remove commands
and asks node agents about a model's files.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
import nats.js.errors
import structlog

from shoal.services.scheduler.background import BackgroundTasks
from shoal.services.scheduler.events import publish_model_event
from shoal.services.scheduler.executor import STOP_TIMEOUT_S, send_node_command
from shoal.shared import subjects
from shoal.shared.bus import Bus, ensure_model_consumer
from shoal.shared.messages import (
    InspectModel,
    ModelFacts,
    ModelSpec,
    ReplicaRecord,
    SchedulerReply,
    StopReplica,
    model_facts_decoder,
)
from shoal.shared.micro import RequestError, ServiceCallError, ServiceError, request_json

if TYPE_CHECKING:
    from shoal.services.scheduler.passes import PlacementPasses
    from shoal.services.scheduler.store import ClusterStore

log = structlog.get_logger(__name__)

INSPECT_TIMEOUT_S = 30.0
"""A node agent reads a model's config and weight sizes (no weights loaded)."""


def not_registered(model: str) -> RequestError:
    """The 404 of a command on a model that is not (or no longer) registered."""
    return RequestError(404, f"model {model!r} is not registered")


def registered_in(specs: dict[str, ModelSpec], model: str) -> ModelSpec:
    """`model`'s spec in a placement pass's snapshot; 404 when another scheduler removed it
    after the command first looked it up."""
    if model not in specs:
        raise not_registered(model)
    return specs[model]


def merge_registration(current: ModelSpec | None, incoming: ModelSpec) -> ModelSpec | None:
    """The spec to store when `incoming` is (re-)registered over `current`.

    What the operator configures comes from `incoming`; what the cluster learned
    (measured memory, inspected sizes) and the desired replica count survive,
    the count raised to at least the configured minimum. None: nothing changes.
    """
    if current is None:
        return incoming
    learned = {
        "registered_at": current.registered_at,
        "lease_owner": current.lease_owner,
        "lease_until": current.lease_until,
        "desired_replicas": max(current.desired_replicas, incoming.desired_replicas),
    }
    same_footprint = (incoming.path, incoming.dtype, incoming.kv_cache_tokens) == (
        current.path,
        current.dtype,
        current.kv_cache_tokens,
    )
    if same_footprint:
        learned |= {
            "measured_serving_bytes": current.measured_serving_bytes,
            "measured_at": current.measured_at,
            "weight_bytes": current.weight_bytes,
            "num_parameters": current.num_parameters,
            "architecture": current.architecture,
            "estimated_bytes": current.estimated_bytes,
        }
    merged = msgspec.structs.replace(incoming, **learned)
    return None if merged == current else merged


def with_facts(spec: ModelSpec, facts: ModelFacts) -> ModelSpec:
    """`spec` with what a node agent learned from the model's files (a configured
    ``max_model_len`` wins over the model's own)."""
    return msgspec.structs.replace(spec, weight_bytes=facts.weight_bytes, num_parameters=facts.num_parameters,
                                   estimated_bytes=facts.estimated_bytes, architecture=facts.architecture,
                                   max_model_len=spec.max_model_len or facts.max_model_len)


class ModelRegistry:
    """Registers, inspects and removes models in ``shoal_models`` for one scheduler."""

    def __init__(
        self,
        bus: Bus,
        store: ClusterStore,
        passes: PlacementPasses,
        *,
        place: Callable[[str, int], Awaitable[object]],
        background: BackgroundTasks,
        clock: Callable[[], float],
    ) -> None:
        """Args:
        place: places a model's desired replicas (`commands.PlacementCommands.ensure`).
        background: runs an inspection the registering caller need not wait for.
        """
        self._bus = bus
        self._store = store
        self._passes = passes
        self._place = place
        self._background = background
        self._clock = clock

    async def register(self, spec: ModelSpec) -> ModelSpec:
        """Store `spec` (merged over a registration already there, `merge_registration`),
        create its model's request consumer and place its desired replicas. A model with
        no desired replicas is inspected in the background, sized ahead of its first request.

        Raises:
            RequestError: 400 for a model key that cannot be one.
        """
        try:
            subjects.validate_model_key(spec.key)
        except subjects.InvalidModelKey as exc:
            raise RequestError(400, str(exc)) from exc
        stored = await self._store.update_model(spec.key, lambda current: merge_registration(current, spec))
        assert stored is not None, "registering a model must leave a spec behind"
        await ensure_model_consumer(self._bus.js, spec.key)
        await publish_model_event(self._bus.js, "model_registered", spec.key, self._clock())
        if stored.desired_replicas:
            await self._place(spec.key, stored.desired_replicas)
        elif stored.weight_bytes is None:
            self._background.spawn(self.inspect(stored))
        return stored

    async def remove(self, model: str) -> SchedulerReply:
        """Stop every replica of `model`, then delete its request consumer, its queued
        requests and its spec. 404 when unknown.

        One pass removes its HOT and WARM replicas (desired count 0, waiting for their node
        steps); replicas that pass could not stop (failed, held, lost, a stop that failed) are
        stopped on their node and freed here. While any is left (its node does not answer),
        the spec stays — so the model can still be evicted or removed again — and the reply
        says which replicas are left (409)."""
        await self.require(model)
        await self._passes.run(lambda planner, _: planner.scale_down(model, 0))
        token = subjects.model_token(model)
        for entry in (await self._bus.replicas.get_all(token + ".*")).values():
            await self._stop_and_free(entry.value)
        left = sorted(e.value.replica_id for e in (await self._bus.replicas.get_all(token + ".*")).values())
        if left:
            raise RequestError(409, f"model {model!r}: replicas {', '.join(left)} could not be stopped yet (their "
                                    "node does not answer); its spec is kept: remove it again later")
        await self._delete_queue(model)
        await self._bus.models.delete(token)
        await publish_model_event(self._bus.js, "model_removed", model, self._clock())
        return SchedulerReply(ok=True, status="ok", message=f"model {model} removed")

    async def _stop_and_free(self, record: ReplicaRecord) -> None:
        """Stop a replica of a model being removed on its node, then free it (memory first)."""
        try:
            await send_node_command(self._bus, record.node_id, "stop", StopReplica(record.replica_id, "model removed"),
                                    STOP_TIMEOUT_S)
        except ServiceCallError as exc:
            log.warning("removed_model_replica_not_stopped", model=record.model, replica=record.replica_id,
                        error=str(exc))
            return
        await self._store.free_replica(record.model, record.replica_id, error="model removed")

    async def _delete_queue(self, model: str) -> None:
        """Delete the model's durable consumer and the requests still queued for it."""
        try:
            await self._bus.js.delete_consumer(subjects.REQUESTS_STREAM, subjects.consumer_name(model))
        except nats.js.errors.NotFoundError:
            pass
        try:
            await self._bus.js.purge_stream(subjects.REQUESTS_STREAM, subject=subjects.infer_subject(model))
        except nats.js.errors.NotFoundError:
            pass

    async def require(self, model: str) -> ModelSpec:
        """The spec of `model`; RequestError 404 when it is not registered."""
        spec = await self._store.get_model(model)
        if spec is None:
            raise not_registered(model)
        return spec

    async def inspect(self, spec: ModelSpec) -> ModelSpec:
        """`spec` with its weight size and config estimate, asked of a node agent (they see
        the models root) and stored, when it has none yet; as it is when no agent answers."""
        if spec.weight_bytes is not None:
            return spec
        try:
            facts = await self._ask_node_agent(spec)
        except ServiceCallError as exc:
            log.warning("model_inspection_failed", model=spec.key, error=str(exc))
            return spec

        def mutate(current: ModelSpec | None) -> ModelSpec | None:
            return None if current is None else with_facts(current, facts)

        return await self._store.update_model(spec.key, mutate) or spec

    async def check_files(self, spec: ModelSpec) -> ModelSpec:
        """A run-time registration: a node agent must be able to read the checkpoint (400 if
        it cannot); its facts come along. With no node agent answering, it is registered unchecked."""
        try:
            facts = await self._ask_node_agent(spec)
        except ServiceError as exc:
            if 400 <= exc.code < 500:
                raise RequestError(400, f"model {spec.key!r}: {exc.description}") from exc
            log.warning("model_inspection_failed", model=spec.key, error=str(exc))
            return spec
        except ServiceCallError as exc:
            log.warning("model_inspection_failed", model=spec.key, error=str(exc))
            return spec
        return with_facts(spec, facts)

    async def _ask_node_agent(self, spec: ModelSpec) -> ModelFacts:
        return await request_json(self._bus.nc, subjects.NODE_INSPECT,
                                  InspectModel(spec.path, spec.dtype, spec.kv_cache_tokens),
                                  model_facts_decoder, timeout_s=INSPECT_TIMEOUT_S)
