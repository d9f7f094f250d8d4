"""``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``.

Streaming is decided by the body's ``stream`` field (the `openai` client sends
``Accept: application/json`` for streams too). Streams are Server-Sent Events
ending with ``data: [DONE]``; an error after the stream started is sent as an
``{"error": ...}`` event, which the `openai` client raises as an APIError.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog
from aiohttp import web

from shoal.services.gateway.choices import Choice, expand, merged
from shoal.services.gateway.dispatch import DispatchEvent, Restart
from shoal.services.gateway.errors import ApiError, BadRequest, NotFound, error_payload
from shoal.services.gateway.openai_api import (
    SESSION_HEADER,
    UNLIMITED_MAX_TOKENS,
    Answer,
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionRequest,
    Kind,
    ModelCard,
    ModelList,
    TextLogprobs,
    Usage,
    chat_logprobs,
    chat_messages,
    check_fits_in_message,
    check_num_choices,
    completion_prompts,
    decode_body,
    encoder,
    full_response,
    model_named_in,
    sampling_params,
    session_id_of,
    stream_chunk,
    stream_mode,
    text_logprobs,
    usage,
)
from shoal.services.gateway.progress import WaitProgress
from shoal.services.gateway.request_ids import REQUEST_ID, REQUEST_ID_HEADER
from shoal.services.gateway.sse import SseStream
from shoal.services.gateway.state import GATEWAY, GatewayState
from shoal.shared.messages import FinalReply, InferenceRequest, TokenChunk, TokenLogprob
from shoal.shared.subjects import MAX_MODEL_KEY_CHARS

log = structlog.get_logger(__name__)

routes = web.RouteTableDef()
REPLICA_HEADER = "X-Shoal-Replica"
"""Which replica answered a non-streamed request (debugging, and the replica-spread tests)."""


def _json(payload: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=encoder.encode(payload), status=status, content_type="application/json",
                        headers=headers)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    cards = [_card(spec.key, spec.registered_at, spec.max_model_len) for spec in state.cluster.models.values()]
    return _json(ModelList(sorted(cards, key=lambda c: c.id)))


@routes.get("/v1/models/{model:.+}")
async def get_model(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    model = request.match_info["model"]
    spec = state.cluster.get_model(model)
    if spec is None:
        raise NotFound(f"model {model!r} does not exist", code="model_not_found", param="model")
    return _json(_card(spec.key, spec.registered_at, spec.max_model_len))


def _card(key: str, registered_at: float, max_model_len: int | None) -> ModelCard:
    return ModelCard(id=key, created=int(registered_at), root=key, max_model_len=max_model_len)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def _serve(request: web.Request, kind: Kind) -> web.StreamResponse:
    """Validate, admit, place, dispatch; every request counts in ``shoal_gateway_requests_total``
    (``model`` is empty unless the request named a registered model)."""
    state = request.app[GATEWAY]
    model_label = ""
    outcome = "500"
    started: float | None = None
    try:
        raw = await request.read()
        try:
            body = decode_body(raw, ChatCompletionRequest if kind == "chat" else CompletionRequest)
        except ApiError:
            model_label = _label_for(state, model_named_in(raw))
            raise
        model_label = _label_for(state, body.model)
        choices, stream, include_usage = _choices(state, body, request[REQUEST_ID],
                                                  request.headers.get(SESSION_HEADER))
        for choice in choices:
            check_fits_in_message(choice.request, state.bus.nc.max_payload)
        with contextlib.ExitStack() as admissions:
            for _ in choices:  # each generation counts against the model's queue bound
                admissions.enter_context(state.dispatcher.admitted(body.model))
            started = time.monotonic()
            if stream:
                response, outcome = await _stream(request, state, choices, kind, include_usage)
            else:
                await state.dispatcher.ensure_placed(body.model, choices[0].request.deadline)
                response, outcome = await _collect(state, choices, kind, request[REQUEST_ID]), "ok"
        return response
    except ApiError as exc:
        outcome = str(exc.status)
        raise
    except asyncio.CancelledError:
        outcome = "cancelled"  # the client went away
        raise
    finally:
        state.requests_total.inc(model=model_label, kind=kind, outcome=outcome)
        if started is not None:
            state.latency.observe(time.monotonic() - started, model=model_label)


def _label_for(state: GatewayState, model: str | None) -> str:
    """Bind `model` for logging; return it as a metrics label only if it is registered (clients
    must not be able to mint label values)."""
    if model is None:
        return ""
    structlog.contextvars.bind_contextvars(model=model[:MAX_MODEL_KEY_CHARS])  # a body may send megabytes
    return model if state.cluster.get_model(model) is not None else ""


def _choices(state: GatewayState, body: ChatCompletionRequest | CompletionRequest, request_id: str,
             session_header: str | None) -> tuple[list[Choice], bool, bool]:
    """The generations to publish (choices.py), whether to stream, whether to send usage (400
    for what is invalid)."""
    prompts: list[dict[str, Any]]
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, max_tokens, UNLIMITED_MAX_TOKENS)
        prompts = [{"messages": chat_messages(body, state.config.max_prompt_chars)}]
    else:
        params = sampling_params(body, body.max_tokens, 16)
        prompts = completion_prompts(body, state.config.max_prompt_chars)
    n = body.n or 1
    check_num_choices(n, len(prompts))
    stream, include_usage = stream_mode(body)
    session_id = session_id_of(body, session_header)
    if session_id is not None:
        if len(prompts) > 1:
            raise BadRequest("a session is one conversation: send one prompt with session_id", param="session_id")
        structlog.contextvars.bind_contextvars(session_id=session_id)
    created = time.time()
    inference = InferenceRequest(
        request_id=request_id,
        model=body.model,
        params=params,
        deadline=created + state.config.request_timeout_s,
        reply_to=state.router.reply_subject(request_id),
        stream=stream,
        gateway_id=state.router.gateway_id,
        created=created,
        session_id=session_id,
    )
    return expand(inference, prompts, n, state.router.reply_subject), stream, include_usage


def _choices_usage(choices: list[Choice], finals: Sequence[FinalReply | None]) -> Usage:
    """Each prompt's tokens once (as OpenAI counts ``n > 1``), every choice's completion tokens."""
    ended = [final for final in finals if final is not None]
    assert len(ended) == len(choices), "every choice ends with its final reply"
    prompt_tokens = sum(final.prompt_tokens for choice, final in zip(choices, ended, strict=True)
                        if choice.counts_prompt)
    return usage(prompt_tokens, sum(final.completion_tokens for final in ended))


@contextlib.asynccontextmanager
async def _generating(state: GatewayState, choices: list[Choice], *, restartable: bool
                      ) -> AsyncIterator[AsyncIterator[tuple[int, DispatchEvent]]]:
    """Every choice's dispatcher events as they come, each with its choice's index; on
    leaving, every choice still running is cancelled."""
    runs = [state.dispatcher.run(choice.request, restartable=restartable) for choice in choices]
    events = merged(runs)
    async with contextlib.AsyncExitStack() as closing:
        for run in runs:
            closing.push_async_callback(run.aclose)
        closing.push_async_callback(events.aclose)  # first: it stops the tasks reading the runs
        yield events


class _Collected:
    """One choice's answer as its events come (a non-streamed response)."""

    def __init__(self, wants_logprobs: bool) -> None:
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprob] | None = [] if wants_logprobs else None
        self.final: FinalReply | None = None

    def add(self, event: DispatchEvent) -> None:
        match event:
            case Restart():
                self.parts.clear()
                if self.logprobs is not None:
                    self.logprobs.clear()
            case TokenChunk(text=text):
                self.parts.append(text)
                if self.logprobs is not None:
                    self.logprobs += event.logprobs or ()
            case FinalReply():
                self.final = event

    def ended(self) -> FinalReply:
        assert self.final is not None, "dispatcher ended without a final reply or an error"
        return self.final

    def answer(self) -> Answer:
        return Answer("".join(self.parts), self.ended().finish_reason, self.logprobs)


