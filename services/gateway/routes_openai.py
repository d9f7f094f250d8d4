"""``/v1/models``, ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` (a chat
request underneath: responses_api.py).

Streaming is decided by the body's ``stream`` field (the `openai` client sends
``Accept: application/json`` for streams too). Streams are Server-Sent Events
ending with ``data: [DONE]``; an error after the stream started is sent as an
``{"error": ...}`` event, which the `openai` client raises as an APIError. A Responses
stream is typed events instead (responses_stream.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from aiohttp import web

from shoal.services.gateway.answer_reader import Read
from shoal.services.gateway.anthropic_api import (
    ANTHROPIC_VERSION_HEADER,
    ModelPageQuery,
    model_info,
    model_page,
)
from shoal.services.gateway.embeddings_api import (
    EmbeddingRequest,
    embedding_list,
)
from shoal.services.gateway.errors import ApiError, error_payload
from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.openai_api import (
    SESSION_HEADER,
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionRequest,
    Kind,
    ModelCard,
    ModelList,
    TextLogprobs,
    ToolCallDelta,
    ToolCallOut,
    Usage,
    chat_logprobs,
    decode_query,
    echoed_logprobs,
    echoed_text,
    full_response,
    logprobs_end,
    stream_chunk,
    text_logprobs,
)
from shoal.services.gateway.plans import (
    Plan,
    admitted,
    choices_usage,
    collect,
    embed_all,
    embedding_plans,
    plan_request,
    with_params,
)
from shoal.services.gateway.request_ids import REPLICA_HEADER, REQUEST_ID
from shoal.services.gateway.response_store import ResponseStore
from shoal.services.gateway.responses_api import (
    ResponseObject,
    ResponseShell,
    ResponsesRequest,
    Turn,
    response_object,
    responses_turn,
)
from shoal.services.gateway.responses_items import read_input
from shoal.services.gateway.responses_stream import StreamedResponse
from shoal.services.gateway.sse import SseStream
from shoal.services.gateway.state import GATEWAY, GatewayState
from shoal.services.gateway.streams import StreamWriter, stream_answer
from shoal.services.gateway.tally import tallied
from shoal.shared.messages import FinalReply, PromptEcho, TokenChunk

log = structlog.get_logger(__name__)

routes = web.RouteTableDef()


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    """The served models; in Anthropic's form (a page of them) for Anthropic's clients."""
    state = request.app[GATEWAY]
    specs = sorted(state.cluster.models.values(), key=lambda spec: spec.key)
    if ANTHROPIC_VERSION_HEADER in request.headers:
        query = decode_query(request.query, ModelPageQuery)
        return json_response(model_page([model_info(spec) for spec in specs], query))
    return json_response(ModelList([_card(spec.key, spec.registered_at, spec.max_model_len) for spec in specs]))


@routes.get("/v1/models/{model:.+}")
async def get_model(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    spec = state.cluster.require_model(request.match_info["model"])
    if ANTHROPIC_VERSION_HEADER in request.headers:
        return json_response(model_info(spec))
    return json_response(_card(spec.key, spec.registered_at, spec.max_model_len))


def _card(key: str, registered_at: float, max_model_len: int | None) -> ModelCard:
    return ModelCard(id=key, created=int(registered_at), root=key, max_model_len=max_model_len)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "responses")


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "embeddings")


Endpoint = Literal["chat", "completion", "responses", "embeddings"]
_BODIES: dict[Endpoint, type[Any]] = {
    "chat": ChatCompletionRequest, "completion": CompletionRequest, "responses": ResponsesRequest,
    "embeddings": EmbeddingRequest}


async def _serve(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    """Validate, admit, place, dispatch (every request tallied: tally.py)."""
    state = request.app[GATEWAY]
    with tallied(state, endpoint) as tally:
        body = tally.decode(await request.read(), _BODIES[endpoint])
        responding: _Responding | None = None
        if isinstance(body, ResponsesRequest):
            responding = await _responding(state, body, request[REQUEST_ID])
            body = responding.turn.chat
        if isinstance(body, EmbeddingRequest):
            plans = embedding_plans(state, body, request[REQUEST_ID])
            tally.start()
            finals = await embed_all(state, plans)
            tally.outcome = "ok"
            return json_response(embedding_list(body, finals), headers={REPLICA_HEADER: finals[0].replica_id})
        kind: Kind = "completion" if endpoint == "completion" else "chat"
        plan = as_asked(plan_request(state, body, request[REQUEST_ID], request.headers.get(SESSION_HEADER),
                                     format_param="text" if responding is not None else "response_format"),
                        body, responses=responding is not None)
        with admitted(state, plan):
            tally.start()
            if plan.stream:
                response, tally.outcome = await stream_answer(
                    request, state, plan, lambda sse: _writer(sse, plan, kind, request[REQUEST_ID], responding))
            else:
                await state.dispatcher.ensure_placed(body.model, plan.choices[0].request.deadline)
                response, tally.outcome = await _collect(state, plan, kind, request[REQUEST_ID], responding), "ok"
        return response


def as_asked(plan: Plan, body: ChatCompletionRequest | CompletionRequest, *, responses: bool) -> Plan:
    """`plan` as OpenAI's API promises of `body`'s fields: a ``max_tokens`` the client gave must
    fit in the context with the prompt (else a 400, as OpenAI and vLLM answer, rather than an
    answer cut short), and a worker's errors name the fields as the client named them."""
    names: dict[str, str] = {}
    if isinstance(body, ChatCompletionRequest):
        given = body.max_completion_tokens is not None or body.max_tokens is not None
        if responses:
            names = {"messages": "input", "max_tokens": "max_output_tokens"}
        elif body.max_completion_tokens is not None:
            names = {"max_tokens": "max_completion_tokens"}
    else:
        given = body.max_tokens is not None
    asked = with_params(plan, max_tokens_must_fit=True) if given else plan
    return dataclasses.replace(asked, param_names=names)


