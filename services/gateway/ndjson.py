"""A streamed response of JSON lines (``application/x-ndjson``, Ollama's streams).

Committed (status 200, headers) with its first line, so a request that fails before anything
was sent still answers with its proper HTTP status. Nothing is written while a stream waits
(a cold start): a line that is not JSON would break clients that parse every line.
"""

from __future__ import annotations

from aiohttp import web

from shoal.services.gateway.openai_api import encoder

NDJSON_HEADERS = {"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class NdjsonStream:
    def __init__(self, request: web.Request, headers: dict[str, str] | None = None) -> None:
        self._request = request
        self.response = web.StreamResponse(headers=NDJSON_HEADERS | (headers or {}))

    @property
    def committed(self) -> bool:
        """Whether a line went out (an error now goes as a line of its own)."""
        return self.response.prepared

    async def send(self, value: object) -> None:
        if not self.response.prepared:
            await self.response.prepare(self._request)
        await self.response.write(encoder.encode(value) + b"\n")

    async def close(self) -> None:
        if self.response.prepared:
            await self.response.write_eof()
