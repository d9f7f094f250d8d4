"""Stored Responses API answers over HTTP: ``GET`` and ``DELETE /v1/responses/{id}``, and ``GET
/v1/responses/{id}/input_items`` (response_store.py keeps them; routes_openai.py makes them)."""

from __future__ import annotations

from typing import Annotated, Literal

from aiohttp import web
from msgspec import Meta, Struct

from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.openai_api import decode_query
from shoal.services.gateway.responses_api import DeletedResponse
from shoal.services.gateway.responses_items import page
from shoal.services.gateway.state import GATEWAY

routes = web.RouteTableDef()


@routes.get("/v1/responses/{response_id}")
async def get_response(request: web.Request) -> web.Response:
    stored = await request.app[GATEWAY].responses.get(request.match_info["response_id"])
    return json_response(stored.response)


class InputItemsQuery(Struct, kw_only=True):
    """``GET /v1/responses/{id}/input_items``'s query, as OpenAI has it."""

    limit: Annotated[int, Meta(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None


@routes.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: web.Request) -> web.Response:
    query = decode_query(request.query, InputItemsQuery)
    stored = await request.app[GATEWAY].responses.get(request.match_info["response_id"])
    return json_response(page(stored.input_items, limit=query.limit, order=query.order, after=query.after))


@routes.delete("/v1/responses/{response_id}")
async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    await request.app[GATEWAY].responses.delete(response_id)
    return json_response(DeletedResponse(response_id))
