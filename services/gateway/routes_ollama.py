"""Ollama's generation API: ``/api/chat``, ``/api/generate``, ``/api/embed`` and the older
``/api/embeddings``, so Ollama's clients (its Python and JS libraries, Open WebUI, LangChain's
``ChatOllama``) work against Shoal as they do against ``ollama serve``.

Each request is validated into the OpenAI request of the same meaning (ollama_api.py) and
planned, admitted, placed and generated exactly as one sent to ``/v1`` (plans.py): the same
queue bounds, fair wakes, sessions-free prefix cache, reasoning and tool-call readers. Answers
stream (Ollama's default) as JSON lines, the last one ``done`` with the counts and durations;
an error after the first line is a last line ``{"error": ...}``.

A request with nothing to generate (no messages, an empty prompt) loads the model: it answers
once a replica serves (``done_reason: "load"``); with ``keep_alive: 0`` it unloads it
instead (every replica sleeps, as an idle one does; an admin action where keys are set).
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec
import structlog
from aiohttp import web

from shoal.services.gateway.answer_reader import Read
from shoal.services.gateway.auth import may_use_admin, presented_key
from shoal.services.gateway.embeddings_api import embedding_floats
from shoal.services.gateway.errors import ApiError, Forbidden, OllamaError, Unavailable, request_outcome
from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.ndjson import NdjsonStream
from shoal.services.gateway.ollama_api import (
    ChatReply,
    ChatRequest,
    EmbeddingReply,
    EmbeddingsRequest,
    EmbedReply,
    EmbedRequest,
    GenerateReply,
    GenerateRequest,
    OutFunction,
    OutMessage,
    OutToolCall,
    chat_request,
    embed_request,
    generate_request,
    keep_alive_s,
    stop_strings,
)
from shoal.services.gateway.openai_api import Answer, ToolCallOut, chat_logprobs
from shoal.services.gateway.plans import (
    Collected,
    Plan,
    admitted,
    embed_all,
    embedding_plans,
    generating,
    plan_request,
    with_params,
)
from shoal.services.gateway.request_ids import REPLICA_HEADER, REQUEST_ID, REQUEST_ID_HEADER
from shoal.services.gateway.service_calls import ask_scheduler
from shoal.services.gateway.state import GATEWAY, GatewayState
from shoal.services.gateway.tally import tallied
from shoal.shared.messages import EvictReplicas, FinalReply, ModelSpec, TokenChunk, TokenLogprob

log = structlog.get_logger(__name__)

routes = web.RouteTableDef()
Api = Literal["chat", "generate"]
LATEST_TAG = ":latest"


@routes.post("/api/chat")
async def chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


@routes.post("/api/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "generate")


@routes.post("/api/embed")
async def embed(request: web.Request) -> web.Response:
    return await _embed(request, EmbedRequest)


@routes.post("/api/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    return await _embed(request, EmbeddingsRequest)


def _now() -> str:
    """Ollama's ``created_at``: RFC 3339, UTC."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


class _Clock:
    """An answer's durations, as Ollama reports them (ollama_api._Reply)."""

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._placed: float | None = None
        self._first_token: float | None = None

    def placed(self) -> None:
        self._placed = time.monotonic()

    def token(self) -> None:
        if self._first_token is None:
            self._first_token = time.monotonic()

    def load_ns(self) -> int:
        return _ns((self._placed or self._started) - self._started)

    def total_ns(self) -> int:
        return _ns(time.monotonic() - self._started)

    def timings(self, final: FinalReply) -> dict[str, int]:
        end = time.monotonic()
        placed = self._placed or self._started
        first = self._first_token or end
        return {"total_duration": _ns(end - self._started), "load_duration": _ns(placed - self._started),
                "prompt_eval_count": final.prompt_tokens, "prompt_eval_duration": _ns(first - placed),
                "eval_count": final.completion_tokens, "eval_duration": _ns(end - first)}


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _done_reason(finish_reason: str) -> str:
    return "stop" if finish_reason == "tool_calls" else finish_reason  # Ollama's answer with calls "stops"


def _calls(calls: list[ToolCallOut], first_index: int = 0) -> list[OutToolCall] | None:
    """Calls in Ollama's form, numbered from `first_index` within their answer: arguments are
    always a JSON object (Ollama's clients validate it as one); what a model wrote that is not
    one is kept whole, as ``{"arguments": <its text>}``."""
    out = [OutToolCall(OutFunction(call.function.name, call.arguments_object(), index), call.id)
           for index, call in enumerate(calls, first_index)]
    return out or None