@dataclass(frozen=True)
class _Responding:
    """A Responses request: the turn it makes, how its answer is written, where it is kept."""

    turn: Turn
    shell: ResponseShell
    store: ResponseStore

    async def keep(self, response: ResponseObject) -> None:
        await self.store.keep(response, self.turn)


async def _responding(state: GatewayState, body: ResponsesRequest, request_id: str) -> _Responding:
    """The turn `body` makes, after the stored response it goes on from (a 404 naming
    ``previous_response_id`` when there is none)."""
    response_id = _response_id("responses", request_id)
    previous = (await state.responses.get(body.previous_response_id, param="previous_response_id")
                if body.previous_response_id is not None else None)
    items = await state.responses.resolve(read_input(body.input))
    turn = responses_turn(body, response_id, previous.conversation if previous else None,
                          previous.session_id if previous else None, items)
    return _Responding(turn, ResponseShell(response_id, int(time.time()), body), state.responses)


async def _collect(state: GatewayState, plan: Plan, kind: Kind, request_id: str,
                   responding: _Responding | None) -> web.Response:
    choices = plan.choices
    first = choices[0].request
    collected = await collect(state, plan)
    answers = [c.answer() for c in collected]
    token_usage = choices_usage(choices, [c.ended() for c in collected],
                                 sum(c.num_reasoning_tokens for c in collected))
    body: Any
    if responding is not None:
        body = response_object(responding.shell, answers[0], token_usage)
        await responding.keep(body)
    else:
        body = full_response(kind, _response_id(kind, request_id), int(first.created), first.model, answers,
                             token_usage)
    return json_response(body, headers={REPLICA_HEADER: collected[0].ended().replica_id})  # X-Request-Id: request_id_middleware


_RESPONSE_ID_PREFIXES: dict[Endpoint, str] = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp_"}


def _response_id(endpoint: Endpoint, request_id: str) -> str:
    return _RESPONSE_ID_PREFIXES[endpoint] + request_id


def _writer(sse: SseStream, plan: Plan, kind: Kind, request_id: str, responding: _Responding | None
            ) -> StreamWriter:
    """How a stream's events are written: a Responses stream's typed events, or chunks."""
    first = plan.choices[0].request
    if responding is not None:
        return StreamedResponse(sse, responding.shell, plan.answer_reader(), first.params.logprobs is not None,
                                on_final=responding.keep)
    return _StreamedChoices(sse, kind, _response_id(kind, request_id), int(first.created), first.model, plan)


