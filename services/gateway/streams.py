"""A plan's answer as Server-Sent Events, whichever API's events they are: the dispatcher's
events go to a `StreamWriter` (OpenAI's chunks, the Responses API's typed events, Anthropic's
message events), which writes them its way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import structlog
from aiohttp import web

from shoal.services.gateway.errors import ApiError, request_outcome
from shoal.services.gateway.openai_api import Usage
from shoal.services.gateway.plans import Plan, choices_usage, generating
from shoal.services.gateway.progress import WaitProgress
from shoal.services.gateway.request_ids import REQUEST_ID, REQUEST_ID_HEADER
from shoal.services.gateway.sse import SseStream
from shoal.services.gateway.state import GatewayState
from shoal.shared.messages import FinalReply, TokenChunk

log = structlog.get_logger(__name__)


class StreamWriter(Protocol):
    """How a stream's events are written."""

    finals: list[FinalReply | None]

    @property
    def num_reasoning_tokens(self) -> int: ...

    async def start(self) -> None: ...
    async def tokens(self, index: int, chunk: TokenChunk) -> None: ...
    async def ended(self, index: int, final: FinalReply) -> None: ...
    async def finish(self, token_usage: Usage) -> None: ...
    async def fail(self, error: ApiError) -> None: ...
    async def close(self) -> None: ...


async def stream_answer(request: web.Request, state: GatewayState, plan: Plan,
                        make_writer: Callable[[SseStream], StreamWriter], *, headers: dict[str, str] | None = None
                        ) -> tuple[web.StreamResponse, str]:
    """The SSE response and its outcome: "ok", or the status of an error sent in the stream
    after the 200 (504 at the deadline, 503 when the replica died). Several choices stream
    interleaved, each event naming its choice's index.

    While it waits (placement, a cold start, a replica restarting) the stream gets a comment
    line every `gateway.stream_keepalive_s` saying what it waits for (sse.py). `headers`: the
    API's own, besides ``X-Request-Id``."""
    choices = plan.choices
    first = choices[0].request
    progress = WaitProgress(state.cluster, first.model)
    sse = SseStream(request, keepalive_s=state.config.stream_keepalive_s, describe=progress.describe,
                    headers={REQUEST_ID_HEADER: request[REQUEST_ID], **(headers or {})})
    out = make_writer(sse)
    outcome = "ok"
    async with generating(state, choices, restartable=False) as events, sse.keeping_alive():
        try:
            await state.dispatcher.ensure_placed(first.model, first.deadline)
            progress.stage = "queued"
            index, event = await anext(events)
            progress.stage = "generating"
            await out.start()
            while True:
                match event:
                    case TokenChunk():
                        await out.tokens(index, event)
                    case FinalReply():
                        await out.ended(index, event)
                try:
                    index, event = await anext(events)
                except StopAsyncIteration:
                    break
            await out.finish(choices_usage(choices, out.finals, out.num_reasoning_tokens))
        except ApiError as exc:
            # Errors before anything was sent (unknown model in the worker, prompt too long...)
            # keep their proper status; after that they become the stream's last event.
            plan.name_param(exc)
            if not await sse.commit_or_give_up():
                raise
            log.info("stream_error", status=exc.status, error=exc.message)
            outcome = request_outcome(exc)
            await out.fail(exc)
        await out.close()
    return sse.response, outcome
