"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``, so
Anthropic's clients (its Python and TypeScript SDKs, and tools built on them) work against
Shoal as vLLM's and Ollama's Anthropic-compatible endpoints serve them.

Each request is validated into the chat request of the same meaning (anthropic_api.py) and
planned, admitted, placed and generated exactly as one sent to ``/v1/chat/completions``
(plans.py): the same queue bounds, fair wakes, prefix cache, reasoning and tool-call readers.
An answer is a message of content blocks (``thinking``, ``text``, ``tool_use``); a streamed
one is Anthropic's events: ``message_start``, each block's ``content_block_start``, deltas
and ``content_block_stop``, then ``message_delta`` (stop reason, usage) and ``message_stop``;
an error after the stream started is an ``error`` event. ``message_start`` counts the prompt's
tokens as its first chunk reports them (all of them: what the prefix cache held is known at
the end); ``message_delta`` has the usage split as Anthropic reports it.
Keys come as ``x-api-key`` or ``Authorization: Bearer`` (auth.py); ``anthropic-version``
and ``anthropic-beta`` headers are accepted and not read.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec
from aiohttp import web

from shoal.services.gateway.answer_reader import AnswerReader, Read
from shoal.services.gateway.anthropic_api import (
    BlockOut,
    CountTokensRequest,
    MessageOut,
    MessagesRequest,
    StopReason,
    TextOut,
    ThinkingOut,
    TokenCount,
    ToolUseOut,
    Usage,
    chat_request,
    shows_thinking,
    stop_reason,
    stop_sequences,
    tool_use_id,
    usage_of,
)
from shoal.services.gateway.errors import ANTHROPIC_REQUEST_ID_HEADER, ApiError, anthropic_error
from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.openai_api import Answer, ChatCompletionRequest
from shoal.services.gateway.openai_api import Usage as ChatUsage
from shoal.services.gateway.plans import (
    Plan,
    admitted,
    choices_usage,
    collect,
    plan_request,
    with_params,
)
from shoal.services.gateway.request_ids import REPLICA_HEADER, REQUEST_ID
from shoal.services.gateway.routes_tokenize import prompt_tokens
from shoal.services.gateway.sse import SseStream
from shoal.services.gateway.state import GATEWAY, GatewayState
from shoal.services.gateway.streams import stream_answer
from shoal.services.gateway.tally import Tally, tallied
from shoal.shared.messages import FinalReply, TokenChunk

routes = web.RouteTableDef()
_encoder = msgspec.json.Encoder()


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[GATEWAY]
    with tallied(state, "anthropic_messages") as tally:
        body, chat = await _read(request, tally, MessagesRequest)
        plan = with_params(plan_request(state, chat, request[REQUEST_ID], None,
                                        format_param="output_format" if body.output_format else "output_config"),
                           stop=stop_sequences(body))
        message_id = "msg_" + request[REQUEST_ID]
        with admitted(state, plan):
            tally.start()
            if plan.stream:
                response, tally.outcome = await stream_answer(
                    request, state, plan, lambda sse: _MessageEvents(sse, message_id, body.model, plan.answer_reader(),
                                                                     shows_thinking(body.thinking)),
                    headers={ANTHROPIC_REQUEST_ID_HEADER: request[REQUEST_ID]})
                return response
            await state.dispatcher.ensure_placed(body.model, plan.choices[0].request.deadline)
            whole = await _whole(state, plan, message_id, body.model, shows_thinking(body.thinking))
            tally.outcome = "ok"
            return whole


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    with tallied(state, "anthropic_count_tokens") as tally:
        _, chat = await _read(request, tally, CountTokensRequest)
        reply = await prompt_tokens(state, chat, request[REQUEST_ID])
        tally.outcome = "ok"
        return json_response(TokenCount(len(reply.tokens)))


Body = TypeVar("Body", bound=CountTokensRequest)


async def _read(request: web.Request, tally: Tally, schema: type[Body]) -> tuple[Body, ChatCompletionRequest]:
    """The request's body, and the chat request it means (a 404 for an unknown model)."""
    body: Body = tally.decode(await request.read(), schema)
    spec = request.app[GATEWAY].cluster.require_model(body.model)
    return body, chat_request(body, spec.reasoning_parser)