class _Replies:
    """One answer's lines (streamed) or whole reply: chat's messages or generate's responses."""

    def __init__(self, api: Api, model: str) -> None:
        self._api = api
        self._model = model
        self._num_calls = 0

    def _reply(self, read: Read, logprobs: list[TokenLogprob] | None, **fields: Any) -> ChatReply | GenerateReply:
        head = {"model": self._model, "created_at": _now(),
                "logprobs": chat_logprobs(logprobs).content if logprobs is not None else None, **fields}
        if self._api == "chat":
            message = OutMessage(role="assistant", content=read.content, thinking=read.reasoning or None,
                                 tool_calls=_calls(read.calls, self._num_calls))
            self._num_calls += len(read.calls)
            return ChatReply(**head, message=message)
        return GenerateReply(**head, response=read.content, thinking=read.reasoning or None)

    def line(self, read: Read, logprobs: list[TokenLogprob] | None) -> ChatReply | GenerateReply | None:
        """A streamed line of what was read; None when there is nothing to say."""
        if not (read.content or read.reasoning or read.calls or logprobs):
            return None
        return self._reply(read, logprobs, done=False)

    def last(self, finish_reason: str, final: FinalReply, clock: _Clock) -> ChatReply | GenerateReply:
        return self._reply(Read(), None, done=True, done_reason=_done_reason(finish_reason), **clock.timings(final))

    def whole(self, answer: Answer, final: FinalReply, clock: _Clock) -> ChatReply | GenerateReply:
        read = Read(answer.reasoning or "", answer.text, answer.tool_calls or [])
        return self._reply(read, answer.logprobs, done=True, done_reason=_done_reason(answer.finish_reason),
                           **clock.timings(final))

    def loaded(self, reason: Literal["load", "unload"]) -> ChatReply | GenerateReply:
        return self._reply(Read(), None, done=True, done_reason=reason)


async def _generate(request: web.Request, api: Api) -> web.StreamResponse:
    state = request.app[GATEWAY]
    with tallied(state, f"ollama_{api}") as tally:
        body: ChatRequest | GenerateRequest = tally.decode(await request.read(),
                                                          ChatRequest if api == "chat" else GenerateRequest)
        replies = _Replies(api, body.model)
        spec = served_model(state, body.model)
        body = msgspec.structs.replace(body, model=spec.key)
        tally.name_model(spec.key)  # "name:latest" counts as its model
        keep_alive = keep_alive_s(body.keep_alive)
        if not (body.messages if isinstance(body, ChatRequest) else body.prompt):
            response = await _load_or_unload(request, state, body.model, keep_alive, replies)
            tally.outcome = "ok"
            return response
        openai_body = (chat_request(body, spec.reasoning_parser) if isinstance(body, ChatRequest)
                       else generate_request(body, spec.reasoning_parser))
        plan = with_params(plan_request(state, openai_body, request[REQUEST_ID], None, format_param="format"),
                            stop=stop_strings(body.options),
                            fit_context=body.truncate is not False)
        with admitted(state, plan):
            tally.start()
            if plan.stream:
                stream, tally.outcome = await _stream(request, state, plan, replies)
                return stream
            whole = await _whole(state, plan, replies)
            tally.outcome = "ok"
            return whole


async def _load_or_unload(request: web.Request, state: GatewayState, model: str, keep_alive: float | None,
                          replies: _Replies) -> web.Response:
    if keep_alive == 0:
        if not may_use_admin(state.config, presented_key(request.headers, state.config.admin_api_keys)):
            raise Forbidden("unloading a model (keep_alive 0) puts it to sleep for everyone: it needs an admin key")
        reply = await ask_scheduler(state.bus, "evict", EvictReplicas(model), timeout_s=120.0)
        if not reply.ok:
            raise Unavailable(f"{model!r} could not be unloaded now: {reply.message}",
                              retry_after_s=reply.retry_after_s or 1.0)
        log.info("model_unloaded", via="keep_alive 0")
        return json_response(replies.loaded("unload"))
    await state.dispatcher.serving_replica(model, time.time() + state.config.request_timeout_s)
    return json_response(replies.loaded("load"))


async def _whole(state: GatewayState, plan: Plan, replies: _Replies) -> web.Response:
    first = plan.choices[0].request
    collected = Collected(plan.choices[0], plan.answer_reader())
    clock = _Clock()
    await state.dispatcher.ensure_placed(first.model, first.deadline)
    clock.placed()
    async with generating(state, plan.choices, restartable=True) as events:
        async for _, event in events:
            if isinstance(event, TokenChunk):
                clock.token()
            collected.add(event)
    final = collected.ended()
    return json_response(replies.whole(collected.answer(), final, clock), headers={REPLICA_HEADER: final.replica_id})


