"""OpenAI's Files and Batch APIs, as wire types: a file of batch requests uploaded, a batch made
of it, its answers downloaded as files (routes_batches.py serves them; batch_runner.py runs
the batches)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

FILE_PURPOSES = ("batch",)
"""What a client may upload a file for (Shoal keeps files for the Batch API alone)."""
OUTPUT_PURPOSE = "batch_output"
"""A batch's answers and errors, written by Shoal."""
COMPLETION_WINDOW = "24h"
"""The only window OpenAI offers; a batch not done within it expires."""
COMPLETION_WINDOW_S = 24 * 3600.0

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
ACTIVE_STATUSES: frozenset[str] = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
"""A batch a runner still has work on (the others are final)."""


class FileObject(Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: Literal["file"] = "file"
    status: Literal["processed"] = "processed"
    expires_at: int | None = None


class FileList(Struct, kw_only=True):
    data: list[FileObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"


class FileDeleted(Struct, kw_only=True):
    id: str
    deleted: bool = True
    object: Literal["file"] = "file"


class FilesQuery(Struct, kw_only=True):
    """``GET /v1/files``'s query, as OpenAI has it."""

    purpose: str | None = None
    limit: Annotated[int, Meta(ge=1, le=10000)] = 10000
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None


class BatchRequestCounts(Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    """Requests answered with a 2xx (their lines are in the output file)."""
    failed: int = 0
    """Requests refused or never answered (their lines are in the error file)."""


class BatchError(Struct, kw_only=True, omit_defaults=False):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(Struct, kw_only=True):
    data: list[BatchError]
    object: Literal["list"] = "list"


BatchMetadata = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
                          Meta(max_length=16)]


class BatchCreate(Struct, kw_only=True):
    """``POST /v1/batches``'s body."""

    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"]
    metadata: BatchMetadata | None = None


class Batch(Struct, kw_only=True):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    request_counts: BatchRequestCounts
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    metadata: dict[str, str] | None = None
    object: Literal["batch"] = "batch"


class BatchList(Struct, kw_only=True):
    data: list[Batch]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"


class BatchesQuery(Struct, kw_only=True):
    """``GET /v1/batches``'s query, as OpenAI has it."""

    limit: Annotated[int, Meta(ge=1, le=100)] = 20
    after: str | None = None