async def _whole(state: GatewayState, plan: Plan, message_id: str, model: str, thinking: bool) -> web.Response:
    (collected,) = await collect(state, plan)
    final = collected.ended()
    answer = collected.answer()
    token_usage = choices_usage(plan.choices, [final], collected.num_reasoning_tokens)
    message = MessageOut(message_id, model, _blocks(answer, thinking),
                         stop_reason(answer.finish_reason, final.stop_reason),
                         final.stop_reason, usage_of(token_usage))
    return json_response(message, headers={REPLICA_HEADER: final.replica_id})  # request-id: errors.py


def _blocks(answer: Answer, thinking: bool) -> list[BlockOut]:
    """An answer's content: its thinking (when asked for), its text, its calls (a text block,
    empty, for none)."""
    blocks: list[BlockOut] = [ThinkingOut(answer.reasoning)] if answer.reasoning and thinking else []
    if answer.text:
        blocks.append(TextOut(answer.text))
    blocks += [ToolUseOut(tool_use_id(call), call.function.name, call.arguments_object())
               for call in answer.tool_calls or ()]
    return blocks or [TextOut("")]


Streamed = Literal["text", "thinking"]


class _MessageEvents:
    """One answer's stream events (a `StreamWriter`): a block is opened when the text read
    changes kind (thinking, text), each call is a ``tool_use`` block of its own."""

    def __init__(self, sse: SseStream, message_id: str, model: str, reader: AnswerReader, thinking: bool) -> None:
        self._sse = sse
        self._thinking = thinking
        self._message_id = message_id
        self._model = model
        self._reader = reader
        self.finals: list[FinalReply | None] = [None]
        self._open: Streamed | None = None
        self._num_blocks = 0
        self._stop: tuple[StopReason, str | None] = ("end_turn", None)
        self._begun = False

    @property
    def num_reasoning_tokens(self) -> int:
        return self._reader.num_reasoning_tokens

    async def _send(self, event: str, payload: dict[str, Any]) -> None:
        await self._sse.send(_encoder.encode({"type": event, **payload}), event=event)

    async def start(self) -> None:
        """Nothing yet: ``message_start`` goes with the first event, which counts the prompt."""

    async def _begin(self, prompt_tokens: int) -> None:
        if not self._begun:
            self._begun = True
            message = MessageOut(self._message_id, self._model, [], None, None, Usage(prompt_tokens, 0))
            await self._send("message_start", {"message": message})

    async def tokens(self, index: int, chunk: TokenChunk) -> None:
        await self._begin(chunk.prompt_tokens)
        await self._send_read(self._reader.feed(chunk.text, chunk.num_tokens))

    async def ended(self, index: int, final: FinalReply) -> None:
        await self._begin(final.prompt_tokens)
        self.finals[index] = final
        read, finish_reason = self._reader.finish(final.finish_reason)
        await self._send_read(read)
        if self._num_blocks == 0 and self._open is None:  # an empty answer: one empty text block
            await self._delta("text", "")
        await self._close_block()
        self._stop = (stop_reason(finish_reason, final.stop_reason), final.stop_reason)

    async def finish(self, token_usage: ChatUsage) -> None:
        reason, sequence = self._stop
        await self._send("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": usage_of(token_usage)})
        await self._send("message_stop", {})

    async def fail(self, error: ApiError) -> None:
        await self._sse.send(_encoder.encode(anthropic_error(error, self._message_id.removeprefix("msg_"))),
                             event="error")

    async def close(self) -> None:
        await self._sse.close()

    async def _send_read(self, read: Read) -> None:
        if read.reasoning and self._thinking:
            await self._delta("thinking", read.reasoning)
        if read.content:
            await self._delta("text", read.content)
        for call in read.calls:
            await self._close_block()
            block = ToolUseOut(tool_use_id(call), call.function.name, {})
            await self._send("content_block_start", {"index": self._num_blocks, "content_block": block})
            await self._send("content_block_delta", {"index": self._num_blocks, "delta": {
                "type": "input_json_delta", "partial_json": _encoder.encode(call.arguments_object()).decode()}})
            await self._send("content_block_stop", {"index": self._num_blocks})
            self._num_blocks += 1

    async def _delta(self, kind: Streamed, text: str) -> None:
        if self._open != kind:
            await self._close_block()
            block = ThinkingOut("") if kind == "thinking" else TextOut("")
            await self._send("content_block_start", {"index": self._num_blocks, "content_block": block})
            self._open = kind
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                          "text": text}
        await self._send("content_block_delta", {"index": self._num_blocks, "delta": delta})

    async def _close_block(self) -> None:
        if self._open is None:
            return
        await self._send("content_block_stop", {"index": self._num_blocks})
        self._open = None
        self._num_blocks += 1