async def _stream(request: web.Request, state: GatewayState, plan: Plan, replies: _Replies
                  ) -> tuple[web.StreamResponse, str]:
    """The streamed answer and its outcome ("ok", or the status of an error sent as its last line)."""
    first = plan.choices[0].request
    lines = NdjsonStream(request, headers={REQUEST_ID_HEADER: request[REQUEST_ID]})
    reader = plan.answer_reader()
    clock = _Clock()
    outcome = "ok"
    async with generating(state, plan.choices, restartable=False) as events:
        try:
            await state.dispatcher.ensure_placed(first.model, first.deadline)
            clock.placed()
            final: FinalReply | None = None
            async for _, event in events:
                if isinstance(event, TokenChunk):
                    clock.token()
                    read = reader.feed(event.text, event.num_tokens)
                    line = replies.line(read, event.logprobs if first.params.logprobs is not None else None)
                    if line is not None:
                        await lines.send(line)
                elif isinstance(event, FinalReply):
                    final = event
            assert final is not None, "a generation ends with its final reply or an error"
            read, finish_reason = reader.finish(final.finish_reason)
            rest = replies.line(read, None)
            if rest is not None:
                await lines.send(rest)
            await lines.send(replies.last(finish_reason, final, clock))
        except ApiError as exc:
            if not lines.committed:
                raise  # nothing sent yet: the error's own status
            log.info("stream_error", status=exc.status, error=exc.message)
            outcome = request_outcome(exc)
            await lines.send(OllamaError(exc.message))
    await lines.close()
    return lines.response, outcome


async def _embed(request: web.Request, schema: type[EmbedRequest] | type[EmbeddingsRequest]) -> web.Response:
    state = request.app[GATEWAY]
    with tallied(state, "ollama_embed") as tally:
        body: EmbedRequest | EmbeddingsRequest = tally.decode(await request.read(), schema)
        name = body.model
        body = msgspec.structs.replace(body, model=served_model(state, body.model).key)
        tally.name_model(body.model)
        keep_alive_s(body.keep_alive)
        clock = _Clock()
        deadline = time.time() + state.config.request_timeout_s
        if isinstance(body, EmbeddingsRequest) and not body.prompt:
            tally.outcome = "ok"
            return json_response(EmbeddingReply([]))  # Ollama's answer to an empty prompt
        if isinstance(body, EmbedRequest) and not body.inputs:  # Ollama loads the model and answers no vector
            await state.dispatcher.serving_replica(body.model, deadline)
            tally.outcome = "ok"
            return json_response(EmbedReply(model=name, embeddings=[], total_duration=clock.total_ns(),
                                            load_duration=clock.total_ns(), prompt_eval_count=0))
        plans = embedding_plans(state, embed_request(body), request[REQUEST_ID])
        tally.start()
        finals = await embed_all(state, plans, on_placed=clock.placed)
        vectors = [_shortened(embedding_floats(final.embedding or b""), body) for final in finals]
        tally.outcome = "ok"
        headers = {REPLICA_HEADER: finals[0].replica_id}
        if isinstance(body, EmbeddingsRequest):
            return json_response(EmbeddingReply(vectors[0]), headers=headers)
        return json_response(EmbedReply(model=name, embeddings=vectors, total_duration=clock.total_ns(),
                                        load_duration=clock.load_ns(),
                                        prompt_eval_count=sum(final.prompt_tokens for final in finals)),
                             headers=headers)


def _shortened(vector: list[float], body: EmbedRequest | EmbeddingsRequest) -> list[float]:
    """`vector`'s first ``dimensions`` values, L2-normalized again (as Ollama shortens one)
    unless the request asked for raw vectors."""
    size = body.dimensions if isinstance(body, EmbedRequest) else None
    if size is None or size >= len(vector):
        return vector
    kept = vector[:size]
    if isinstance(body, EmbedRequest) and body.normalize is False:
        return kept
    norm = math.sqrt(sum(value * value for value in kept)) or 1.0
    return [value / norm for value in kept]


def served_model(state: GatewayState, name: str) -> ModelSpec:
    """The model `name` means: a registered key, or the same with Ollama's default tag
    (``:latest``) removed or added; a 404 naming it otherwise."""
    if state.cluster.get_model(name) is None:
        tagged = name.removesuffix(LATEST_TAG) if name.endswith(LATEST_TAG) else name + LATEST_TAG
        spec = state.cluster.get_model(tagged)
        if spec is not None:
            return spec
    return state.cluster.require_model(name)
