"""The worker's NATS loop: pull requests its engine can admit, stream tokens back, ack.

One durable pull consumer per model is shared by all its replicas, so
whichever replica has room takes the next request. The worker fetches only as
many messages as its engine can admit now (the stream, not the worker's
memory, is the queue), sends in-progress acks while generating, acks after the
final message, and terms messages it must never run (malformed, expired,
cancelled).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shoal.services.worker.activity import ActivityReporter
from shoal.services.worker.generation import Engine, EngineFailed, GenerationRequest, RequestRejected
from shoal.services.worker.prompts import prompt_token_ids
from shoal.shared import subjects
from shoal.shared.bus import Bus, ensure_model_consumer
from shoal.shared.messages import (
    ErrorReply,
    ErrorType,
    FinalReply,
    InferenceRequest,
    TokenChunk,
    cancel_decoder,
    encode_msgpack,
    now,
    request_decoder,
)

log = structlog.get_logger(__name__)

FETCH_TIMEOUT_S = 1.0
"""How long one pull request waits for messages."""
HAND_BACK_DELAY_S = FETCH_TIMEOUT_S + 0.5
"""A dead engine's requests come back to the queue this much later: after this worker's
last pull request has expired, so that it cannot take them again (each delivery counts
toward the stream's `MAX_DELIVERIES`)."""
CANCEL_MEMORY_S = 900.0
"""How long a cancelled request id is remembered (queued copies are skipped)."""


@dataclass
class WorkerIdentity:
    model: str
    replica_id: str
    node_id: str


@dataclass
class _Cancelled:
    """Request ids cancelled recently, forgotten after CANCEL_MEMORY_S."""

    clock: Callable[[], float] = time.monotonic
    _expiry: dict[str, float] = field(default_factory=dict)

    def add(self, request_id: str) -> None:
        self._expiry[request_id] = self.clock() + CANCEL_MEMORY_S
        if len(self._expiry) > 10_000:
            cutoff = self.clock()
            self._expiry = {k: v for k, v in self._expiry.items() if v > cutoff}

    def __contains__(self, request_id: str) -> bool:
        expiry = self._expiry.get(request_id)
        return expiry is not None and expiry > self.clock()


class WorkerService:
    """Serves one replica: see the module doc."""

    def __init__(
        self,
        bus: Bus,
        engine: Engine,
        tokenizer: object,
        identity: WorkerIdentity,
        *,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        ack_wait_s: float = 30.0,
        max_fetch: int = 32,
    ) -> None:
        self._bus = bus
        self._engine = engine
        self._tokenizer = tokenizer
        self._identity = identity
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self._ack_wait_s = ack_wait_s
        self._max_fetch = max_fetch
        self._cancelled = _Cancelled()
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._serving = asyncio.Event()
        self._serving.set()
        self.num_requests_by_outcome: collections.Counter[str] = collections.Counter()
        """Requests this replica finished, by outcome (ok, cancelled, rejected, error, expired,
        handed_back)."""
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.last_request_at = 0.0
        """When a request last started or finished here (unix time; 0: never)."""
        self._handing_back = False
        self.failure: EngineFailed | None = None
        """What ended the engine (a CUDA error that poisoned its context); None while it serves."""
        self.failed = asyncio.Event()
        """Set with `failure`: the worker must exit (its node agent starts a new one)."""
        self._activity = ActivityReporter(bus, identity.model, identity.replica_id,
                                          lambda: (self.last_request_at, len(self._tasks)))

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    @property
    def is_serving(self) -> bool:
        """Taking new requests (not stopping, no barrier up before a park)."""
        return self._serving.is_set() and not self._stopping.is_set()

    async def run(self) -> None:
        """Serve until `stop()`; then finish in-flight requests (see `stop`)."""
        js = self._bus.js
        model = self._identity.model
        durable = await ensure_model_consumer(js, model, ack_wait_s=self._ack_wait_s)
        pull = await js.pull_subscribe_bind(durable=durable, stream=subjects.REQUESTS_STREAM)
        cancels = await self._bus.nc.subscribe(subjects.cancel_subject(model), cb=self._on_cancel)
        reporting = asyncio.create_task(self._activity.run())
        log.info("worker_serving", consumer=durable)
        try:
            await self._fetch_loop(pull)
        finally:
            reporting.cancel()
            await pull.unsubscribe()
            await cancels.unsubscribe()

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests; wait up to `drain_timeout_s` for in-flight ones, hand the rest
        back to the queue (see `pause`)."""
        self._stopping.set()
        self._slot_freed.set()
        self._serving.set()
        await self._drain(drain_timeout_s)

    async def pause(self, drain_timeout_s: float = 30.0) -> None:
        """The barrier before sleep: take no new requests (they wait in the stream for
        another replica or for this one's return), let in-flight ones finish for up to
        `drain_timeout_s`, then hand what is left back to the queue: no error goes to its
        client; another replica (or this one, after its wake) runs it again, and the gateway
        restarts or resumes it (a stream that can be neither ends with a clear error)."""
        self._serving.clear()
        await self._drain(drain_timeout_s)

    def resume(self, engine: Engine) -> None:
        """Serve again, with `engine` (rebuilt for the replica's new allocation)."""
        self._engine = engine
        self._serving.set()

    async def _drain(self, timeout_s: float) -> None:
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=timeout_s)
            self._handing_back = True
            try:
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=5.0)
            finally:
                self._handing_back = False
        await self._activity.flush()

    async def _fetch_loop(self, pull: JetStreamContext.PullSubscription) -> None:
        while not self._stopping.is_set():
            await self._serving.wait()
            if self._stopping.is_set():
                return
            num_free = min(self._engine.num_free_slots(), self._max_fetch)
            if num_free <= 0:
                self._slot_freed.clear()
                try:
                    await asyncio.wait_for(self._slot_freed.wait(), timeout=0.5)
                except TimeoutError:
                    pass
                continue
            try:
                msgs = await pull.fetch(batch=num_free, timeout=FETCH_TIMEOUT_S)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except nats.errors.ConnectionClosedError:
                return
            for msg in msgs:
                if self._stopping.is_set() or not self._serving.is_set():
                    await msg.nak()  # fetched while the barrier went up: another replica takes it
                    continue
                task = asyncio.create_task(self._handle(msg))
                self._tasks.add(task)
                task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slot_freed.set()

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = cancel_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.error("cancel_malformed", error=str(exc))
            return
        self._cancelled.add(cancel.request_id)
        if self._engine.cancel(cancel.request_id):
            log.info("request_cancelled", request_id=cancel.request_id, reason=cancel.reason)

    async def _handle(self, msg: Msg) -> None:
        try:
            request = request_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.error("request_malformed", error=str(exc), subject=msg.subject)
            await msg.term()
            return
        attempt = msg.metadata.num_delivered or 1
        headers = msg.headers or {}
        reply_to = headers.get(subjects.HDR_REPLY_TO) or request.reply_to
        logger = log.bind(request_id=request.request_id, model=request.model, replica=self._identity.replica_id)
        replier = _Replier(self._bus, reply_to, request.request_id, attempt, self._identity.replica_id)
        if request.request_id in self._cancelled:
            logger.info("request_skipped_cancelled")
            await msg.term()
            return
        if request.deadline <= now():
            logger.info("request_expired_in_queue")
            await replier.error(504, "the request's deadline passed before a replica could start it", "timeout")
            await msg.term()
            return
        ticker = asyncio.create_task(self._keep_in_progress(msg))
        self.last_request_at = now()
        try:
            outcome = await self._generate(request, replier, logger)
        except asyncio.CancelledError:
            if self._handing_back:
                logger.info("request_handed_back")
                self.num_requests_by_outcome["handed_back"] += 1
                await asyncio.shield(self._nak(msg))
            raise
        finally:
            ticker.cancel()
            self.last_request_at = now()
        self.num_requests_by_outcome[outcome] += 1
        if outcome in ("ok", "cancelled"):
            await msg.ack()
        elif outcome == "handed_back":  # its next attempt runs on another replica (or this one, restarted)
            await self._nak(msg, delay_s=HAND_BACK_DELAY_S)
        else:
            await msg.term()

    async def _generate(self, request: InferenceRequest, replier: _Replier, logger: structlog.BoundLogger) -> str:
        try:
            token_ids = prompt_token_ids(self._tokenizer, request)  # type: ignore[arg-type]
            gen_request = GenerationRequest(
                request_id=request.request_id,
                prompt_token_ids=token_ids,
                params=request.params,
                eos_token_ids=self._eos_token_ids,
                max_model_len=self._max_model_len,
            )
            deadline_guard = asyncio.get_running_loop().call_at(
                asyncio.get_running_loop().time() + max(0.0, request.deadline - now()),
                self._engine.cancel,
                request.request_id,
            )
            try:
                async for output in self._engine.generate(gen_request):
                    if output.text:
                        await replier.chunk(output.text, output.num_new_tokens)
                    if output.finished:
                        return await self._finish(request, replier, output, logger)
            finally:
                deadline_guard.cancel()
        except EngineFailed as exc:
            logger.error("request_handed_back_engine_failed", error=str(exc))
            self._on_engine_failed(exc)
            return "handed_back"
        except RequestRejected as exc:
            logger.info("request_rejected", status=exc.status, error=str(exc))
            await replier.error(exc.status, str(exc), "invalid_request_error", param=exc.param)
            return "rejected"
        except asyncio.CancelledError:
            self._engine.cancel(request.request_id)
            if not self._handing_back:
                await replier.error(503, "the replica stopped before the request finished", "unavailable")
            raise
        except Exception:
            logger.exception("request_failed")
            await replier.error(500, "the replica failed while generating", "server_error")
            return "error"
        logger.error("engine_ended_without_final_output")
        await replier.error(500, "the replica's engine ended without a result", "server_error")
        return "error"

    def _on_engine_failed(self, exc: EngineFailed) -> None:
        """The engine died: take nothing more (fetched messages go back), tell the worker."""
        if self.failure is None:
            self.failure = exc
            self._serving.clear()
            self.failed.set()

    async def _finish(self, request: InferenceRequest, replier: _Replier, output, logger) -> str:  # type: ignore[no-untyped-def]
        self.num_generated_tokens += output.num_completion_tokens
        self.num_prompt_tokens += output.num_prompt_tokens
        if output.finish_reason == "error":
            logger.error("generation_error", error=output.error)
            await replier.error(500, "the replica failed while generating", "server_error")
            return "error"
        if output.finish_reason == "cancelled":
            if request.deadline <= now():
                await replier.error(504, "the request's deadline passed while generating", "timeout")
                return "expired"
            return "cancelled"
        await replier.final(output.finish_reason or "stop", output.num_prompt_tokens, output.num_completion_tokens)
        logger.info(
            "request_done",
            prompt_tokens=output.num_prompt_tokens,
            completion_tokens=output.num_completion_tokens,
            finish_reason=output.finish_reason,
        )
        return "ok"

    @staticmethod
    async def _nak(msg: Msg, delay_s: float | None = None) -> None:
        try:
            await msg.nak(delay=delay_s)
        except nats.errors.Error as exc:  # it comes back after ack_wait anyway
            log.warning("hand_back_failed", error=str(exc))

    async def _keep_in_progress(self, msg: Msg) -> None:
        interval = max(1.0, self._ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            try:
                await msg.in_progress()
            except nats.errors.Error as exc:
                log.warning("in_progress_ack_failed", error=str(exc))


@dataclass
class _Replier:
    """Publishes one attempt's chunks, final reply or error to the request's reply subject."""

    bus: Bus
    subject: str
    request_id: str
    attempt: int
    replica_id: str
    seq: int = 0

    async def _publish(self, payload: bytes) -> None:
        if not self.subject:
            return
        try:
            await self.bus.nc.publish(self.subject, payload)
        except nats.errors.Error as exc:
            log.warning("reply_publish_failed", request_id=self.request_id, error=str(exc))

    async def chunk(self, text: str, num_tokens: int) -> None:
        message = TokenChunk(self.request_id, self.attempt, self.seq, text, num_tokens, self.replica_id)
        self.seq += 1
        await self._publish(encode_msgpack(message))

    async def final(self, finish_reason: str, num_prompt: int, num_completion: int) -> None:
        message = FinalReply(
            self.request_id, self.attempt, self.seq, finish_reason, num_prompt, num_completion, self.replica_id
        )
        await self._publish(encode_msgpack(message))

    async def error(self, status: int, message: str, error_type: ErrorType, *, param: str | None = None) -> None:
        reply = ErrorReply(
            self.request_id, self.attempt, status, message, error_type, None, self.replica_id, param
        )
        await self._publish(encode_msgpack(reply))
