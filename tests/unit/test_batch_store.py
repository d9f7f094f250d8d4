"""The Batch API's batch transitions (services/gateway/batch_store.py), as pure functions of a
record and the time: who may claim a batch, renew it, let it go, and what a cancel does."""

from __future__ import annotations

from msgspec import structs

from shoal.services.gateway.batch_api import BatchCreate, BatchError
from shoal.services.gateway.batch_store import (
    BATCH_ID,
    LEASE_S,
    SavedRun,
    StoredBatch,
    cancel,
    claim,
    failed,
    finalizing,
    is_claimable,
    new_batch,
    part_name,
    part_saved,
    released,
    renewed,
    started,
    without_saves,
)
from shoal.services.gateway.file_store import page_after

NOW = 1_800_000_000.0


def _stored(status: str = "validating", owner: str = "", lease_until: float = 0.0) -> StoredBatch:
    batch = new_batch(BatchCreate(input_file_id="file-abc", endpoint="/v1/chat/completions",
                                  completion_window="24h"), NOW - 60)
    return StoredBatch(batch=structs.replace(batch, status=status), owner=owner, lease_until=lease_until)


def test_a_new_batch_validates_first_and_expires_a_day_after_it_was_made() -> None:
    batch = _stored().batch
    assert batch.status == "validating" and BATCH_ID.fullmatch(batch.id)
    assert batch.expires_at - batch.created_at == 24 * 3600
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (0, 0, 0)


def test_only_a_batch_with_work_left_and_no_live_claim_is_claimed() -> None:
    free = _stored()
    claimed = claim(free, "gw-a", NOW)
    assert claimed is not None and claimed.owner == "gw-a" and claimed.lease_until == NOW + LEASE_S
    assert claim(claimed, "gw-b", NOW + 1) is None, "a live claim holds"
    assert claim(claimed, "gw-b", NOW + LEASE_S + 1) is not None, "a lapsed claim (a dead gateway) is taken over"
    for status in ("in_progress", "finalizing", "cancelling"):
        assert is_claimable(_stored(status), NOW), status
    for status in ("completed", "failed", "cancelled", "expired"):
        assert claim(_stored(status), "gw-a", NOW) is None, status
    assert claim(None, "gw-a", NOW) is None


def test_a_runner_renews_and_releases_only_its_own_claim() -> None:
    mine = _stored("in_progress", owner="gw-a", lease_until=NOW + 5)
    renewed_batch = renewed(mine, "gw-a", NOW + 10, lambda b: structs.replace(b, status="finalizing"))
    assert renewed_batch is not None and renewed_batch.lease_until == NOW + 10 + LEASE_S
    assert renewed_batch.batch.status == "finalizing"
    assert renewed(mine, "gw-b", NOW) is None, "taken over: the old runner must stop"
    let_go = released(mine, "gw-a")
    assert let_go is not None and not let_go.owner and is_claimable(let_go, NOW)
    assert released(mine, "gw-b") is None


def test_a_cancel_stops_a_running_batch_through_its_runner_and_a_waiting_one_at_once() -> None:
    running = cancel(_stored("in_progress", owner="gw-a", lease_until=NOW + 20), NOW)
    assert running is not None and running.batch.status == "cancelling" and running.owner == "gw-a"
    assert running.batch.cancelling_at == int(NOW) and running.batch.cancelled_at is None
    waiting = cancel(_stored("validating"), NOW)
    assert waiting is not None and waiting.batch.status == "cancelled" and waiting.batch.cancelled_at == int(NOW)
    validating = cancel(_stored("validating", owner="gw-a", lease_until=NOW + 20), NOW)
    assert validating is not None and validating.batch.status == "cancelling", "its runner may be sending already"
    for status in ("cancelling", "finalizing", "completed", "failed", "cancelled", "expired"):
        assert cancel(_stored(status, owner="gw-a", lease_until=NOW + 20), NOW) is None, status
    orphan = cancel(_stored("in_progress", owner="gw-dead", lease_until=NOW - 1), NOW)
    assert orphan is not None and orphan.batch.status == "cancelled" and not orphan.owner, "no runner to wait for"


