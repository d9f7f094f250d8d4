"""Runs the Batch API's batches: every gateway runs one `BatchRunner`, which claims batches no
live runner holds (batch_store.py: by compare-and-swap, with a lease), at most
`gateway.max_running_batches` at once, oldest first.

A batch's requests are sent to this gateway's own HTTP edge, as ``shoal run-batch`` sends them
(shared/openai_batch.py): each one goes through the same routes, queues, fairness and limits
as any client's, `gateway.batch_concurrency` at a time, and a 429 or 503 (a full queue, a
model asleep or being placed) is asked again until the batch's window closes: a batch waits
for capacity rather than failing. Every second or so the runner writes the counts; that write
is also where it learns the batch was cancelled (then it stops sending, drops what is in
flight, and writes what was answered). Its claim is renewed all along, by a heartbeat, while
a large file is read or its answers written too. When every request is answered it writes
the output file (2xx answers) and the error file (everything else), in the input's order,
each only if it has a line. A store that will not take them makes the batch ``failed``.

A gateway that stops saves what its batches answered and lets them go; one that dies holds
them until its claim lapses (`LEASE_S`). Either way another runner takes them and sends what
was not answered, going on from the answers saved (every `SAVE_EVERY_S` or so while a batch
runs: batch_saves.py). A batch cancelled while no runner holds it is ``cancelled`` at once, or,
when it has answers saved, ends like any cancel once a runner has written them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

import aiohttp
import structlog
from msgspec import structs

from shoal.services.gateway.anthropic_batches import MAX_REQUESTS as MAX_MESSAGE_BATCH_REQUESTS
from shoal.services.gateway.anthropic_batches import MESSAGES_ENDPOINT
from shoal.services.gateway.batch_api import (
    OUTPUT_PURPOSE,
    Batch,
    BatchError,
    BatchRequestCounts,
)
from shoal.services.gateway.batch_saves import (
    SAVE_EVERY_ANSWERS,
    SAVE_EVERY_S,
    decode_part,
    encode_part,
    is_save_due,
)
from shoal.services.gateway.batch_store import (
    LEASE_S,
    BatchStore,
    StoredBatch,
    abandoned,
    claim,
    failed,
    finalizing,
    is_claimable,
    part_name,
    part_saved,
    released,
    renewed,
    started,
    without_saves,
)
from shoal.services.gateway.errors import ApiError
from shoal.services.gateway.file_store import NATS_ERRORS, FileStore
from shoal.shared.bus import CasConflict
from shoal.shared.config import GatewayConfig
from shoal.shared.metrics import Registry
from shoal.shared.openai_batch import BadBatch, BatchLine, Outcome, Sender, read_batch

log = structlog.get_logger(__name__)

POLL_S = 2.0
"""How often a runner looks for batches to claim (a batch made here is claimed at once)."""
PROGRESS_S = 1.0
"""How often a running batch's counts are written (and its cancel noticed)."""
HEARTBEAT_S = LEASE_S / 3
MAX_BATCH_REQUESTS = 50_000
"""OpenAI's limit on one batch's requests (Anthropic's message batches: `MAX_MESSAGE_BATCH_REQUESTS`)."""
MAX_ERRORS_KEPT = 100
"""A batch that failed validation lists at most this many bad lines."""
TIMEOUT_MARGIN_S = 30.0
"""A request's HTTP attempt may run this much past `gateway.request_timeout_s` (the gateway answers first)."""
WRITE_ATTEMPTS = 5
"""A record write NATS did not take is tried again this many times, a second apart, within the lease."""
STORE_ERRORS = (*NATS_ERRORS, CasConflict)
STOP_TIMEOUT_S = 5.0
"""A stopping gateway waits this long for its batches' tasks (they are cancelled: at once, normally)."""
SAVE_TIMEOUT_S = 10.0
"""A save not done within this is given up (its answers wait for the next one): a store that
hangs must not hold up a batch's cancel, expiry or progress."""
STOP_SAVE_TIMEOUT_S = 10.0
"""A stopping gateway saves its batches' answers (all at once) within this."""


class _LostClaim(Exception):
    """Another runner holds the batch now (this one's claim lapsed), or it is gone."""


def self_url(config: GatewayConfig) -> str:
    """This gateway's own address, as its runner reaches it."""
    host = config.host
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.port}"


def self_headers(config: GatewayConfig) -> dict[str, str]:
    """A key this gateway takes (its own; it never leaves this machine), if it needs one."""
    keys = config.api_keys or config.admin_api_keys
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