async def _collect(state: GatewayState, choices: list[Choice], kind: Kind, request_id: str) -> web.Response:
    first = choices[0].request
    collected = [_Collected(first.params.logprobs is not None) for _ in choices]
    async with _generating(state, choices, restartable=True) as events:
        async for index, event in events:
            collected[index].add(event)
    body = full_response(kind, _response_id(kind, request_id), int(first.created), first.model,
                         [c.answer() for c in collected], _choices_usage(choices, [c.ended() for c in collected]))
    return _json(body, headers={REPLICA_HEADER: collected[0].ended().replica_id})  # X-Request-Id: request_id_middleware


def _response_id(kind: Kind, request_id: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


async def _stream(request: web.Request, state: GatewayState, choices: list[Choice], kind: Kind,
                  include_usage: bool) -> tuple[web.StreamResponse, str]:
    """The SSE response and its outcome: "ok", or the status of an error sent in the stream
    after the 200 (504 at the deadline, 503 when the replica died). Several choices stream
    interleaved, each chunk naming its choice's index.

    While it waits (placement, a cold start, a replica restarting) the stream gets a comment
    line every `gateway.stream_keepalive_s` saying what it waits for (sse.py)."""
    request_id = request[REQUEST_ID]
    response_id = _response_id(kind, request_id)
    first = choices[0].request
    created, model = int(first.created), first.model
    progress = WaitProgress(state.cluster, model)
    sse = SseStream(request, keepalive_s=state.config.stream_keepalive_s, describe=progress.describe,
                    headers={REQUEST_ID_HEADER: request_id})
    finals: list[FinalReply | None] = [None] * len(choices)
    chunk_logprobs = _ChunkLogprobs(kind, len(choices)) if first.params.logprobs is not None else None
    outcome = "ok"
    async with _generating(state, choices, restartable=False) as events, sse.keeping_alive():
        try:
            await state.dispatcher.ensure_placed(model, first.deadline)
            progress.stage = "queued"
            index, event = await anext(events)
            progress.stage = "generating"
            if kind == "chat":
                for choice in choices:
                    await sse.send(stream_chunk(kind, response_id, created, model, index=choice.index, text="",
                                                role=True))
            while True:
                match event:
                    case TokenChunk(text=text):
                        logprobs = None if chunk_logprobs is None else chunk_logprobs.of(index, event)
                        await sse.send(stream_chunk(kind, response_id, created, model, index=index, text=text,
                                                    logprobs=logprobs))
                    case FinalReply():
                        finals[index] = event
                        await sse.send(stream_chunk(kind, response_id, created, model, index=index,
                                                    finish_reason=event.finish_reason,
                                                    text="" if kind == "completion" else None))
                try:
                    index, event = await anext(events)
                except StopAsyncIteration:
                    break
            if include_usage:
                token_usage = _choices_usage(choices, finals)
                await sse.send(stream_chunk(kind, response_id, created, model, token_usage=token_usage,
                                            usage_only=True))
        except ApiError as exc:
            # Errors before anything was sent (unknown model in the worker, prompt too long...)
            # keep their proper status; after that they become the stream's last event.
            if not await sse.commit_or_give_up():
                raise
            log.info("stream_error", status=exc.status, error=exc.message)
            outcome = str(exc.status)
            await sse.send(error_payload(exc))
        await sse.done()
    return sse.response, outcome


class _ChunkLogprobs:
    """The ``logprobs`` of each streamed chunk; a completion's token offsets run on from the
    choice's previous chunks."""

    def __init__(self, kind: Kind, num_choices: int) -> None:
        self._kind = kind
        self._offsets = [0] * num_choices

    def of(self, index: int, chunk: TokenChunk) -> ChatLogprobs | TextLogprobs:
        entries = chunk.logprobs or []
        if self._kind == "chat":
            return chat_logprobs(entries)
        logprobs = text_logprobs(entries, self._offsets[index])
        self._offsets[index] += sum(len(token) for token in logprobs.tokens)
        return logprobs
