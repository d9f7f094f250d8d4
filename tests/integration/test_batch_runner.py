"""The Batch API's runner (services/gateway/batch_runner.py) on a real nats-server, sending to a
real HTTP server on a socket: answers split into the output and error files in the input's
order, one runner per batch, cancels, a dead or stopped gateway's batch taken over from the
answers it saved, bad files, expiry."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from msgspec import structs

from shoal.services.gateway.batch_api import Batch, BatchCreate
from shoal.services.gateway.batch_runner import BatchRunner
from shoal.services.gateway.batch_store import LEASE_S, BatchStore, StoredBatch, new_batch, open_batch_store
from shoal.services.gateway.file_store import FileStore, open_file_store
from shoal.shared.bus import Bus
from shoal.shared.config import GatewayConfig
from shoal.shared.metrics import Registry
from tests.local_http import serving

CHAT = "/v1/chat/completions"
FINAL = ("completed", "failed", "cancelled", "expired")


class Target:
    """The gateway the runner sends to: answers each chat at once (a 404 for model ``missing``,
    a 429 the first time for ``busy``), or holds the ones named in `held` until `release`."""

    def __init__(self, held: tuple[str, ...] = ()) -> None:
        self.calls: list[str] = []
        self.held = held
        self.in_flight: set[str] = set()
        self._released = asyncio.Event()
        self._refused: set[str] = set()

    def release(self) -> None:
        self._released.set()

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        custom_id = body["messages"][0]["content"]
        self.calls.append(custom_id)
        if body["model"] == "missing":
            return web.json_response({"error": {"message": "no such model", "type": "not_found_error"}}, status=404)
        if body["model"] == "busy" and custom_id not in self._refused:
            self._refused.add(custom_id)
            return web.json_response({"error": {"message": "queue full"}}, status=429, headers={"Retry-After": "0"})
        if custom_id in self.held:
            self.in_flight.add(custom_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), 30)
            self.in_flight.discard(custom_id)
        return web.json_response({"answer": custom_id, "usage": {"total_tokens": 3}},
                                 headers={"x-request-id": f"req-{custom_id}"})


def _line(custom_id: str, model: str = "m", url: str = CHAT) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": model, "messages": [{"role": "user", "content": custom_id}]}})


@contextlib.asynccontextmanager
async def _stores(bus: Bus) -> AsyncIterator[tuple[FileStore, BatchStore]]:
    config = GatewayConfig()
    yield await open_file_store(bus.js, config), await open_batch_store(bus.js, config)


async def _make(files: FileStore, batches: BatchStore, lines: list[str]) -> Batch:
    source = await files.create_from_bytes("\n".join(lines).encode(), filename="in.jsonl", purpose="batch")
    batch = new_batch(BatchCreate(input_file_id=source.id, endpoint=CHAT, completion_window="24h"), time.time())
    await batches.create(batch)
    return batch


@contextlib.asynccontextmanager
async def _running(batches: BatchStore, files: FileStore, url: str, owner: str = "gw-a", *, concurrency: int = 2,
                   clock: Callable[[], float] = time.time, registry: Registry | None = None,
                   save_every_s: float = 30.0) -> AsyncIterator[BatchRunner]:
    runner = BatchRunner(batches, files, registry or Registry(), owner=owner, base_url=url, headers={},
                         concurrency=concurrency, max_running=2, request_timeout_s=5.0, poll_s=0.1,
                         save_every_s=save_every_s, clock=clock)
    runner.start()
    try:
        yield runner
    finally:
        await runner.stop()


async def _until(batches: BatchStore, batch_id: str, done: Callable[[Batch], bool], timeout_s: float = 20.0) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await batches.get(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        await asyncio.sleep(0.05)


async def _ended(batches: BatchStore, batch_id: str) -> Batch:
    return await _until(batches, batch_id, lambda batch: batch.status in FINAL)


async def _records(files: FileStore, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in (await files.read(file_id)).decode().splitlines()]


async def _until_in_flight(target: Target, custom_id: str) -> None:
    for _ in range(400):
        if custom_id in target.in_flight:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{custom_id} never reached the target")


async def test_answers_go_to_the_output_file_and_refusals_to_the_error_file_in_order(bus: Bus) -> None:
    target = Target()
    registry = Registry()
    lines = [_line("r0"), _line("r1"), _line("r2", "missing"), _line("r3", "busy"), _line("r4"), _line("r5")]
    async with _stores(bus) as (files, batches), serving({CHAT: target.chat}) as url:
        batch = await _make(files, batches, lines)
        async with _running(batches, files, url, registry=registry):
            ended = await _ended(batches, batch.id)
        output, errors = await _records(files, ended.output_file_id), await _records(files, ended.error_file_id)
        stored = await batches.read(batch.id)
    assert ended.status == "completed", ended
    counts = ended.request_counts
    assert (counts.total, counts.completed, counts.failed) == (6, 5, 1)
    assert [r["custom_id"] for r in output] == ["r0", "r1", "r3", "r4", "r5"]
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["answer"] == r["custom_id"]
               and r["response"]["request_id"] == f"req-{r['custom_id']}" and r["error"] is None for r in output)
    assert [(r["custom_id"], r["response"]["status_code"]) for r in errors] == [("r2", 404)]
    assert target.calls.count("r3") == 2, "a 429 is asked again"
    assert ended.in_progress_at and ended.finalizing_at and ended.completed_at
    assert ended.created_at <= ended.in_progress_at <= ended.finalizing_at <= ended.completed_at
    assert stored is not None and stored.value.owner == "", "an ended batch is let go"
    output_file = await files.get(ended.output_file_id or "")
    assert output_file.purpose == "batch_output" and output_file.filename == f"{batch.id}_output.jsonl"
    assert registry.counter("shoal_gateway_batch_requests_total", "", ["outcome"]).get(outcome="completed") == 5
    assert registry.counter("shoal_gateway_batches_total", "", ["status"]).get(status="completed") == 1


async def test_two_runners_never_both_run_one_batch(bus: Bus) -> None:
    target = Target()
    async with _stores(bus) as (files, batches), serving({CHAT: target.chat}) as url:
        made = [await _make(files, batches, [_line(f"b{b}-r{i}") for i in range(6)]) for b in range(3)]
        async with _running(batches, files, url, "gw-a"), _running(batches, files, url, "gw-b"):
            ended = [await _ended(batches, batch.id) for batch in made]
    assert [batch.status for batch in ended] == ["completed"] * 3
    assert Counter(target.calls) == Counter(f"b{b}-r{i}" for b in range(3) for i in range(6)), "each sent once"


async def test_a_cancel_keeps_what_was_answered_and_ends_what_was_not(bus: Bus) -> None:
    target = Target(held=("r1",))
    async with _stores(bus) as (files, batches), serving({CHAT: target.chat}) as url:
        batch = await _make(files, batches, [_line("r0"), _line("r1"), _line("r2")])
        async with _running(batches, files, url, concurrency=1):
            await _until_in_flight(target, "r1")
            cancelling = await batches.cancel(batch.id)
            ended = await _ended(batches, batch.id)
            target.release()
        output, errors = await _records(files, ended.output_file_id), await _records(files, ended.error_file_id)
    assert cancelling.status == "cancelling" and ended.status == "cancelled" and ended.cancelled_at
    assert [r["custom_id"] for r in output] == ["r0"]
    assert [(r["custom_id"], r["response"], r["error"]["code"]) for r in errors] == [
        ("r1", None, "batch_cancelled"), ("r2", None, "batch_cancelled")]
    assert "r2" not in target.calls, "nothing is sent after the cancel"
    assert (ended.request_counts.completed, ended.request_counts.failed) == (1, 2)


async def test_a_batch_whose_runner_stopped_answering_is_taken_over_and_what_it_never_saved_sent_again(
        bus: Bus) -> None:
    """A runner whose claim lapsed (a dead or cut-off gateway) loses the batch to another, and
    learns so at its next write: it stops without writing files, the other answers everything
    it had not saved (here: nothing yet, its first save was 30 s away)."""
    target = Target(held=("r1",))
    async with _stores(bus) as (files, batches), serving({CHAT: target.chat}) as url:
        batch = await _make(files, batches, [_line("r0"), _line("r1"), _line("r2")])
        async with _running(batches, files, url, "gw-a", concurrency=1):
            await _until_in_flight(target, "r1")
            async with _running(batches, files, url, "gw-b", concurrency=1, clock=_after_the_lease):
                await _until(batches, batch.id, lambda b: target.calls.count("r0") == 2)
                target.release()
                ended = await _ended(batches, batch.id)
        output = await _records(files, ended.output_file_id)
        stored = await batches.read(batch.id)
    assert ended.status == "completed" and ended.error_file_id is None
    assert [r["custom_id"] for r in output] == ["r0", "r1", "r2"], "one line each, from gw-b's run"
    assert stored is not None and stored.value.owner == ""
    outputs = [f for f in (await files.list(purpose="batch_output", limit=100, order="asc", after=None)).data]
    assert len(outputs) == 1, "gw-a wrote no file once it lost the batch"


async def test_a_runner_taking_over_a_dead_gateways_batch_sends_only_what_was_not_saved(bus: Bus) -> None:
    target = Target(held=("r1",))
    async with _stores(bus) as (files, batches), serving({CHAT: target.chat}) as url:
        batch = await _make(files, batches, [_line("r0"), _line("r1"), _line("r2")])
        async with _running(batches, files, url, "gw-a", concurrency=1, save_every_s=0.0):
            await _until_in_flight(target, "r1")
            saved = await _until_saved(batches, batch.id)
            async with _running(batches, files, url, "gw-b", concurrency=1, clock=_after_the_lease):
                await _until(batches, batch.id, lambda b: target.calls.count("r1") == 2)
                target.release()
                ended = await _ended(batches, batch.id)
        output = await _records(files, ended.output_file_id)
        parts_left = [await files.read_object(name) for name in saved.saved_parts]
        stored = await batches.read(batch.id)
    assert ended.status == "completed" and [r["custom_id"] for r in output] == ["r0", "r1", "r2"]
    assert output[0]["response"]["body"] == {"answer": "r0", "usage": {"total_tokens": 3}}, "the saved answer, whole"
    assert target.calls.count("r0") == 1, "an answer saved is not asked again"
    assert (ended.request_counts.completed, ended.request_counts.failed) == (3, 0)
    assert parts_left == [None] and stored is not None and stored.value.saved == [], "saved parts go with the end"


async def test_a_store_that_takes_no_save_neither_stops_the_batch_nor_sends_a_request_twice(bus: Bus) -> None:
    """Saves are a help, not a step the batch needs: with ``shoal_files`` full, the run goes on
    past every failed save to its end, where its output cannot be stored either (``failed``,
    naming that), instead of dying at its first save and being taken over again and again."""
    target = Target(held=("r3",))
    config = GatewayConfig(max_file_bytes=4096, files_max_bytes=32 * 1024)
    files, batches = await open_file_store(bus.js, config), await open_batch_store(bus.js, config)
    async with serving({CHAT: target.chat}) as url:
        batch = await _make(files, batches, [_line(f"r{i}") for i in range(5)])
        filled = 0
        with contextlib.suppress(Exception):  # the store refuses the first object that does not fit
            while True:
                await files.put_object(f"filler-{filled}", b"x" * 64)
                filled += 1
        async with _running(batches, files, url, concurrency=1, save_every_s=0.0):
            await _until_in_flight(target, "r3")
            await asyncio.sleep(2.5)  # two progress writes, each with a save the store refused
            target.release()
            ended = await _ended(batches, batch.id)
        stored = await batches.read(batch.id)
    assert filled > 0
    assert ended.status == "failed" and ended.errors is not None
    assert [error.code for error in ended.errors.data] == ["output_not_stored"]
    assert Counter(target.calls) == Counter(f"r{i}" for i in range(5)), "each sent once: the run never broke off"
    assert stored is not None and stored.value.saved == []


async def _until_saved(batches: BatchStore, batch_id: str) -> StoredBatch:
    for _ in range(400):
        stored = await batches.read(batch_id)
        if stored is not None and stored.value.saved:
            return stored.value
        await asyncio.sleep(0.025)
    raise AssertionError("the runner never saved its answers")


def _after_the_lease() -> float:
    """A clock on which every claim made now has lapsed (gw-b's, when gw-a stopped answering)."""
    return time.time() + LEASE_S + 1


async def test_a_file_that_is_not_a_batch_fails_naming_each_bad_line_and_sends_nothing(bus: Bus) -> None:
    target = Target()
    async with _stores(bus) as (files, batches), serving({CHAT: target.chat}) as url:
        batch = await _make(files, batches, [_line("r0"), "{not json", _line("r2", url="/v1/embeddings"), _line("r0")])
        async with _running(batches, files, url):
            ended = await _ended(batches, batch.id)
    assert ended.status == "failed" and ended.failed_at and ended.errors is not None
    assert [(error.line, error.code) for error in ended.errors.data] == [
        (2, "invalid_request"), (3, "invalid_request"), (4, "invalid_request")]
    assert "not the batch's endpoint" in ended.errors.data[1].message
    assert "is line 1's too" in ended.errors.data[2].message
    assert target.calls == [] and ended.output_file_id is None


async def test_a_batch_not_done_within_its_window_expires_with_what_it_answered(bus: Bus) -> None:
    target = Target(held=("r1",))
    now = [time.time()]
    async with _stores(bus) as (files, batches), serving({CHAT: target.chat}) as url:
        batch = await _make(files, batches, [_line("r0"), _line("r1"), _line("r2")])
        async with _running(batches, files, url, concurrency=1, clock=lambda: now[0]):
            await _until_in_flight(target, "r1")
            now[0] = batch.expires_at + 1.0
            ended = await _ended(batches, batch.id)
            target.release()
        output, errors = await _records(files, ended.output_file_id), await _records(files, ended.error_file_id)
    assert ended.status == "expired" and ended.expired_at
    assert [r["custom_id"] for r in output] == ["r0"]
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [("r1", "batch_expired"), ("r2", "batch_expired")]


async def test_a_stopping_gateway_lets_its_batch_go_and_another_finishes_it(bus: Bus) -> None:
    target = Target(held=("r1",))
    async with _stores(bus) as (files, batches), serving({CHAT: target.chat}) as url:
        batch = await _make(files, batches, [_line("r0"), _line("r1")])
        async with _running(batches, files, url, "gw-a", concurrency=1):
            await _until_in_flight(target, "r1")
        let_go = await batches.read(batch.id)
        target.release()
        async with _running(batches, files, url, "gw-b"):  # at once: no claim to wait out
            ended = await _until(batches, batch.id, lambda b: b.status in FINAL, timeout_s=LEASE_S / 3)
        output = await _records(files, ended.output_file_id)
    assert let_go is not None and let_go.value.owner == "" and let_go.value.batch.status == "in_progress"
    assert let_go.value.num_saved_answers == 1, "it saved what it answered (r0) before letting go"
    assert ended.status == "completed" and [r["custom_id"] for r in output] == ["r0", "r1"]
    assert target.calls.count("r0") == 1, "the next runner went on from the saved answer"


async def test_a_batch_cancelled_between_runners_writes_the_answers_saved(bus: Bus) -> None:
    target = Target(held=("r1",))
    async with _stores(bus) as (files, batches), serving({CHAT: target.chat}) as url:
        batch = await _make(files, batches, [_line("r0"), _line("r1"), _line("r2")])
        async with _running(batches, files, url, "gw-a", concurrency=1):
            await _until_in_flight(target, "r1")
        cancelling = await batches.cancel(batch.id)  # no runner holds it: its saved answer is kept
        target.release()
        async with _running(batches, files, url, "gw-b"):
            ended = await _ended(batches, batch.id)
        output, errors = await _records(files, ended.output_file_id), await _records(files, ended.error_file_id)
    assert cancelling.status == "cancelling"
    assert ended.status == "cancelled" and [r["custom_id"] for r in output] == ["r0"]
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [("r1", "batch_cancelled"),
                                                                       ("r2", "batch_cancelled")]
    assert target.calls == ["r0", "r1"], "nothing sent after the cancel"


async def test_a_batch_cancelled_after_its_runner_died_ends_without_taking_a_slot(bus: Bus) -> None:
    target = Target(held=("r0",))
    async with _stores(bus) as (files, batches), serving({CHAT: target.chat}) as url:
        busy = await _make(files, batches, [_line("r0")])
        orphan = await _make(files, batches, [_line("o0")])
        await batches.update(orphan.id, lambda stored: stored and StoredBatch(
            batch=structs.replace(stored.batch, status="cancelling", cancelling_at=int(time.time())),
            owner="gw-dead", lease_until=time.time() - 1))
        runner = BatchRunner(batches, files, Registry(), owner="gw-a", base_url=url, headers={}, concurrency=1,
                             max_running=1, request_timeout_s=5.0, poll_s=0.1)
        runner.start()
        try:
            await _until_in_flight(target, "r0")  # the one slot is busy
            ended = await _ended(batches, orphan.id)
        finally:
            target.release()
            await runner.stop()
        assert (await batches.get(busy.id)).status in ("in_progress", "completed")
        assert [stored.batch.id for stored in await batches.active()] in ([busy.id], [])
    assert ended.status == "cancelled" and ended.cancelled_at and ended.output_file_id is None
    assert "o0" not in target.calls
