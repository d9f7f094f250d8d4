"""Ollama's model listing: ``/api/tags`` (the served models), ``/api/ps`` (those with a replica
on a GPU now), ``/api/show`` (one model's details), ``/api/version`` (the Ollama API version
matched, and Shoal's); and ``GET /``, which Ollama's clients probe to see a server is up.

Models are registered by the operator (shoal.toml, ``POST /admin/models``), not pulled:
``/api/pull`` of a registered model succeeds at once (a script that pulls before it chats goes
on), of any other model is a 404 saying so; ``/api/push``, ``/api/create``, ``/api/copy`` and
``/api/delete`` answer 501. Sizes are the checkpoint's bytes (``/api/tags``) and the GPU bytes the replicas
hold (``/api/ps``); a model's ``expires_at`` is when it would sleep if no request came
(its last request plus ``sleep.idle_timeout_s``), far away for one that never sleeps.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from msgspec import Struct

from shoal.services.gateway.errors import BadRequest, NotFound, NotImplementedHere
from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.ndjson import NdjsonStream
from shoal.services.gateway.openai_api import decode_body
from shoal.services.gateway.routes_ollama import served_model
from shoal.services.gateway.state import GATEWAY
from shoal.shared.messages import ModelSpec, ReplicaRecord
from shoal.shared.version import SHOAL_VERSION

routes = web.RouteTableDef()
NEVER = datetime(9999, 12, 31, tzinfo=UTC).timestamp()
"""A model that never sleeps by itself expires at the end of time (Ollama's ``keep_alive: -1``)."""


class Details(Struct):
    parent_model: str
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class ListedModel(Struct, kw_only=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: Details


class TagsReply(Struct):
    models: list[ListedModel]


class RunningModel(Struct, kw_only=True):
    name: str
    model: str
    size: int
    digest: str
    details: Details
    expires_at: str
    size_vram: int
    context_length: int | None


class PsReply(Struct):
    models: list[RunningModel]


class ShowRequest(Struct, kw_only=True):
    model: str | None = None
    name: str | None = None
    """Older clients' name for `model`."""
    verbose: bool | None = None


class ShowReply(Struct, kw_only=True):
    modelfile: str
    parameters: str
    template: str
    details: Details
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


def _rfc3339(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).isoformat().replace("+00:00", "Z")


def _digest(spec: ModelSpec) -> str:
    """Stable while the registration is: the model's name, files and registration time."""
    return hashlib.sha256(f"{spec.key}\0{spec.path}\0{spec.dtype}\0{spec.registered_at}".encode()).hexdigest()


def _parameter_size(num_parameters: int | None) -> str:
    """Ollama's form: ``"7.6B"``, ``"135.0M"``."""
    if not num_parameters:
        return ""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if num_parameters >= scale:
            return f"{num_parameters / scale:.1f}{suffix}"
    return str(num_parameters)


def _family(architecture: str) -> str:
    """``LlamaForCausalLM`` -> ``llama`` (Ollama's families are lower-case model types)."""
    for ending in ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel", "Model"):
        if architecture.endswith(ending) and architecture != ending:
            return architecture.removesuffix(ending).lower()
    return architecture.lower()


def _details(spec: ModelSpec) -> Details:
    family = _family(spec.architecture)
    return Details(parent_model="", format="safetensors", family=family, families=[family] if family else None,
                   parameter_size=_parameter_size(spec.num_parameters),
                   quantization_level="" if spec.dtype == "auto" else spec.dtype.upper())


def _capabilities(spec: ModelSpec) -> list[str]:
    """What Ollama's clients look for: chat, tools (every chat template may be given tools) and,
    for reasoning models, thinking."""
    return ["completion", "tools"] + (["thinking"] if spec.reasoning_parser is not None else [])


@routes.get("/api/tags")
async def tags(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    models = [ListedModel(name=spec.key, model=spec.key, modified_at=_rfc3339(spec.registered_at),
                          size=spec.weight_bytes or 0, digest=_digest(spec), details=_details(spec))
              for spec in sorted(state.cluster.models.values(), key=lambda s: s.key)]
    return json_response(TagsReply(models))


def _on_gpu(record: ReplicaRecord) -> bool:
    return record.level == "HOT" and record.state in ("ready", "draining")


@routes.get("/api/ps")
async def ps(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    by_model: dict[str, list[ReplicaRecord]] = {}
    for record in state.cluster.replicas.values():
        if _on_gpu(record):
            by_model.setdefault(record.model, []).append(record)
    running = []
    for key in sorted(by_model):
        spec = state.cluster.get_model(key)
        if spec is None:
            continue
        records = by_model[key]
        gpu_bytes = sum(sum(record.gpu_bytes.values()) for record in records)
        idle_s = spec.sleep.idle_timeout_s
        last_request_at = max(record.last_request_at or record.ready_at or 0.0 for record in records)
        running.append(RunningModel(
            name=key, model=key, size=gpu_bytes, digest=_digest(spec), details=_details(spec),
            expires_at=_rfc3339(last_request_at + idle_s if idle_s else NEVER), size_vram=gpu_bytes,
            context_length=spec.max_model_len))
    return json_response(PsReply(running))


@routes.post("/api/show")
async def show(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    body = decode_body(await request.read(), ShowRequest)
    if not (body.model or body.name):
        raise BadRequest("model is required", param="model")
    spec = served_model(state, body.model or body.name or "")
    info: dict[str, Any] = {"general.architecture": _family(spec.architecture),
                            "general.parameter_count": spec.num_parameters}
    if spec.max_model_len is not None:
        info[f"{_family(spec.architecture)}.context_length"] = spec.max_model_len
    return json_response(ShowReply(modelfile="", parameters="", template="", details=_details(spec),
                                   model_info=info, capabilities=_capabilities(spec),
                                   modified_at=_rfc3339(spec.registered_at)))


OLLAMA_API_VERSION = "0.13.0"
"""The Ollama release whose API this one matches: clients check it (VS Code's and Raycast's
refuse servers older than 0.6.4), so it is Ollama's numbering, not Shoal's."""


@routes.get("/api/version")
async def version(request: web.Request) -> web.Response:
    return json_response({"version": OLLAMA_API_VERSION, "shoal_version": SHOAL_VERSION})


@routes.get("/")
async def root(request: web.Request) -> web.Response:
    """What Ollama's clients probe (``ollama serve`` answers "Ollama is running")."""
    return web.Response(text="Shoal is running (OpenAI API at /v1, Ollama's at /api, dashboard at /ui)")


class PullRequest(Struct, kw_only=True):
    model: str | None = None
    name: str | None = None
    """Older clients' name for `model`."""
    insecure: bool | None = None
    stream: bool = True


class PullProgress(Struct):
    status: str


@routes.post("/api/pull")
async def pull(request: web.Request) -> web.StreamResponse:
    """A registered model is there already: Ollama's "success" (after its first progress line
    when streamed), as ``ollama pull`` answers for a model it holds."""
    body = decode_body(await request.read(), PullRequest)
    name = body.model or body.name
    if not name:
        raise BadRequest("model is required", param="model")
    try:
        served_model(request.app[GATEWAY], name)
    except NotFound:
        raise NotFound(f"model '{name}' is not registered: Shoal does not download models; its operator registers "
                       f"them (shoal.toml [[models]], or POST /admin/models)", code="model_not_found",
                       param="model") from None
    if not body.stream:
        return json_response(PullProgress("success"))
    lines = NdjsonStream(request)
    for status in ("pulling manifest", "success"):
        await lines.send(PullProgress(status))
    await lines.close()
    return lines.response


async def _not_here(request: web.Request) -> web.Response:
    raise NotImplementedHere(f"{request.path} is not served: Shoal serves the models its operator registers "
                             f"(shoal.toml [[models]], or POST /admin/models), it does not pull or create them")


for _path in ("/api/push", "/api/create", "/api/copy"):
    routes.post(_path)(_not_here)
routes.delete("/api/delete")(_not_here)
routes.post("/api/blobs/{digest}")(_not_here)
routes.head("/api/blobs/{digest}")(_not_here)
