"""Anthropic's Message Batches API as a view of the Batch API's batches (batch_store.py,
batch_runner.py): a message batch is a batch of ``/v1/messages`` requests, its file written by
the gateway from the ``requests`` it was given. Wire types, and the pure mappings between the
two: a batch shown as a message batch, and its answers (output and error files) as results.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from shoal.services.gateway.batch_api import Batch

MESSAGES_ENDPOINT = "/v1/messages"
MADE_BY = {"shoal_api": "anthropic_message_batches"}
"""The metadata of a batch made as a message batch (only those are message batches: a batch of
``/v1/messages`` requests made through OpenAI's Batch API is not, its file being the user's)."""
MAX_REQUESTS = 100_000
"""Anthropic's limit on one message batch's requests."""
CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
ENDED = frozenset({"completed", "failed", "cancelled", "expired"})

ProcessingStatus = Literal["in_progress", "canceling", "ended"]


class MessageBatchRequest(Struct, kw_only=True):
    custom_id: Annotated[str, Meta(pattern=f"^{CUSTOM_ID.pattern}$")]  # msgspec searches: anchored
    params: dict[str, Any]


class MessageBatchCreate(Struct, kw_only=True):
    """``POST /v1/messages/batches``'s body."""

    requests: Annotated[list[MessageBatchRequest], Meta(min_length=1, max_length=MAX_REQUESTS)]


class MessageBatchRequestCounts(Struct, kw_only=True):
    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0


class MessageBatch(Struct, kw_only=True, omit_defaults=False):
    id: str
    processing_status: ProcessingStatus
    request_counts: MessageBatchRequestCounts
    created_at: str
    expires_at: str
    ended_at: str | None = None
    cancel_initiated_at: str | None = None
    archived_at: str | None = None
    results_url: str | None = None
    type: Literal["message_batch"] = "message_batch"


class MessageBatchList(Struct, kw_only=True):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class DeletedMessageBatch(Struct, kw_only=True):
    id: str
    type: Literal["message_batch_deleted"] = "message_batch_deleted"


class MessageBatchesQuery(Struct, kw_only=True):
    """``GET /v1/messages/batches``'s query, as Anthropic has it."""

    limit: Annotated[int, Meta(ge=1, le=1000)] = 20
    after_id: str | None = None
    before_id: str | None = None


def batch_lines(create: MessageBatchCreate) -> list[str]:
    """The batch file of a message batch's requests (OpenAI's batch format, one route)."""
    return [json.dumps({"custom_id": request.custom_id, "method": "POST", "url": MESSAGES_ENDPOINT,
                        "body": request.params}) for request in create.requests]


def message_batch(batch: Batch, results_url: str, ended_counts: MessageBatchRequestCounts | None = None
                  ) -> MessageBatch:
    """`batch` as Anthropic shows a message batch. Until it ends every request counts as
    processing (as Anthropic counts); then `ended_counts` (the results, counted)."""
    ended = batch.status in ENDED
    status: ProcessingStatus = "ended" if ended else "canceling" if batch.status == "cancelling" else "in_progress"
    ended_at = batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at
    total = batch.request_counts.total
    counts = (ended_counts or MessageBatchRequestCounts()) if ended else MessageBatchRequestCounts(processing=total)
    return MessageBatch(id=batch.id, processing_status=status, request_counts=counts,
                        created_at=_rfc3339(batch.created_at), expires_at=_rfc3339(batch.expires_at),
                        ended_at=_rfc3339(ended_at) if ended and ended_at else None,
                        cancel_initiated_at=_rfc3339(batch.cancelling_at) if batch.cancelling_at else None,
                        results_url=results_url if ended else None)


def is_message_batch(batch: Batch) -> bool:
    return batch.endpoint == MESSAGES_ENDPOINT and (batch.metadata or {}).items() >= MADE_BY.items()


def result_of(record: dict[str, Any]) -> dict[str, Any]:
    """One line of a batch's output or error file as a message batch's result."""
    response, error = record.get("response"), record.get("error") or {}
    if response is not None and 200 <= response["status_code"] < 300:
        result: dict[str, Any] = {"type": "succeeded", "message": response["body"]}
    elif response is not None:
        body = response["body"]
        result = {"type": "errored", "error": body if isinstance(body, dict) and body.get("type") == "error" else
                  _api_error(f"status {response['status_code']}: {json.dumps(body)[:500]}")}
    elif error.get("code") == "batch_cancelled":
        result = {"type": "canceled"}
    elif error.get("code") == "batch_expired":
        result = {"type": "expired"}
    else:  # no answer came (a timeout, the gateway unreachable)
        result = {"type": "errored", "error": _api_error(error.get("message", "no answer"))}
    return {"custom_id": record["custom_id"], "result": result}


def unanswered(custom_id: str, status: str) -> dict[str, Any]:
    """The result of a request in neither file: the batch ended before a runner wrote it (a
    batch cancelled with no runner, or failed)."""
    kinds: dict[str, dict[str, Any]] = {"cancelled": {"type": "canceled"}, "expired": {"type": "expired"}}
    result = kinds.get(status, {"type": "errored",
                                "error": _api_error("the batch ended before this request was answered")})
    return {"custom_id": custom_id, "result": result}


def merged_results(custom_ids: Iterable[str] | None, output: Iterator[bytes], errors: Iterator[bytes], status: str
                   ) -> Iterator[dict[str, Any]]:
    """The results in the requests' order: each request's line is in the output file or the
    error file (both in the requests' order), or in neither (`unanswered`, the batch having
    ended `status`). Without the requests (their file expired): the two files' lines."""
    if custom_ids is None:
        for line in itertools.chain(output, errors):
            if line.strip():
                yield result_of(json.loads(line))
        return
    pending: dict[str, dict[str, Any] | None] = {"output": None, "errors": None}
    sources = {"output": output, "errors": errors}
    for custom_id in custom_ids:
        for name in ("output", "errors"):
            if pending[name] is None:
                raw = next(sources[name], None)
                pending[name] = json.loads(raw) if raw and raw.strip() else None
            record = pending[name]
            if record is not None and record["custom_id"] == custom_id:
                pending[name] = None
                yield result_of(record)
                break
        else:
            yield unanswered(custom_id, status)


def count_results(results: Iterable[dict[str, Any]]) -> MessageBatchRequestCounts:
    counts = MessageBatchRequestCounts()
    for result in results:
        kind = result["result"]["type"]
        setattr(counts, kind, getattr(counts, kind) + 1)
    return counts


def _api_error(message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": "api_error", "message": message}}


def _rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).isoformat().replace("+00:00", "Z")
