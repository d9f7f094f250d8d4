"""Server-Sent Events responses that keep the connection alive while there is nothing to send.

A stream that waits (a cold start: placement, a worker process starting, weights loading;
or a replica restarting mid-stream) sends an SSE comment line, ``: <what it waits for>``,
after `keepalive_s` without a write and again every `keepalive_s`. Clients ignore comment
lines (the SSE spec; the `openai` client does), and proxies with idle timeouts see bytes.

The response is committed (status 200, headers) only when the first line goes out: a
stream that fails before anything was sent still answers with its proper HTTP status.
Writes are serialized by a lock, so the keep-alive task and the handler never interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from shoal.shared.periodic import sleep_or_stop

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""``X-Accel-Buffering: no`` keeps nginx from holding the stream back."""


class SseStream:
    """One SSE response; see the module doc."""

    def __init__(self, request: web.Request, *, keepalive_s: float, describe: Callable[[float], str] = lambda _: "",
                 headers: dict[str, str] | None = None) -> None:
        """Args:
        keepalive_s: idle time before a comment line.
        describe: what the stream waits for, given the seconds waited (the comment's text).
        """
        self._request = request
        self.response = web.StreamResponse(headers=SSE_HEADERS | (headers or {}))
        self._keepalive_s = keepalive_s
        self._describe = describe
        self._lock = asyncio.Lock()
        loop = asyncio.get_running_loop()
        self._clock = loop.time
        self._started = self._last_write = loop.time()
        self._closed = False
        self.num_comments = 0

    @property
    def prepared(self) -> bool:
        return self.response.prepared

    @contextlib.asynccontextmanager
    async def keeping_alive(self) -> AsyncIterator[SseStream]:
        """Send comment lines while idle for as long as the block runs."""
        task = asyncio.create_task(self._keep_alive())
        try:
            yield self
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def send(self, payload: bytes, *, event_id: int | None = None, event: str | None = None) -> None:
        """One ``data:`` event (and its ``id:``, which a client sends back as ``Last-Event-ID``, and
        its ``event:`` name, which the Responses API's events carry)."""
        head = b"id: %d\n" % event_id if event_id is not None else b""
        if event is not None:
            head += b"event: " + event.encode() + b"\n"
        await self._write(head + b"data: " + payload + b"\n\n")

    async def comment(self, text: str) -> None:
        await self._write(b": " + " ".join(text.split()).encode() + b"\n\n")

    async def done(self) -> None:
        """``data: [DONE]`` (the OpenAI stream's end) and the end of the response."""
        await self._write(b"data: [DONE]\n\n")
        await self.close()

    async def close(self) -> None:
        async with self._lock:
            self._closed = True
            if self.response.prepared:
                await self.response.write_eof()

    async def commit_or_give_up(self) -> bool:
        """For an error: True if the response went out already (send the error in the stream);
        False if nothing did, and nothing will (answer with the error's HTTP status instead)."""
        async with self._lock:
            if self.response.prepared:
                return True
            self._closed = True
            return False

    async def _write(self, data: bytes) -> None:
        async with self._lock:
            if not self.response.prepared:
                await self.response.prepare(self._request)
            await self.response.write(data)
            self._last_write = self._clock()

    async def _keep_alive(self) -> None:
        while True:
            idle_s = self._clock() - self._last_write
            if idle_s < self._keepalive_s:
                await sleep_or_stop(self._keepalive_s - idle_s)
                continue
            text = self._describe(self._clock() - self._started) or "waiting"
            async with self._lock:
                if self._closed:
                    return
                try:
                    if not self.response.prepared:
                        await self.response.prepare(self._request)
                    await self.response.write(b": " + " ".join(text.split()).encode() + b"\n\n")
                except (ConnectionError, RuntimeError):
                    return  # the client left: aiohttp cancels the handler
                self._last_write = self._clock()
                self.num_comments += 1
