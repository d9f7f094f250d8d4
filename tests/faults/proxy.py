"""A TCP proxy a test can cut: one service's NATS connection goes through it, so that service
(and only it) loses the bus while every other part keeps it — a network partition."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to a target; `cut()` drops every connection and refuses new
    ones (closed at once) until `restore()`."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.is_cut = False
        self.port = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def cut(self) -> None:
        self.is_cut = True
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    def restore(self) -> None:
        self.is_cut = False

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_cut:
            writer.close()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, upstream_writer))
        for source, sink in ((reader, upstream_writer), (upstream_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink, (writer, upstream_writer)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter,
                    pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        try:
            while data := await source.read(65536):
                if self.is_cut:
                    break
                sink.write(data)
                await sink.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            for writer in pair:
                writer.close()
                self._writers.discard(writer)


@contextlib.asynccontextmanager
async def cuttable_proxy(nats_url: str) -> AsyncIterator[CuttableProxy]:
    host, port = nats_url.removeprefix("nats://").rsplit(":", 1)
    proxy = CuttableProxy(host, int(port))
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()
