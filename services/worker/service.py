"""The worker's NATS loop: pull requests its engine can admit, stream tokens back, ack.

One durable pull consumer per model is shared by all its replicas, so
whichever replica has room takes the next request. The worker fetches only as
many messages as its engine can admit now (the stream, not the worker's
memory, is the queue), sends in-progress acks while generating, acks after the
final message, and terms messages it must never run (malformed, expired,
cancelled). Besides, each replica pulls its own subject: the turns of chat
sessions whose KV it holds, sent to it by the gateways (replica_queue.py).

Failover (docs/reliability.md): when it takes a request, the worker tells the gateway which
replica holds it and the delivery's ack subject (`AttemptNotice` "started"), so a gateway that
sees this replica die NAKs the delivery and the request runs again at once. A request this
worker does not finish (a drain that ran out, a stop, a cancelled task) is handed back with a
NAK and an `AttemptNotice` "handed_back", never answered with an error. The final reply (or an
error) is sent as a request the gateway confirms, retried a few times: a lost final reply would
leave its client waiting. The fetch loop survives any JetStream error (a consumer deleted, a
leader election): it logs it, re-creates the consumer and binds to it again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, cast

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shoal.services.worker.activity import ActivityReporter
from shoal.services.worker.generation import (
    Detokenizer,
    Engine,
    EngineFailed,
    GenerationRequest,
    RequestRejected,
)
from shoal.services.worker.prompts import prompt_chars, prompt_token_ids
from shoal.services.worker.pulling import nak_late_arrivals, pull_arrivals
from shoal.services.worker.replica_queue import ReplicaQueue
from shoal.services.worker.token_bytes import TokenBytes
from shoal.shared import subjects
from shoal.shared.bus import Bus, ensure_model_consumer
from shoal.shared.messages import (
    AttemptNotice,
    ErrorReply,
    ErrorType,
    FinalReply,
    InferenceRequest,
    PromptEcho,
    TokenChunk,
    TokenLogprob,
    cancel_decoder,
    encode_msgpack,
    now,
    request_decoder,
)
from shoal.shared.periodic import sleep_or_stop

log = structlog.get_logger(__name__)

FETCH_TIMEOUT_S = 1.0
"""How long one pull request waits for messages."""
HAND_BACK_DELAY_S = FETCH_TIMEOUT_S + 0.5
"""A dead engine's requests come back to the queue this much later: after this worker's
last pull request has expired, so that it cannot take them again (each delivery counts
toward the stream's `MAX_DELIVERIES`)."""
PAUSED_CHECK_S = 0.25
"""While paused, how often the worker looks for requests delivered after its last fetch."""
CANCEL_MEMORY_S = 900.0
"""How long a cancelled request id is remembered (queued copies are skipped)."""
OFF_LOOP_PROMPT_CHARS = 16_384
"""Prompts longer than this are templated and tokenised in the worker's tokeniser thread: a
prompt of megabytes takes seconds, and the event loop keeps streaming every other request's
tokens meanwhile. Shorter ones stay on the loop (a thread hop costs more than they do)."""
FINAL_CONFIRM_TIMEOUT_S = 1.0
"""How long the worker waits for the gateway to confirm a final or error reply before resending it."""
FINAL_SENDS = 4
"""A final or error reply is sent at most this often (a gateway that never confirms is gone)."""
FETCH_RETRY_S = (0.25, 5.0)
"""After a JetStream error the fetch loop waits this long (doubling) before it binds again."""


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
        vocab_size: int | None = None,
        ack_wait_s: float = 30.0,
        max_fetch: int = 32,
    ) -> None:
        """Args:
        vocab_size: prompt token ids must be below it (the model's embedding rows, when fewer
            than the tokenizer's tokens); None: the tokenizer's size.
        """
        self._bus = bus
        self._engine = engine
        self._tokenizer = tokenizer
        self._identity = identity
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size
        self._token_bytes = TokenBytes(tokenizer)
        # One thread: a tokenizer is not made to be used from several threads at once.
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
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
        self._own_queue = ReplicaQueue(bus.js, identity.model, identity.replica_id, ack_wait_s=ack_wait_s,
                                       max_fetch=max_fetch, start=self._start, is_serving=lambda: self.is_serving,
                                       stopping=self._stopping)
        self._own_queue_task: asyncio.Task[None] | None = None

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    @property
    def is_serving(self) -> bool:
        """Taking new requests (not stopping, no barrier up before a park)."""
        return self._serving.is_set() and not self._stopping.is_set()

    @property
    def engine(self) -> Engine:
        """The engine requests run on now (a restore replaces it)."""
        return self._engine

    async def run(self) -> None:
        """Serve until `stop()`; then finish in-flight requests (see `stop`)."""
        model = self._identity.model
        cancels = await self._bus.nc.subscribe(subjects.cancel_subject(model), cb=self._on_cancel)
        reporting = asyncio.create_task(self._activity.run())
        own_queue = self._own_queue_task = asyncio.create_task(self._own_queue.run())
        ended = "stopped"
        try:
            ended = await self._serve_consumer()
        except BaseException as exc:
            ended = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            log.info("worker_fetch_loop_ended", reason=ended)
            reporting.cancel()
            if not self._stopping.is_set():  # the connection closed: nothing to move it with
                own_queue.cancel()
            await asyncio.gather(own_queue, return_exceptions=True)
            await cancels.unsubscribe()

    async def _serve_consumer(self) -> str:
        """Bind to the model's consumer and fetch until stopped; after any JetStream error
        (consumer deleted, leader election, NATS reconnecting) log it, wait, re-create the
        consumer and bind again. Returns why it ended."""
        js = self._bus.js
        retry_s = FETCH_RETRY_S[0]
        while not self._stopping.is_set():
            try:
                durable = await ensure_model_consumer(js, self._identity.model, ack_wait_s=self._ack_wait_s)
                pull = await js.pull_subscribe_bind(durable=durable, stream=subjects.REQUESTS_STREAM)
            except Exception as exc:
                if self._bus.nc.is_closed:
                    return "the NATS connection closed"
                log.warning("worker_consumer_bind_failed", error=repr(exc), retry_s=retry_s)
                await asyncio.sleep(retry_s)
                retry_s = min(FETCH_RETRY_S[1], retry_s * 2)
                continue
            log.info("worker_serving", consumer=durable)
            try:
                await self._fetch_loop(pull)
                return "stopped"
            except nats.errors.ConnectionClosedError:
                return "the NATS connection closed"
            except Exception as exc:
                log.warning("worker_fetch_failed", error=repr(exc), retry_s=retry_s)
            finally:
                try:
                    await pull.unsubscribe()
                except Exception as exc:  # the subscription may be gone with its connection
                    log.debug("worker_unsubscribe_failed", error=repr(exc))
            await asyncio.sleep(retry_s)
            retry_s = min(FETCH_RETRY_S[1], retry_s * 2)
        return "stopped"

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests; wait up to `drain_timeout_s` for in-flight ones, hand the rest
        back to the queue (see `pause`); turns sent to this replica that it did not start are
        moved to the shared queue (replica_queue.py)."""
        self._stopping.set()
        self._slot_freed.set()
        self._serving.set()
        await self._drain(drain_timeout_s)
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        if self._own_queue_task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._own_queue.done.wait(), timeout=10.0)

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
            if not self._serving.is_set():
                await self._wait_paused(pull)
                continue
            num_free = min(self._engine.num_free_slots(), self._max_fetch)
            if num_free <= 0:
                self._slot_freed.clear()
                try:
                    await asyncio.wait_for(self._slot_freed.wait(), timeout=0.5)
                except TimeoutError:
                    pass
                continue
            async with contextlib.aclosing(pull_arrivals(pull, num_free, FETCH_TIMEOUT_S)) as arrivals:
                async for msg in arrivals:
                    if self._stopping.is_set() or not self._serving.is_set():
                        await msg.nak()  # fetched while the barrier went up: another replica takes it
                        break  # and ask the server for no more
                    self._start(msg)
        await nak_late_arrivals(pull)

    async def _wait_paused(self, pull: JetStreamContext.PullSubscription) -> None:
        """Wait while the barrier is up, handing back what reaches the subscription after its
        last fetch (`nak_late_arrivals`): measured, a drain under load left 5 of the 7 requests
        it handed back waiting 30 s in the paused worker's subscription."""
        while not self._serving.is_set():
            if num_naked := await nak_late_arrivals(pull):
                log.info("late_arrivals_handed_back", num_requests=num_naked)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PAUSED_CHECK_S):
                    await self._serving.wait()

    def _start(self, msg: Msg) -> None:
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
        attempt = request.attempt_offset + (msg.metadata.num_delivered or 1)
        headers = msg.headers or {}
        reply_to = headers.get(subjects.HDR_REPLY_TO) or request.reply_to
        logger = log.bind(request_id=request.request_id, model=request.model, replica=self._identity.replica_id)
        if not subjects.is_reply_subject(reply_to, request.gateway_id, request.request_id):
            # Only a gateway's reply inbox: a forged reply_to (``$KV.shoal_gpus.x``, another
            # service's subject) must not make this worker publish there.
            logger.error("request_reply_to_refused", reply_to=reply_to[:200], gateway=request.gateway_id[:64])
            await msg.term()
            return
        if request.session_id is not None:
            logger = logger.bind(session_id=request.session_id)
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
        await replier.notice("started", ack_subject=msg.reply or "", stream_seq=msg.metadata.sequence.stream)
        ticker = asyncio.create_task(self._keep_in_progress(msg))
        self.last_request_at = now()
        try:
            outcome = await self._generate(request, replier, logger)
        except asyncio.CancelledError:
            # A drain that ran out, a stop, the loop shutting down: never an error to the
            # client, and never a run for nobody. The request goes back to the queue now.
            logger.info("request_handed_back", draining=self._handing_back)
            self.num_requests_by_outcome["handed_back"] += 1
            await asyncio.shield(self._hand_back(msg, replier))
            raise
        finally:
            ticker.cancel()
            self.last_request_at = now()
        self.num_requests_by_outcome[outcome] += 1
        if outcome in ("ok", "cancelled"):
            await msg.ack()
        elif outcome == "handed_back":  # its next attempt runs on another replica (or this one, restarted)
            await self._nak(msg, delay_s=HAND_BACK_DELAY_S)
            await replier.notice("handed_back")
        else:
            await msg.term()

    async def _hand_back(self, msg: Msg, replier: _Replier) -> None:
        await self._nak(msg)
        await replier.notice("handed_back")

    async def _generate(self, request: InferenceRequest, replier: _Replier, logger: structlog.BoundLogger) -> str:
        try:
            token_ids = await self._tokenize(request)
            gen_request = GenerationRequest(
                request_id=request.request_id,
                prompt_token_ids=token_ids,
                params=request.params,
                eos_token_ids=self._eos_token_ids,
                max_model_len=self._max_model_len,
                session_id=request.session_id,
            )
            deadline_guard = asyncio.get_running_loop().call_at(
                asyncio.get_running_loop().time() + max(0.0, request.deadline - now()),
                self._engine.cancel,
                request.request_id,
            )
            echo = self._echo(request, token_ids) if request.params.echo else None
            try:
                async for output in self._engine.generate(gen_request):
                    if output.text or output.logprobs or echo is not None:
                        if echo is not None and output.prompt_logprobs is not None:
                            echo.logprobs = self._token_bytes.to_wire(output.prompt_logprobs) or []
                        await replier.chunk(output.text, output.num_new_tokens, output.token_hash,
                                            self._token_bytes.to_wire(output.logprobs), echo,
                                            prompt_tokens=len(token_ids) if replier.seq == 0 else 0)
                        echo = None
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
            await replier.error(exc.status, str(exc), "invalid_request_error", param=exc.param, code=exc.code)
            return "rejected"
        except asyncio.CancelledError:
            self._engine.cancel(request.request_id)  # handed back by `_handle`
            raise
        except Exception:
            logger.exception("request_failed")
            await replier.error(500, "the replica failed while generating", "server_error")
            return "error"
        logger.error("engine_ended_without_final_output")
        await replier.error(500, "the replica's engine ended without a result", "server_error")
        return "error"

    def _echo(self, request: InferenceRequest, token_ids: list[int]) -> PromptEcho:
        """The prompt as a request's first chunk sends it back (its scores come from the engine):
        its text only when it came as token ids (the gateway echoes a text prompt itself)."""
        text = ""
        if request.prompt is None:
            text = cast(Detokenizer, self._tokenizer).decode(token_ids, skip_special_tokens=True)
        return PromptEcho(text, self._token_bytes.get(token_ids[0]))

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
        await replier.final(output.finish_reason or "stop", output.num_prompt_tokens, output.num_completion_tokens,
                            output.num_cached_tokens, output.embedding, output.stop_reason)
        logger.info(
            "request_done",
            prompt_tokens=output.num_prompt_tokens,
            completion_tokens=output.num_completion_tokens,
            cached_tokens=output.num_cached_tokens,
            finish_reason=output.finish_reason,
        )
        return "ok"

    def served_context(self) -> int:
        """The longest context served now: the model's, or its engine's if smaller (a KV pool or
        attention window can bound it; a rebuilt engine may change it)."""
        return min(self._max_model_len, self._engine.max_model_len)

    async def _tokenize(self, request: InferenceRequest) -> list[int]:
        """The prompt's token ids (cut to what the engine serves, if the request asks to be cut);
        a long prompt is templated and tokenised off the event loop."""
        max_model_len = self.served_context()
        if prompt_chars(request) <= OFF_LOOP_PROMPT_CHARS:
            return prompt_token_ids(self._tokenizer, request, self._vocab_size, max_model_len)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizing, prompt_token_ids,  # type: ignore[arg-type]
                                          self._tokenizer, request, self._vocab_size, max_model_len)

    @staticmethod
    async def _nak(msg: Msg, delay_s: float | None = None) -> None:
        try:
            await msg.nak(delay=delay_s)
        except nats.errors.Error as exc:  # it comes back after ack_wait anyway
            log.warning("hand_back_failed", error=str(exc))

    async def _keep_in_progress(self, msg: Msg) -> None:
        interval = max(1.0, self._ack_wait_s / 3)
        while True:
            await sleep_or_stop(interval)
            try:
                await msg.in_progress()
            except nats.errors.Error as exc:
                log.warning("in_progress_ack_failed", error=str(exc))


