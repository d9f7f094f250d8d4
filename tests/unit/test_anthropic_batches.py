"""Anthropic's Message Batches as a view of the Batch API's batches (services/gateway/
anthropic_batches.py): statuses, counts, timestamps, and the results merged in request order."""

from __future__ import annotations

import json

from msgspec import structs

from shoal.services.gateway.anthropic_batches import (
    MADE_BY,
    MessageBatchCreate,
    MessageBatchRequest,
    MessageBatchRequestCounts,
    batch_lines,
    count_results,
    is_message_batch,
    merged_results,
    message_batch,
    result_of,
)
from shoal.services.gateway.batch_api import BatchCreate, BatchRequestCounts
from shoal.services.gateway.batch_store import new_batch

NOW = 1_800_000_000.0
URL = "http://gw/v1/messages/batches/b/results"


def _record(custom_id: str, status: int | None, body: object = None, code: str | None = None) -> dict:
    response = None if status is None else {"status_code": status, "request_id": "r", "body": body}
    error = None if code is None else {"code": code, "message": f"{code} happened"}
    return {"id": "batch_req_1", "custom_id": custom_id, "response": response, "error": error}


def test_a_message_batchs_requests_become_a_batch_file_of_messages_requests() -> None:
    create = MessageBatchCreate(requests=[MessageBatchRequest(custom_id="a-1", params={"model": "m", "max_tokens": 3})])
    assert [json.loads(line) for line in batch_lines(create)] == [
        {"custom_id": "a-1", "method": "POST", "url": "/v1/messages", "body": {"model": "m", "max_tokens": 3}}]


def test_a_batch_shows_as_anthropic_counts_it_processing_until_it_ends() -> None:
    batch = new_batch(BatchCreate(input_file_id="file-0a", endpoint="/v1/messages", completion_window="24h"), NOW)
    running = structs.replace(batch, status="in_progress", request_counts=BatchRequestCounts(total=5, completed=2))
    view = message_batch(running, URL)
    assert view.processing_status == "in_progress" and view.results_url is None and view.ended_at is None
    assert view.request_counts == MessageBatchRequestCounts(processing=5)
    assert view.created_at == "2027-01-15T08:00:00Z" and view.expires_at == "2027-01-16T08:00:00Z"
    cancelling = message_batch(structs.replace(running, status="cancelling", cancelling_at=int(NOW) + 60), URL)
    assert cancelling.processing_status == "canceling" and cancelling.cancel_initiated_at == "2027-01-15T08:01:00Z"
    ended_counts = MessageBatchRequestCounts(succeeded=2, canceled=3)
    ended = message_batch(structs.replace(running, status="cancelled", cancelled_at=int(NOW) + 90), URL, ended_counts)
    assert ended.processing_status == "ended" and ended.ended_at == "2027-01-15T08:01:30Z"
    assert ended.results_url == URL and ended.request_counts == ended_counts


def test_each_answer_is_a_result_of_its_kind() -> None:
    message = {"type": "message", "content": [{"type": "text", "text": "hi"}]}
    refusal = {"type": "error", "error": {"type": "not_found_error", "message": "no model"}}
    assert result_of(_record("a", 200, message)) == {"custom_id": "a", "result": {"type": "succeeded",
                                                                                  "message": message}}
    assert result_of(_record("b", 404, refusal))["result"] == {"type": "errored", "error": refusal}
    assert result_of(_record("c", None, code="batch_cancelled"))["result"] == {"type": "canceled"}
    assert result_of(_record("d", None, code="batch_expired"))["result"] == {"type": "expired"}
    lost = result_of(_record("e", None, code="timeout"))["result"]
    assert lost["type"] == "errored" and lost["error"]["error"] == {"type": "api_error", "message": "timeout happened"}
    garbled = result_of(_record("f", 502, {"error": {"message": "not JSON", "type": "invalid_response"}}))["result"]
    assert garbled["error"]["type"] == "error" and garbled["error"]["error"]["type"] == "api_error"
    assert "status 502" in garbled["error"]["error"]["message"], "any refusal is an ErrorResponse"


def test_results_come_in_the_requests_order_from_both_files_and_are_counted() -> None:
    output = [_record("a", 200, {}), _record("d", 200, {})]
    errors = [_record("b", 429, {}), _record("c", None, code="batch_cancelled"), _record("e", None, code="batch_cancelled")]
    lines = lambda records: iter(json.dumps(r).encode() + b"\n" for r in records)  # noqa: E731
    results = list(merged_results(["a", "b", "c", "d", "e"], lines(output), lines(errors), "cancelled"))
    assert [(r["custom_id"], r["result"]["type"]) for r in results] == [
        ("a", "succeeded"), ("b", "errored"), ("c", "canceled"), ("d", "succeeded"), ("e", "canceled")]
    assert count_results(results) == MessageBatchRequestCounts(succeeded=2, errored=1, canceled=2)
    # A request in neither file (a batch cancelled before any runner held it, or failed): each
    # request still has a result, so the counts add up to the requests.
    orphaned = list(merged_results(["a", "b"], iter(()), iter(()), "cancelled"))
    assert [r["result"] for r in orphaned] == [{"type": "canceled"}] * 2
    failed = list(merged_results(["a", "b"], lines(output[:1]), iter(()), "failed"))
    assert [r["result"]["type"] for r in failed] == ["succeeded", "errored"]
    assert failed[1]["result"]["error"]["type"] == "error"
    # The requests' file expired: the two files' lines, as they are.
    assert [r["custom_id"] for r in merged_results(None, lines(output), lines(errors), "cancelled")] == [
        "a", "d", "b", "c", "e"]


def test_only_a_batch_made_as_a_message_batch_is_one() -> None:
    made = BatchCreate(input_file_id="file-0a", endpoint="/v1/messages", completion_window="24h")
    assert is_message_batch(new_batch(structs.replace(made, metadata=MADE_BY), NOW))
    assert not is_message_batch(new_batch(made, NOW)), "its file is the user's: OpenAI's Batch API's alone"
    assert not is_message_batch(new_batch(structs.replace(made, endpoint="/v1/chat/completions",
                                                          metadata=MADE_BY), NOW))
