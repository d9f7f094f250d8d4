"""Runs the Batch API's batches: every gateway runs one `BatchRunner`, which claims batches no
live runner holds (batch_store.py: by compare-and-swap, with a lease), at most
`gateway.max_running_batches` at once, oldest first.

A batch's requests are sent to this gateway's own HTTP edge, as ``shoal run-batch`` sends them
(shared/openai_batch.py): each one goes through the same routes, queues, fairness and limits
as any client's, `gateway.batch_concurrency` at a time, and a 429 or 503 (a full queue, a
model asleep or being placed) is asked again until the batch's window closes: a batch waits
for capacity rather than failing. Every second or so the runner writes the counts and renews
its claim; that write is also where it learns the batch was cancelled (then it stops sending,
drops what is in flight, and writes what was answered). When every request is answered it
writes the output file (2xx answers) and the error file (everything else), in the input's
order, each only if it has a line.

A gateway that stops lets its batches go; one that dies holds them until its claim lapses
(`LEASE_S`). Either way another runner takes them and starts them over (answers not yet in a
file are not kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import nats.errors
import structlog
from msgspec import structs

from shoal.services.gateway.batch_api import (
    OUTPUT_PURPOSE,
    Batch,
    BatchError,
    BatchErrors,
    BatchRequestCounts,
)
from shoal.services.gateway.batch_store import BatchStore, StoredBatch, claim, is_claimable, released, renewed
from shoal.services.gateway.errors import ApiError
from shoal.services.gateway.file_store import FileStore
from shoal.shared.bus import CasConflict
from shoal.shared.config import GatewayConfig
from shoal.shared.metrics import Registry
from shoal.shared.openai_batch import BadBatch, BatchLine, Outcome, Sender, read_batch

log = structlog.get_logger(__name__)

POLL_S = 2.0
"""How often a runner looks for batches to claim (a batch made here is claimed at once)."""
PROGRESS_S = 1.0
"""How often a running batch's counts are written (and its claim renewed, its cancel noticed)."""
MAX_BATCH_REQUESTS = 50_000
"""OpenAI's limit on one batch's requests."""
MAX_ERRORS_KEPT = 100
"""A batch that failed validation lists at most this many bad lines."""
TIMEOUT_MARGIN_S = 30.0
"""A request's HTTP attempt may run this much past `gateway.request_timeout_s` (the gateway answers first)."""


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

    def put(self, index: int, outcome: Outcome) -> None:
        self.outcomes[index] = outcome
        if _succeeded(outcome):
            self.counts.completed += 1
        else:
            self.counts.failed += 1


def _succeeded(outcome: Outcome) -> bool:
    return outcome.status_code is not None and 200 <= outcome.status_code < 300


