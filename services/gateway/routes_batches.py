"""OpenAI's Files and Batch APIs: ``/v1/files`` (upload, list, read, delete) and ``/v1/batches``
(make, list, read, cancel). file_store.py keeps the files, batch_store.py the batches,
batch_runner.py runs them."""

from __future__ import annotations

import tempfile
from typing import IO

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from shoal.services.gateway.batch_api import (
    FILE_PURPOSES,
    BatchCreate,
    BatchesQuery,
    FileDeleted,
    FilesQuery,
)
from shoal.services.gateway.batch_store import new_batch
from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.file_store import file_too_large
from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.openai_api import decode_body, decode_query
from shoal.services.gateway.state import GATEWAY
from shoal.shared.openai_batch import BATCH_URLS

routes = web.RouteTableDef()

UPLOAD_CHUNK_BYTES = 1 << 20


@routes.post("/v1/files")
async def upload_file(request: web.Request) -> web.Response:
    """A multipart form with ``purpose`` and ``file``, as OpenAI's clients send it; the file is
    read to a temporary file (never whole in memory), at most `gateway.max_file_bytes`."""
    files = request.app[GATEWAY].files
    if not request.content_type.startswith("multipart/form-data"):
        raise BadRequest("send the file as multipart/form-data with the fields purpose and file")
    with tempfile.TemporaryFile() as spool:
        try:
            purpose, filename, num_bytes = await _read_form(request, spool, files.max_file_bytes)
        except (ValueError, LookupError, HttpProcessingError) as exc:  # no boundary, a torn part, a bad header
            raise BadRequest(f"the body is not a multipart form: {exc}") from exc
        if purpose is None:
            raise BadRequest("purpose: missing (Shoal keeps files for the Batch API: purpose=batch)", param="purpose")
        if purpose not in FILE_PURPOSES:
            raise BadRequest(f"purpose: {purpose[:64]!r} is not one Shoal keeps files for (it keeps them for the "
                             f"Batch API: {', '.join(FILE_PURPOSES)})", param="purpose")
        if filename is None:
            raise BadRequest("file: missing (send the file's bytes in the field file)", param="file")
        spool.seek(0)
        record = await files.create(spool, filename=filename, purpose=purpose, num_bytes=num_bytes)
    return json_response(record)


@routes.get("/v1/files")
async def list_files(request: web.Request) -> web.Response:
    query = decode_query(request.query, FilesQuery)
    return json_response(await request.app[GATEWAY].files.list(purpose=query.purpose, limit=query.limit,
                                                                order=query.order, after=query.after))


@routes.get("/v1/files/{file_id}")
async def get_file(request: web.Request) -> web.Response:
    return json_response(await request.app[GATEWAY].files.get(request.match_info["file_id"]))


@routes.get("/v1/files/{file_id}/content")
async def get_file_content(request: web.Request) -> web.StreamResponse:
    files = request.app[GATEWAY].files
    with tempfile.TemporaryFile() as content:
        record = await files.read_into(request.match_info["file_id"], content)
        response = web.StreamResponse(headers={
            "Content-Type": "application/octet-stream", "Content-Length": str(record.bytes),
            "Content-Disposition": f'attachment; filename="{_header_safe(record.filename)}"'})
        await response.prepare(request)
        while chunk := content.read(UPLOAD_CHUNK_BYTES):
            await response.write(chunk)
        await response.write_eof()
    return response


@routes.delete("/v1/files/{file_id}")
async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    await request.app[GATEWAY].files.delete(file_id)
    return json_response(FileDeleted(id=file_id))


@routes.post("/v1/batches")
async def create_batch(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    create = decode_body(await request.read(), BatchCreate)
    if create.endpoint not in BATCH_URLS:
        raise BadRequest(f"endpoint: {create.endpoint[:64]!r} is not one a batch may name (one of "
                         f"{', '.join(BATCH_URLS)})", param="endpoint")
    source = await state.files.get(create.input_file_id, "input_file_id")
    if source.purpose != "batch":
        raise BadRequest(f"input_file_id: file {source.id!r} was uploaded for {source.purpose!r}, not 'batch'",
                         param="input_file_id")
    batch = new_batch(create, state.batches.clock())
    await state.batches.create(batch)
    state.batch_runner.nudge()
    return json_response(batch)


@routes.get("/v1/batches")
async def list_batches(request: web.Request) -> web.Response:
    query = decode_query(request.query, BatchesQuery)
    return json_response(await request.app[GATEWAY].batches.list(limit=query.limit, after=query.after))


@routes.get("/v1/batches/{batch_id}")
async def get_batch(request: web.Request) -> web.Response:
    return json_response(await request.app[GATEWAY].batches.get(request.match_info["batch_id"]))


@routes.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: web.Request) -> web.Response:
    return json_response(await request.app[GATEWAY].batches.cancel(request.match_info["batch_id"]))


async def _read_form(request: web.Request, spool: IO[bytes], max_bytes: int) -> tuple[str | None, str | None, int]:
    """(purpose, the file's name, its size) of an upload form, the file's bytes written to `spool`."""
    reader = await request.multipart()
    purpose: str | None = None
    filename: str | None = None
    num_bytes = 0
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            raise BadRequest("a nested multipart part; send the fields purpose and file")
        if part.name == "purpose":
            purpose = (await part.text()).strip()
        elif part.name == "file":
            if filename is not None:
                raise BadRequest("file: sent twice (a form holds one file)", param="file")
            filename = part.filename or "upload.jsonl"
            while chunk := await part.read_chunk(UPLOAD_CHUNK_BYTES):
                num_bytes += len(chunk)
                if num_bytes > max_bytes:
                    raise file_too_large(max_bytes)
                spool.write(chunk)
        else:
            await part.release()
    return purpose, filename, num_bytes


def _header_safe(name: str) -> str:
    return "".join(ch if 32 <= ord(ch) < 127 and ch not in '"\\' else "_" for ch in name)[:200]