@dataclass
class _Answers:
    """A running batch's outcomes so far, by line."""

    outcomes: list[Outcome | None]
    counts: BatchRequestCounts = field(default_factory=BatchRequestCounts)
    unsaved: list[int] = field(default_factory=list)
    """The lines answered since the last save."""

    def put(self, index: int, outcome: Outcome, *, saved: bool = False) -> None:
        self.outcomes[index] = outcome
        if _succeeded(outcome):
            self.counts.completed += 1
        else:
            self.counts.failed += 1
        if not saved:
            self.unsaved.append(index)


@dataclass
class _Run:
    """This runner's run of one batch: what a save needs."""

    batch_id: str
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    parts: int = 0
    """Parts this run saved."""
    answers_saved: int = 0
    """Answers in those parts."""
    saved_at: float = 0.0
    failed_at: float = float("-inf")
    """When a save last failed (the next try waits a whole interval)."""
    answers: _Answers | None = None
    """Once its lines are read."""


def _succeeded(outcome: Outcome) -> bool:
    return outcome.status_code is not None and 200 <= outcome.status_code < 300


def _utf8_lines(source: IO[bytes]) -> Iterator[str]:
    """A file's lines, split at ``\\n`` alone (JSON text may hold U+2028 and the like raw)."""
    for raw in source:
        yield raw.decode()