def test_saved_answers_stay_with_the_batch_through_claims_and_only_its_runner_adds_to_them() -> None:
    mine = _stored("in_progress", owner="gw-a", lease_until=NOW + 5)
    once = part_saved(mine, "gw-a", NOW + 1, "run1", 0, 5)
    twice = part_saved(once, "gw-a", NOW + 2, "run1", 1, 8)
    assert twice is not None and twice.saved == [SavedRun(run="run1", parts=2, answers=8)]
    assert part_saved(twice, "gw-a", NOW + 2, "run1", 1, 8).saved == twice.saved, "a write tried again counts once"
    rewritten = part_saved(twice, "gw-a", NOW + 2, "run1", 1, 11)  # part 1 written again with 3 more answers
    assert rewritten is not None and rewritten.saved == [SavedRun(run="run1", parts=2, answers=11)]
    assert twice.lease_until == NOW + 2 + LEASE_S, "a save renews the claim"
    assert part_saved(twice, "gw-b", NOW + 3, "run9", 0, 1) is None, "a runner that lost the batch saves nothing"
    let_go = released(twice, "gw-a")
    taken = claim(let_go, "gw-b", NOW + 4)
    assert taken is not None and taken.saved == twice.saved, "the next runner finds them"
    more = part_saved(renewed(taken, "gw-b", NOW + 5), "gw-b", NOW + 5, "run2", 0, 4)
    assert more is not None and more.saved == [SavedRun(run="run1", parts=2, answers=8),
                                             SavedRun(run="run2", parts=1, answers=4)]
    assert more.num_saved_answers == 12
    batch_id = more.batch.id
    assert more.saved_parts == [part_name(batch_id, "run1", 0), part_name(batch_id, "run1", 1),
                                part_name(batch_id, "run2", 0)]
    assert not BATCH_ID.fullmatch(more.saved_parts[0]) and more.saved_parts[0].startswith(batch_id + ".")
    forgot = without_saves(more, "gw-b")
    assert forgot is not None and forgot.saved == [] and without_saves(more, "gw-a") is None


def test_a_cancel_with_no_runner_waits_for_one_only_to_write_the_answers_saved() -> None:
    orphan = part_saved(_stored("in_progress", owner="gw-dead", lease_until=NOW + 1), "gw-dead", NOW, "run1", 0, 2)
    assert orphan is not None
    cancelled = cancel(orphan, NOW + LEASE_S + 2)
    assert cancelled is not None and cancelled.batch.status == "cancelling" and is_claimable(cancelled, NOW + 60)


def test_a_runners_steps_never_write_over_a_cancel() -> None:
    """The runner's own transitions keep a cancel that came while it checked the file, sent
    the last request or wrote the answers."""
    validating, cancelling = _stored("validating").batch, _stored("cancelling").batch
    sending = started(validating, NOW, 7)
    assert sending.status == "in_progress" and sending.in_progress_at == int(NOW) and sending.request_counts.total == 7
    assert started(cancelling, NOW, 7) is cancelling
    assert finalizing(sending, NOW).status == "finalizing" and finalizing(cancelling, NOW) is cancelling
    errors = [BatchError(code="invalid_request", message="not JSON", line=2)]
    refused = failed(validating, NOW, errors)
    assert refused.status == "failed" and refused.failed_at == int(NOW) and refused.errors is not None
    assert refused.errors.data == errors
    assert failed(cancelling, NOW, errors).status == "cancelled"


def test_ids_sort_as_they_were_made_so_a_page_finds_its_place_without_its_cursor() -> None:
    ids = [new_batch(BatchCreate(input_file_id="file-abc", endpoint="/v1/embeddings", completion_window="24h"),
                     NOW + i).id for i in range(5)]
    assert ids == sorted(ids)
    newest_first = ids[::-1]
    assert page_after(newest_first, newest_first, limit=2, after=None, descending=True) == (newest_first[:2], True)
    assert page_after(newest_first, newest_first, limit=2, after=newest_first[1], descending=True) == (
        newest_first[2:4], True)
    remaining = newest_first[:2] + newest_first[3:]  # the cursor's own batch expired meanwhile
    assert page_after(remaining, remaining, limit=5, after=newest_first[2], descending=True) == (newest_first[3:], False)
    assert page_after(ids, ids, limit=5, after=ids[2], descending=False) == (ids[3:], False)