class BatchRunner:
    """Claims and runs batches (see the module doc)."""

    def __init__(self, store: BatchStore, files: FileStore, registry: Registry, *, owner: str, base_url: str,
                 headers: dict[str, str], concurrency: int, max_running: int, request_timeout_s: float,
                 poll_s: float = POLL_S, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._files = files
        self.owner = owner
        self._base_url = base_url
        self._headers = headers
        self._concurrency = concurrency
        self._max_running = max_running
        self._attempt_timeout_s = request_timeout_s + TIMEOUT_MARGIN_S
        self._poll_s = poll_s
        self._clock = clock
        self._running: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
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
        """Stop running and let this runner's batches go (another runner starts them over)."""
        held = list(self._running)  # each task's end takes it out of _running
        tasks = [task for task in (self._loop_task, *self._running.values()) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for batch_id in held:
            with contextlib.suppress(TimeoutError, nats.errors.Error, CasConflict):
                await self._store.update(batch_id, lambda stored: released(stored, self.owner))

    async def _claim_loop(self) -> None:
        while True:
            try:
                await self._claim_some()
            except (TimeoutError, nats.errors.Error, CasConflict) as exc:
                log.warning("batch_claims_failed", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_s)
            self._wake.clear()

    async def _claim_some(self) -> None:
        if len(self._running) >= self._max_running:
            return
        now = self._clock()
        waiting = [stored for stored in await self._store.all()
                   if is_claimable(stored, now) and stored.batch.id not in self._running]
        for stored in sorted(waiting, key=lambda s: (s.batch.created_at, s.batch.id)):
            if len(self._running) >= self._max_running:
                return
            batch_id = stored.batch.id
            written = await self._store.update(batch_id, lambda current: claim(current, self.owner, now))
            if written is None or written.value.owner != self.owner:
                continue  # another runner was first
            log.info("batch_claimed", batch_id=batch_id, status=written.value.batch.status)
            task = asyncio.create_task(self._run(written.value.batch), name=f"batch-{batch_id}")
            self._running[batch_id] = task
            task.add_done_callback(functools.partial(self._ended, batch_id))

    def _ended(self, batch_id: str, _: asyncio.Task[None]) -> None:
        self._running.pop(batch_id, None)
        self._wake.set()

    async def _run(self, batch: Batch) -> None:
        with structlog.contextvars.bound_contextvars(batch_id=batch.id):
            try:
                lines = await self._lines(batch)
                if lines is None:
                    return
                if batch.status == "validating":
                    batch = await self._write(batch.id, lambda b: structs.replace(
                        b, status="in_progress", in_progress_at=int(self._clock()),
                        request_counts=BatchRequestCounts(total=len(lines))))
                answers, ending = await self._send(batch, lines)
                await self._finish(batch.id, lines, answers, ending)
            except _LostClaim:
                log.warning("batch_claim_lost", detail="another runner holds it now")
            except (TimeoutError, nats.errors.Error, CasConflict, ApiError) as exc:
                log.warning("batch_run_interrupted", error=str(exc),
                            detail="its claim lapses and a runner starts it over")
            except Exception:  # a bug: logged where it happened, the batch left to lapse
                log.exception("batch_run_failed")

    async def _lines(self, batch: Batch) -> list[BatchLine] | None:
        """The batch's requests; None (the batch marked ``failed``) when its file is not a batch."""
        errors: list[BatchError] = []
        lines: list[BatchLine] = []
        try:
            text = (await self._files.read(batch.input_file_id, "input_file_id")).decode()
            lines = read_batch(text.splitlines(), batch.endpoint)
        except ApiError as exc:
            errors = [BatchError(code="file_not_found", message=exc.message, param="input_file_id")]
        except UnicodeDecodeError as exc:
            errors = [BatchError(code="invalid_file", message=f"the input file is not UTF-8 text: {exc}")]
        except BadBatch as exc:
            errors = [BatchError(code="invalid_request", message=problem, line=number)
                      for number, problem in exc.problems[:MAX_ERRORS_KEPT]]
        if not errors and not lines:
            errors = [BatchError(code="empty_file", message="the input file has no request")]
        if len(lines) > MAX_BATCH_REQUESTS:
            errors = [BatchError(code="too_many_requests",
                                 message=f"{len(lines)} requests; a batch holds at most {MAX_BATCH_REQUESTS}")]
        if not errors:
            return lines
        now = int(self._clock())
        await self._write(batch.id, lambda b: structs.replace(b, status="failed", failed_at=now,
                                                              errors=BatchErrors(data=errors)), release=True)
        self._finished.inc(status="failed")
        log.info("batch_failed", errors=len(errors), first=errors[0].message[:200])
        return None

    async def _send(self, batch: Batch, lines: list[BatchLine]) -> tuple[_Answers, str]:
        """Every line sent (or as many as the batch's window and a cancel allowed); the answers
        and how the batch ends: ``completed``, ``cancelled`` or ``expired``."""
        answers = _Answers([None] * len(lines))
        if batch.status == "cancelling":
            return answers, "cancelled"
        pending = iter(range(len(lines)))
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

            senders = asyncio.gather(*(send_lines() for _ in range(self._concurrency)))
            ending = "completed"
            try:
                while not senders.done():
                    await asyncio.wait([senders], timeout=PROGRESS_S)
                    counts = structs.replace(answers.counts, total=len(lines))
                    current = await self._write(batch.id, functools.partial(structs.replace, request_counts=counts))
                    if current.status == "cancelling":
                        ending = "cancelled"
                    elif self._clock() >= batch.expires_at and not senders.done():
                        ending = "expired"
                    if ending != "completed":
                        break
                else:
                    senders.result()
            finally:
                if not senders.done():
                    senders.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await senders
        return answers, ending

    async def _finish(self, batch_id: str, lines: list[BatchLine], answers: _Answers, ending: str) -> None:
        """Write the output and error files, then the batch's end."""
        if ending == "completed":
            await self._write(batch_id, lambda b: structs.replace(b, status="finalizing",
                                                                  finalizing_at=int(self._clock())))
        unsent_error = {"code": f"batch_{ending}", "message": f"the batch was {ending} before this request was "
                                                             "answered"}
        output: list[str] = []
        errors: list[str] = []
        counts = BatchRequestCounts(total=len(lines))
        for line, outcome in zip(lines, answers.outcomes, strict=True):
            if outcome is None:
                outcome = Outcome(line.custom_id, None, None, None, error=unsent_error)
            succeeded = _succeeded(outcome)
            (output if succeeded else errors).append(json.dumps(outcome.record()) + "\n")
            counts.completed += succeeded
            counts.failed += not succeeded
        output_file = await self._keep(batch_id, "output", output)
        error_file = await self._keep(batch_id, "errors", errors)
        now = int(self._clock())

        def ended(batch: Batch) -> Batch:
            stamp = {"completed": {"completed_at": now}, "cancelled": {"cancelled_at": now},
                     "expired": {"expired_at": now}}[ending]
            return structs.replace(batch, status=ending, request_counts=counts, output_file_id=output_file,
                                   error_file_id=error_file, **stamp)

        await self._write(batch_id, ended, release=True)
        self._finished.inc(status=ending)
        log.info("batch_ended", status=ending, completed=counts.completed, failed=counts.failed)

    async def _keep(self, batch_id: str, kind: str, lines: list[str]) -> str | None:
        if not lines:
            return None
        kept = await self._files.create_from_bytes("".join(lines).encode(), filename=f"{batch_id}_{kind}.jsonl",
                                                   purpose=OUTPUT_PURPOSE)
        return kept.id

    async def _write(self, batch_id: str, change: Callable[[Batch], Batch], *, release: bool = False) -> Batch:
        """`change` written to the batch (this runner's claim renewed, or let go); _LostClaim
        when another runner holds it."""
        now = self._clock()
        wrote = False

        def mutate(stored: StoredBatch | None) -> StoredBatch | None:
            nonlocal wrote
            kept = renewed(stored, self.owner, now, change)
            wrote = kept is not None
            return released(kept, self.owner) if release and kept is not None else kept

        written = await self._store.update(batch_id, mutate)
        if written is None or not wrote:
            raise _LostClaim(batch_id)
        return written.value.batch