class BatchRunner:
    """Claims and runs batches (see the module doc)."""

    def __init__(self, store: BatchStore, files: FileStore, registry: Registry, *, owner: str, base_url: str,
                 headers: dict[str, str], concurrency: int, max_running: int, request_timeout_s: float,
                 poll_s: float = POLL_S, save_every_s: float = SAVE_EVERY_S,
                 save_every_answers: int = SAVE_EVERY_ANSWERS, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._files = files
        self.owner = owner
        self._base_url = base_url
        self._headers = headers
        self._concurrency = concurrency
        self._max_running = max_running
        self._attempt_timeout_s = request_timeout_s + TIMEOUT_MARGIN_S
        self._poll_s = poll_s
        self._save_every_s = save_every_s
        self._save_every_answers = save_every_answers
        self._clock = clock
        self._running: dict[str, asyncio.Task[None]] = {}
        self._runs: dict[str, _Run] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._requests = registry.counter("shoal_gateway_batch_requests_total",
                                          "Batch API requests answered, by outcome (completed: a 2xx)", ["outcome"])
        self._finished = registry.counter("shoal_gateway_batches_total", "Batch API batches ended, by status",
                                          ["status"])

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._claim_loop(), name="batch-runner")

    def nudge(self) -> None:
        """Look for batches to claim now (one was just made)."""
        self._wake.set()

    async def stop(self) -> None:
        """Stop running, save what this runner's batches answered and let them go (another
        runner sends the rest)."""
        self._stopping = True
        held = list(self._running)  # each task's end takes it out of _running
        runs = dict(self._runs)
        tasks = [task for task in (self._loop_task, *self._running.values()) if task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
            if stuck:
                log.error("batch_runner_not_stopped", tasks=sorted(task.get_name() for task in stuck))
        saves = [self._save(run, run.answers) for batch_id in held
                 if (run := runs.get(batch_id)) is not None and run.answers is not None and run.answers.unsaved]
        if saves:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_SAVE_TIMEOUT_S):
                    await asyncio.gather(*saves, return_exceptions=True)  # each one's failure logged by it
        for batch_id in held:
            with contextlib.suppress(*STORE_ERRORS):
                await self._store.update(batch_id, lambda stored: released(stored, self.owner))

    async def _claim_loop(self) -> None:
        while not self._stopping:  # besides the cancel: a library may turn one into a TimeoutError
            try:
                await self._claim_some()
            except STORE_ERRORS as exc:
                log.warning("batch_claims_failed", error=str(exc))
            except Exception:  # a bug: logged, and the loop goes on (else no batch would run here again)
                log.exception("batch_claims_crashed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_s):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._wake.wait()
            self._wake.clear()

    async def _claim_some(self) -> None:
        now = self._clock()
        for stored in await self._store.active():
            batch_id = stored.batch.id
            if batch_id in self._running or not is_claimable(stored, now):
                continue
            if stored.batch.status == "cancelling" and not stored.saved:  # its runner died, nothing answered kept
                await self._store.update(batch_id, lambda current: _abandon(current, now))
                continue
            if len(self._running) >= self._max_running and stored.batch.status != "cancelling":
                continue  # (a cancelled one only writes its saved answers: no slot needed)
            written = await self._store.update(batch_id, lambda current: claim(current, self.owner, now))
            if written is None or written.value.owner != self.owner:
                continue  # another runner was first
            log.info("batch_claimed", batch_id=batch_id, status=written.value.batch.status)
            task = asyncio.create_task(self._run(written.value), name=f"batch-{batch_id}")
            self._running[batch_id] = task
            task.add_done_callback(functools.partial(self._ended, batch_id))

    def _ended(self, batch_id: str, _: asyncio.Task[None]) -> None:
        self._running.pop(batch_id, None)
        self._wake.set()

    async def _run(self, stored: StoredBatch) -> None:
        batch = stored.batch
        run = self._runs[batch.id] = _Run(batch.id, saved_at=self._clock())
        with structlog.contextvars.bound_contextvars(batch_id=batch.id):
            work = asyncio.create_task(self._work(stored, run))
            heartbeat = asyncio.create_task(self._hold(batch.id, work))
            try:
                await work
            except _LostClaim:
                log.warning("batch_claim_lost", detail="another runner holds it now")
            except (*STORE_ERRORS, ApiError) as exc:
                log.warning("batch_run_interrupted", error=str(exc),
                            detail="its claim lapses and a runner goes on from its saved answers")
            except asyncio.CancelledError:
                if not heartbeat.done():
                    raise  # this runner stops
                log.warning("batch_claim_lost", detail="another runner holds it now")
            except Exception:  # a bug: logged where it happened, the batch left to lapse
                log.exception("batch_run_failed")
            finally:
                heartbeat.cancel()
                self._runs.pop(batch.id, None)

    async def _hold(self, batch_id: str, work: asyncio.Task[None]) -> None:
        """Renew the claim every `HEARTBEAT_S` while `work` runs; stop `work` once it is lost."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._write(batch_id, lambda batch: batch)
            except _LostClaim:
                work.cancel()
                return
            except STORE_ERRORS as exc:  # NATS away past the write's retries: the next beat may do
                log.warning("batch_heartbeat_failed", error=str(exc))

    async def _work(self, stored: StoredBatch, run: _Run) -> None:
        batch = stored.batch
        with tempfile.TemporaryFile() as source:
            lines = await self._lines(batch, source)
        if lines is None:
            return
        answers = await self._saved_answers(stored, lines)
        run.answers = answers
        now = self._clock()
        batch = await self._write(batch.id, lambda b: started(b, now, len(lines)))
        ending = await self._send(batch, lines, answers, run)
        await self._finish(batch.id, lines, answers, ending)

    async def _saved_answers(self, stored: StoredBatch, lines: list[BatchLine]) -> _Answers:
        """The answers earlier runs of the batch saved (batch_saves.py); the rest still to send."""
        answers = _Answers([None] * len(lines))
        missing = 0
        for name in stored.saved_parts:
            data = await self._files.read_object(name)
            if data is None:
                missing += 1
                continue
            for index, outcome in decode_part(data, lines):
                if answers.outcomes[index] is None:
                    answers.put(index, outcome, saved=True)
        if stored.saved:
            log.info("batch_resumed", answered=answers.counts.completed + answers.counts.failed, total=len(lines),
                     parts_missing=missing)
        return answers

    async def _lines(self, batch: Batch, source: IO[bytes]) -> list[BatchLine] | None:
        """The batch's requests; None (the batch marked ``failed``) when its file is not a batch."""
        errors: list[BatchError] = []
        lines: list[BatchLine] = []
        try:
            await self._files.read_into(batch.input_file_id, source, "input_file_id")
            lines = await asyncio.to_thread(read_batch, _utf8_lines(source), batch.endpoint)
        except ApiError as exc:
            if exc.status != 404:
                raise
            errors = [BatchError(code="file_not_found", message=exc.message, param="input_file_id")]
        except UnicodeDecodeError as exc:
            errors = [BatchError(code="invalid_file", message=f"the input file is not UTF-8 text: {exc}")]
        except BadBatch as exc:
            errors = [BatchError(code="invalid_request", message=problem, line=number)
                      for number, problem in exc.problems[:MAX_ERRORS_KEPT]]
        if not errors and not lines:
            errors = [BatchError(code="empty_file", message="the input file has no request")]
        limit = MAX_MESSAGE_BATCH_REQUESTS if batch.endpoint == MESSAGES_ENDPOINT else MAX_BATCH_REQUESTS
        if len(lines) > limit:
            errors = [BatchError(code="too_many_requests",
                                 message=f"{len(lines)} requests; a batch holds at most {limit}")]
        if not errors:
            return lines
        await self._fail(batch.id, errors)
        return None

    async def _fail(self, batch_id: str, errors: list[BatchError]) -> None:
        now = self._clock()
        ended = await self._end(batch_id, lambda b: failed(b, now, errors))
        self._finished.inc(status=ended.status)
        log.info("batch_failed", status=ended.status, errors=len(errors), first=errors[0].message[:200])

    async def _send(self, batch: Batch, lines: list[BatchLine], answers: _Answers, run: _Run) -> str:
        """Every line not answered yet sent (or as many as the batch's window and a cancel
        allowed), into `answers`; how the batch ends: ``completed``, ``cancelled`` or ``expired``."""
        if batch.status == "cancelling":
            return "cancelled"
        pending = (index for index, outcome in enumerate(answers.outcomes) if outcome is None)
        connector = aiohttp.TCPConnector(limit=self._concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            sender = Sender(session, self._base_url, self._headers,
                            max_retry_wait_s=max(0.0, batch.expires_at - self._clock()),
                            timeout_s=self._attempt_timeout_s)

            async def send_lines() -> None:
                for index in pending:
                    outcome = await sender.send(lines[index])
                    answers.put(index, outcome)
                    self._requests.inc(outcome="completed" if _succeeded(outcome) else "failed")

            senders = [asyncio.create_task(send_lines()) for _ in range(self._concurrency)]
            try:
                return await self._watch(batch, len(lines), answers, senders, run)
            finally:
                for task in senders:
                    task.cancel()
                await asyncio.gather(*senders, return_exceptions=True)

    async def _watch(self, batch: Batch, total: int, answers: _Answers, senders: list[asyncio.Task[None]],
                     run: _Run) -> str:
        """Write the counts every `PROGRESS_S`, and save the answers when due, until the senders
        are done (``completed``), the batch is cancelled or its window closes; a sender's error
        is raised."""
        while True:
            done, running = await asyncio.wait(senders, timeout=PROGRESS_S, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
            if not running:
                return "completed"
            counts = structs.replace(answers.counts, total=total)
            current = await self._write(batch.id, functools.partial(structs.replace, request_counts=counts))
            if current.status == "cancelling":
                return "cancelled"
            if self._clock() >= batch.expires_at:
                return "expired"
            now = self._clock()
            if now - run.failed_at >= self._save_every_s and is_save_due(
                    len(answers.unsaved), now - run.saved_at, every_s=self._save_every_s,
                    every_answers=self._save_every_answers):
                try:
                    await self._save(run, answers)
                except STORE_ERRORS:  # kept in memory: the batch goes on, a save is tried again an interval later
                    run.failed_at = self._clock()

    async def _save(self, run: _Run, answers: _Answers) -> None:
        """The answers since the last save, kept as the run's next part (batch_saves.py). A save
        that fails leaves them unsaved and its part deleted; the next save writes that part
        again with them (the record's count of it is idempotent: `part_saved`)."""
        indexes, answers.unsaved = answers.unsaved, []
        part, through = run.parts, run.answers_saved + len(indexes)
        name = part_name(run.batch_id, run.run, part)
        recorded = False
        try:
            async with asyncio.timeout(SAVE_TIMEOUT_S):
                await self._files.put_object(name, encode_part(
                    (index, outcome) for index in indexes if (outcome := answers.outcomes[index]) is not None))
                await self._write_record(run.batch_id, lambda stored, now: part_saved(
                    stored, self.owner, now, run.run, part, through))
            recorded = True
        except (*STORE_ERRORS, _LostClaim) as exc:
            log.warning("batch_answers_not_saved", error=str(exc) or type(exc).__name__, answers=len(indexes))
            raise
        finally:
            if not recorded:
                answers.unsaved = indexes + answers.unsaved
                with contextlib.suppress(*STORE_ERRORS):  # no record names it (or the next save writes it again)
                    await self._files.delete_object(name)
        run.parts, run.answers_saved, run.saved_at = part + 1, through, self._clock()
        log.info("batch_answers_saved", part=part, answers=len(indexes))

    async def _finish(self, batch_id: str, lines: list[BatchLine], answers: _Answers, ending: str) -> None:
        """Write the output and error files, then the batch's end."""
        if ending == "completed":
            now = self._clock()
            current = await self._write(batch_id, lambda b: finalizing(b, now))
            if current.status == "cancelling":
                ending = "cancelled"
        unsent_error = {"code": f"batch_{ending}",
                        "message": f"the batch was {ending} before this request was answered"}
        counts = BatchRequestCounts(total=len(lines))
        with tempfile.TemporaryFile() as output, tempfile.TemporaryFile() as errors:
            for line, outcome in zip(lines, answers.outcomes, strict=True):
                if outcome is None:
                    outcome = Outcome(line.custom_id, None, None, None, error=unsent_error)
                succeeded = _succeeded(outcome)
                (output if succeeded else errors).write(json.dumps(outcome.record()).encode() + b"\n")
                counts.completed += succeeded
                counts.failed += not succeeded
            try:
                output_file = await self._keep(batch_id, "output", output)
                error_file = await self._keep(batch_id, "errors", errors)
            except ApiError as exc:  # the store is full or away
                await self._fail(batch_id, [BatchError(code="output_not_stored", message=exc.message)])
                return
        now = self._clock()
        stamp = {"completed": {"completed_at": int(now)}, "cancelled": {"cancelled_at": int(now)},
                 "expired": {"expired_at": int(now)}}[ending]
        await self._end(batch_id, lambda b: structs.replace(b, status=ending, request_counts=counts,
                                                            output_file_id=output_file, error_file_id=error_file,
                                                            **stamp))
        self._finished.inc(status=ending)
        log.info("batch_ended", status=ending, completed=counts.completed, failed=counts.failed)

    async def _keep(self, batch_id: str, kind: str, spool: IO[bytes]) -> str | None:
        num_bytes = spool.tell()
        if not num_bytes:
            return None
        spool.seek(0)
        kept = await self._files.create(spool, filename=f"{batch_id}_{kind}.jsonl", purpose=OUTPUT_PURPOSE,
                                        num_bytes=num_bytes)
        return kept.id

    async def _end(self, batch_id: str, change: Callable[[Batch], Batch]) -> Batch:
        """`change` (the batch's end) written, the batch let go and its saved parts deleted."""
        parts: list[str] = []

        def end(stored: StoredBatch | None, now: float) -> StoredBatch | None:
            kept = renewed(stored, self.owner, now, change)
            if kept is None:
                return None
            parts[:] = kept.saved_parts
            return released(without_saves(kept, self.owner), self.owner)

        ended = await self._write_record(batch_id, end)
        for name in parts:  # whatever is left the object store forgets after its TTL
            with contextlib.suppress(*STORE_ERRORS):
                await self._files.delete_object(name)
        return ended.batch

    async def _write(self, batch_id: str, change: Callable[[Batch], Batch]) -> Batch:
        """`change` written to the batch, this runner's claim renewed; _LostClaim when another
        runner holds it."""
        stored = await self._write_record(batch_id, lambda current, now: renewed(current, self.owner, now, change))
        return stored.batch

    async def _write_record(self, batch_id: str, mutate: Callable[[StoredBatch | None, float], StoredBatch | None]
                            ) -> StoredBatch:
        """`mutate` (given the record and the time; None: the claim is not this runner's any
        more) written by compare-and-swap; _LostClaim when it declined. A write NATS did not take
        is tried again (`WRITE_ATTEMPTS`)."""
        for attempt in range(1, WRITE_ATTEMPTS + 1):
            try:
                return await self._write_once(batch_id, mutate)
            except STORE_ERRORS as exc:
                if attempt == WRITE_ATTEMPTS:
                    raise
                log.info("batch_write_retrying", attempt=attempt, error=str(exc))
                await asyncio.sleep(1.0)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _write_once(self, batch_id: str, mutate: Callable[[StoredBatch | None, float], StoredBatch | None]
                          ) -> StoredBatch:
        now = self._clock()
        wrote = False

        def apply(stored: StoredBatch | None) -> StoredBatch | None:
            nonlocal wrote
            kept = mutate(stored, now)
            wrote = kept is not None
            return kept

        written = await self._store.update(batch_id, apply)
        if written is None or not wrote:
            raise _LostClaim(batch_id)
        return written.value


def _abandon(stored: StoredBatch | None, now: float) -> StoredBatch | None:
    """A ``cancelling`` batch no runner holds, ended ``cancelled``; None if that changed."""
    if stored is None or stored.batch.status != "cancelling" or not is_claimable(stored, now):
        return None
    return StoredBatch(batch=abandoned(stored.batch, now))