class _StreamedChoices:
    """The chunks of a streamed response, choice by choice: text (read for calls where the
    request has tools), log probabilities, calls, each choice's end."""

    def __init__(self, sse: SseStream, kind: Kind, response_id: str, created: int, model: str, plan: Plan) -> None:
        self._sse = sse
        self._head = (kind, response_id, created, model)
        self._kind = kind
        self._include_usage = plan.include_usage
        self.finals: list[FinalReply | None] = [None] * len(plan.choices)
        wants_logprobs = plan.choices[0].request.params.logprobs is not None
        self._logprobs = _ChunkLogprobs(kind, len(plan.choices)) if wants_logprobs else None
        self._readers = [plan.answer_reader() for _ in plan.choices]
        self._calls_sent = [0] * len(plan.choices)
        self._own_prompts = [choice.request.prompt for choice in plan.choices]

    async def send(self, index: int, **fields: Any) -> None:
        await self._sse.send(stream_chunk(*self._head, index=index, **fields))

    @property
    def num_reasoning_tokens(self) -> int:
        return sum(reader.num_reasoning_tokens for reader in self._readers)

    async def start(self) -> None:
        """A chat stream's first chunk per choice: the assistant role."""
        if self._kind == "chat":
            for index in range(len(self.finals)):
                await self.send(index, text="", role=True)

    async def finish(self, token_usage: Usage) -> None:
        if self._include_usage:
            await self.send(0, token_usage=token_usage, usage_only=True)

    async def fail(self, error: ApiError) -> None:
        await self._sse.send(error_payload(error))

    async def close(self) -> None:
        await self._sse.done()

    async def tokens(self, index: int, chunk: TokenChunk) -> None:
        if chunk.prompt is not None:  # an echo: the prompt first
            await self.send(index, text=echoed_text(chunk.prompt, self._own_prompts[index]),
                            logprobs=None if self._logprobs is None else self._logprobs.of_prompt(index, chunk.prompt))
        logprobs = None if self._logprobs is None else self._logprobs.of(index, chunk)
        reader = self._readers[index]
        if reader.passes_through:
            await self.send(index, text=chunk.text, logprobs=logprobs)
            return
        await self._send_read(index, reader.feed(chunk.text, chunk.num_tokens), logprobs)

    async def ended(self, index: int, final: FinalReply) -> None:
        self.finals[index] = final
        read, finish_reason = self._readers[index].finish(final.finish_reason)
        await self._send_read(index, read)
        await self.send(index, finish_reason=finish_reason, text="" if self._kind == "completion" else None,
                        stop_reason=final.stop_reason)

    async def _send_read(self, index: int, read: Read, logprobs: ChatLogprobs | TextLogprobs | None = None) -> None:
        """A delta with the reasoning and content read (content absent beside reasoning alone), then the calls."""
        if read.reasoning or read.content or logprobs is not None:
            await self.send(index, text=read.content or (None if read.reasoning else ""), logprobs=logprobs,
                            reasoning=read.reasoning or None)
        await self._send_calls(index, read.calls)

    async def _send_calls(self, index: int, calls: list[ToolCallOut]) -> None:
        """Each call in a delta of its own, numbered within its choice."""
        for call in calls:
            await self.send(index, tool_calls=[ToolCallDelta(self._calls_sent[index], call.id, call.function)])
            self._calls_sent[index] += 1


class _ChunkLogprobs:
    """The ``logprobs`` of each streamed chunk; a completion's token offsets run on from the
    choice's previous chunks."""

    def __init__(self, kind: Kind, num_choices: int) -> None:
        self._kind = kind
        self._offsets = [0] * num_choices

    def of_prompt(self, index: int, prompt: PromptEcho) -> TextLogprobs:
        logprobs = echoed_logprobs(prompt)
        self._offsets[index] = logprobs_end(logprobs)
        return logprobs

    def of(self, index: int, chunk: TokenChunk) -> ChatLogprobs | TextLogprobs:
        entries = chunk.logprobs or []
        if self._kind == "chat":
            return chat_logprobs(entries)
        logprobs = text_logprobs(entries, self._offsets[index])
        self._offsets[index] += sum(len(token) for token in logprobs.tokens)
        return logprobs
