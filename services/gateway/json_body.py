"""A JSON response from a msgspec value (a Struct, or anything msgspec encodes)."""

from __future__ import annotations

from aiohttp import web

from shoal.services.gateway.openai_api import encoder


def json_response(payload: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=encoder.encode(payload), status=status, content_type="application/json",
                        headers=headers)