_confirming: set[asyncio.Task[None]] = set()
"""Final and error replies still waiting for their gateway's confirmation."""


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

    async def _publish_confirmed(self, payload: bytes) -> None:
        """Send the attempt's last reply; a background task resends it until the gateway
        confirms it (a request to the reply subject), so the message's ack does not wait."""
        if not self.subject:
            return
        task = asyncio.create_task(self._confirm(payload))
        _confirming.add(task)
        task.add_done_callback(_confirming.discard)
        await asyncio.sleep(0)  # let the first send go out before the caller acks

    async def _confirm(self, payload: bytes) -> None:
        for _ in range(FINAL_SENDS):
            try:
                await self.bus.nc.request(self.subject, payload, timeout=FINAL_CONFIRM_TIMEOUT_S)
                return
            except nats.errors.NoRespondersError:
                log.info("reply_nobody_waits", request_id=self.request_id)  # the gateway is gone
                return
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except nats.errors.Error as exc:
                log.warning("reply_publish_failed", request_id=self.request_id, error=str(exc))
                await asyncio.sleep(FINAL_CONFIRM_TIMEOUT_S)
        log.warning("reply_not_confirmed", request_id=self.request_id, sends=FINAL_SENDS)

    async def notice(self, state: Literal["started", "handed_back"], *, ack_subject: str = "",
                     stream_seq: int = 0) -> None:
        message = AttemptNotice(self.request_id, self.attempt, state, self.replica_id, ack_subject, stream_seq)
        await self._publish(encode_msgpack(message))

    async def chunk(self, text: str, num_tokens: int, token_hash: int = 0,
                    logprobs: list[TokenLogprob] | None = None, prompt: PromptEcho | None = None,
                    prompt_tokens: int = 0) -> None:
        message = TokenChunk(self.request_id, self.attempt, self.seq, text, num_tokens, self.replica_id, token_hash,
                             logprobs, prompt, prompt_tokens)
        self.seq += 1
        await self._publish(encode_msgpack(message))

    async def final(self, finish_reason: str, num_prompt: int, num_completion: int, num_cached: int,
                    embedding: bytes | None = None, stop_reason: str | None = None) -> None:
        message = FinalReply(self.request_id, self.attempt, self.seq, finish_reason, num_prompt, num_completion,
                             self.replica_id, num_cached, embedding, stop_reason)
        await self._publish_confirmed(encode_msgpack(message))

    async def error(self, status: int, message: str, error_type: ErrorType, *, param: str | None = None,
                    code: str | None = None) -> None:
        reply = ErrorReply(self.request_id, self.attempt, status, message, error_type, code, self.replica_id, param)
        await self._publish_confirmed(encode_msgpack(reply))
