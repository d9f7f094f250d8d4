"""Anthropic's Message Batches API: ``/v1/messages/batches`` (make, list, read, cancel, delete,
results), served by the Batch API's store and runner (anthropic_batches.py maps the two).
Errors take Anthropic's form (the path is under ``/v1/messages``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import IO, Any

from aiohttp import web
from msgspec import structs

from shoal.services.gateway.anthropic_batches import (
    ENDED,
    MADE_BY,
    MESSAGES_ENDPOINT,
    DeletedMessageBatch,
    MessageBatchCreate,
    MessageBatchesQuery,
    MessageBatchList,
    MessageBatchRequestCounts,
    batch_lines,
    count_results,
    is_message_batch,
    merged_results,
    message_batch,
)
from shoal.services.gateway.batch_api import Batch, BatchCreate, BatchRequestCounts
from shoal.services.gateway.batch_store import new_batch
from shoal.services.gateway.errors import BadRequest, NotFound, PayloadTooLarge
from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.openai_api import decode_body, decode_query
from shoal.services.gateway.state import GATEWAY, GatewayState
from shoal.shared.openai_batch import BadBatch, read_batch

routes = web.RouteTableDef()

READ_CHUNK_BYTES = 1 << 20


@routes.post("/v1/messages/batches")
async def create_message_batch(request: web.Request) -> web.Response:
    """Checked whole before anything is kept (as Anthropic checks a batch when it is made): a
    bad request is a 400 naming it. The body may be as large as `gateway.max_file_bytes`;
    decoding and checking it run off the event loop."""
    state = request.app[GATEWAY]
    body = await _body(request, state.files.max_file_bytes)
    data, num_requests = await asyncio.to_thread(_batch_file, body)
    source = await state.files.create_from_bytes(data, filename="message_batch.jsonl", purpose="batch")
    batch = new_batch(BatchCreate(input_file_id=source.id, endpoint=MESSAGES_ENDPOINT, completion_window="24h",
                                  metadata=MADE_BY), state.batches.clock())
    batch = structs.replace(batch, request_counts=BatchRequestCounts(total=num_requests))  # known already
    await state.batches.create(batch)
    state.batch_runner.nudge()
    return json_response(message_batch(batch, _results_url(batch.id)))


def _batch_file(body: bytes) -> tuple[bytes, int]:
    """The batch file of a ``POST /v1/messages/batches`` body, and its number of requests; a
    400 naming what is wrong."""
    lines = batch_lines(decode_body(body, MessageBatchCreate))
    try:
        read_batch(lines, MESSAGES_ENDPOINT)
    except BadBatch as exc:
        number, problem = exc.problems[0]
        raise BadRequest(f"requests[{number - 1}]: {problem}", param=f"requests[{number - 1}]") from exc
    return "".join(line + "\n" for line in lines).encode(), len(lines)


@routes.get("/v1/messages/batches")
async def list_message_batches(request: web.Request) -> web.Response:
    """Newest first; ``after_id`` pages to older ones, ``before_id`` to newer ones."""
    state = request.app[GATEWAY]
    query = decode_query(request.query, MessageBatchesQuery)
    if query.after_id is not None and query.before_id is not None:
        raise BadRequest("after_id and before_id: send one of them (a page goes one way)", param="before_id")
    batches = [batch for batch in await state.batches.newest_first() if is_message_batch(batch)]
    if query.before_id is not None:
        newer = [batch for batch in batches if batch.id > query.before_id]
        chosen, has_more = newer[-query.limit:], len(newer) > query.limit
    else:
        older = [batch for batch in batches if query.after_id is None or batch.id < query.after_id]
        chosen, has_more = older[:query.limit], len(older) > query.limit
    views = [message_batch(batch, _results_url(batch.id), await _ended_counts(state, batch))
             for batch in chosen]
    return json_response(MessageBatchList(data=views, has_more=has_more, first_id=views[0].id if views else None,
                                          last_id=views[-1].id if views else None))


@routes.get("/v1/messages/batches/{batch_id}")
async def get_message_batch(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    batch = await _message_batch(state, request.match_info["batch_id"])
    return json_response(message_batch(batch, _results_url(batch.id), await _ended_counts(state, batch)))


@routes.post("/v1/messages/batches/{batch_id}/cancel")
async def cancel_message_batch(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    await _message_batch(state, request.match_info["batch_id"])
    batch = await state.batches.cancel(request.match_info["batch_id"])
    return json_response(message_batch(batch, _results_url(batch.id), await _ended_counts(state, batch)))


@routes.delete("/v1/messages/batches/{batch_id}")
async def delete_message_batch(request: web.Request) -> web.Response:
    """An ended batch, its requests and its results forgotten (a running one must be cancelled first)."""
    state = request.app[GATEWAY]
    batch = await _message_batch(state, request.match_info["batch_id"])
    if batch.status not in ENDED:
        raise BadRequest(f"message batch {batch.id!r} is still processing; cancel it, and delete it once it ended")
    for file_id in (batch.input_file_id, batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            with contextlib.suppress(NotFound):
                await state.files.delete(file_id)
    await state.batches.delete(batch.id)
    return json_response(DeletedMessageBatch(id=batch.id))


@routes.get("/v1/messages/batches/{batch_id}/results")
async def message_batch_results(request: web.Request) -> web.StreamResponse:
    """One JSON line per request, in the requests' order (Anthropic's results)."""
    state = request.app[GATEWAY]
    batch = await _message_batch(state, request.match_info["batch_id"])
    if batch.status not in ENDED:
        raise BadRequest(f"message batch {batch.id!r} is still processing: its results come once it ended")
    async with _results(state, batch) as results:
        response = web.StreamResponse(headers={"Content-Type": "application/x-jsonl"})
        await response.prepare(request)
        for result in results:
            await response.write(json.dumps(result).encode() + b"\n")
        await response.write_eof()
    return response


async def _message_batch(state: GatewayState, batch_id: str) -> Batch:
    batch = await state.batches.get(batch_id)
    if not is_message_batch(batch):  # an OpenAI batch
        raise NotFound(f"no message batch {batch_id!r}")
    return batch


async def _ended_counts(state: GatewayState, batch: Batch) -> MessageBatchRequestCounts | None:
    """An ended batch's counts by result: a completed one's from its record, any other's from
    its results (some requests cancelled, expired, or never answered)."""
    if batch.status not in ENDED:
        return None
    if batch.status == "completed":
        return MessageBatchRequestCounts(succeeded=batch.request_counts.completed,
                                         errored=batch.request_counts.failed)
    async with _results(state, batch) as results:
        return count_results(results)


@contextlib.asynccontextmanager
async def _results(state: GatewayState, batch: Batch) -> AsyncIterator[Iterator[dict[str, Any]]]:
    """The batch's results, read from its files (a file gone: as much as the others hold)."""
    with tempfile.TemporaryFile() as source, tempfile.TemporaryFile() as output, \
            tempfile.TemporaryFile() as errors:
        has_requests = await _read(state, batch.input_file_id, source)
        await _read(state, batch.output_file_id, output)
        await _read(state, batch.error_file_id, errors)
        custom_ids = (json.loads(line)["custom_id"] for line in source if line.strip()) if has_requests else None
        yield merged_results(custom_ids, iter(output), iter(errors), batch.status)


async def _read(state: GatewayState, file_id: str | None, out: IO[bytes]) -> bool:
    """Whether the file was there to read."""
    if file_id is None:
        return False
    try:
        await state.files.read_into(file_id, out)
    except NotFound:
        return False
    return True


async def _body(request: web.Request, max_bytes: int) -> bytes:
    """The request body, up to `max_bytes` (a message batch may be larger than other bodies)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(READ_CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"the batch is larger than gateway.max_file_bytes ({max_bytes} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def _results_url(batch_id: str) -> str:
    """Relative, as a client joins it to the base URL it reached the gateway at (behind a proxy
    or a path prefix too)."""
    return f"/v1/messages/batches/{batch_id}/results"
