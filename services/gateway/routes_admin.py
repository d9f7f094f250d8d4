"""Admin API: register/remove models at run time, scale, evict, and the cluster view.

    GET    /admin/cluster                      nodes, GPUs, replicas, models
    POST   /admin/models                       register (body: a [[models]] entry of shoal.toml, as JSON)
    DELETE /admin/models/{model}               remove (its replicas stop)
    POST   /admin/models/{model}/scale         {"replicas": N}
    POST   /admin/models/{model}/evict         {} for every replica, or {"replica_id": "..."}
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec
from aiohttp import web

from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.openai_api import decode_body, param_of
from shoal.services.gateway.service_calls import ask_scheduler
from shoal.services.gateway.state import GATEWAY
from shoal.shared.config import ConfigError, ModelConfig, parse_byte_sizes
from shoal.shared.messages import (
    EvictReplicas,
    ModelSpec,
    RegisterModel,
    RemoveModel,
    ReplicaId,
    ScaleModel,
    SchedulerCommand,
)
from shoal.shared.model_settings import MAX_REPLICAS

routes = web.RouteTableDef()
REGISTERED_VISIBLE_S = 5.0
"""How long a registration waits for this gateway's view of ``shoal_models`` to show it."""


class ScaleBody(msgspec.Struct, forbid_unknown_fields=True):
    replicas: Annotated[int, msgspec.Meta(ge=0, le=MAX_REPLICAS)]


class EvictBody(msgspec.Struct, forbid_unknown_fields=True):
    replica_id: ReplicaId | None = None


async def _command(request: web.Request, verb: str, command: SchedulerCommand) -> web.Response:
    reply = await ask_scheduler(request.app[GATEWAY].bus, verb, command, timeout_s=120.0)
    return json_response(reply, status=200 if reply.ok else 503)


@routes.post("/admin/models")
async def register_model(request: web.Request) -> web.Response:
    """Register a model. Its path must stay under the models root (checked here) and hold a
    checkpoint a node agent can read (checked by the scheduler, which asks one: 400 if not)."""
    model = decode_model_config(await request.read())  # min_replicas <= MAX_REPLICAS: ModelSettings
    spec = ModelSpec.from_settings(model, source="admin", registered_at=time.time())
    response = await _command(request, "register", RegisterModel(spec))
    if response.status == 200:  # this gateway serves it once answered: a request right after finds it
        await request.app[GATEWAY].cluster.wait_for_model(spec.key, timeout_s=REGISTERED_VISIBLE_S)
    return response


def decode_model_config(body: bytes) -> ModelConfig:
    """A ``[[models]]`` entry sent as JSON (sizes may be strings, as in shoal.toml); 400 naming
    the field at fault."""
    raw = decode_body(body, dict)
    try:
        return msgspec.convert(parse_byte_sizes(raw), ModelConfig)
    except (msgspec.ValidationError, ConfigError) as exc:
        raise BadRequest(f"invalid request: {exc}", param=param_of(str(exc))) from exc


@routes.delete("/admin/models/{model:.+}")
async def remove_model(request: web.Request) -> web.Response:
    return await _command(request, "remove", RemoveModel(request.match_info["model"]))


@routes.post("/admin/models/{model:.+}/scale")
async def scale_model(request: web.Request) -> web.Response:
    body = decode_body(await request.read(), ScaleBody)
    return await _command(request, "scale", ScaleModel(request.match_info["model"], num_replicas=body.replicas))


@routes.post("/admin/models/{model:.+}/evict")
async def evict_model(request: web.Request) -> web.Response:
    raw = await request.read()
    body = decode_body(raw, EvictBody) if raw.strip() else EvictBody()
    return await _command(request, "evict", EvictReplicas(request.match_info["model"], body.replica_id))


class ClusterReport(msgspec.Struct):
    nodes: list[object]
    gpus: list[object]
    replicas: list[object]
    models: list[object]


@routes.get("/admin/cluster")
async def cluster(request: web.Request) -> web.Response:
    bus = request.app[GATEWAY].bus
    report = ClusterReport(
        nodes=[v.value for v in (await bus.nodes.get_all()).values()],
        gpus=[v.value for v in (await bus.gpus.get_all()).values()],
        replicas=[v.value for v in (await bus.replicas.get_all()).values()],
        models=[v.value for v in (await bus.models.get_all()).values()],
    )
    return json_response(report)

