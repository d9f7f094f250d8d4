"""A streamed Responses API answer: OpenAI's typed events, each an SSE ``event:`` with its
``data:`` (numbered by ``sequence_number``), and no ``[DONE]``.

    response.created, response.in_progress
    per reasoning item: response.output_item.added, response.reasoning_text.delta ...,
                       response.reasoning_text.done, response.output_item.done
    per message item:  response.output_item.added, response.content_part.added,
                       response.output_text.delta ..., response.output_text.done,
                       response.content_part.done, response.output_item.done
    per function call: response.output_item.added, response.function_call_arguments.delta,
                       response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (at max_output_tokens) | response.failed

An item opens at its first text (reasoning for a model with a ``reasoning_parser``, then the
answer's) and closes when something else comes or the answer ends; an answer with neither
text nor calls still has one (empty) message, as the non-streamed response has. A call's arguments come in one delta (the call is read whole, as in chat).
An error after the stream started is a ``response.failed`` holding the error and what was
written so far.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from msgspec.structs import replace

from shoal.services.gateway.answer_reader import AnswerReader, Read
from shoal.services.gateway.errors import ApiError
from shoal.services.gateway.openai_api import ChatTokenLogprob, ToolCallOut, Usage, chat_logprobs, encoder
from shoal.services.gateway.responses_api import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseShell,
    Status,
    final_status,
    function_call_id,
    message_id,
    reasoning_id,
)
from shoal.services.gateway.sse import SseStream
from shoal.shared.messages import FinalReply, TokenChunk

ItemKind = Literal["reasoning", "message"]


class _OpenItem:
    """The reasoning or message item being written: its place, id, and text so far."""

    def __init__(self, kind: ItemKind, output_index: int) -> None:
        self.kind = kind
        self.output_index = output_index
        self.id = reasoning_id() if kind == "reasoning" else message_id()
        self.parts: list[str] = []
        self.logprobs: list[ChatTokenLogprob] = []

    def item(self, status: Status, *, empty: bool = False) -> ReasoningItem | MessageItem:
        text = "".join(self.parts)
        if self.kind == "reasoning":
            return ReasoningItem(id=self.id, content=[] if empty else [ReasoningText(text=text)], status=status)
        return MessageItem(id=self.id, status=status,
                           content=[] if empty else [OutputText(text=text, logprobs=self.logprobs)])


class StreamedResponse:
    """The events of one streamed response (one choice: the Responses API has no ``n``)."""

    def __init__(self, sse: SseStream, shell: ResponseShell, reader: AnswerReader, wants_logprobs: bool,
                 on_final: Callable[[ResponseObject], Awaitable[None]] | None = None) -> None:
        """`on_final`: given the finished response before its last event goes out (so a
        client that goes on from it at once finds it stored)."""
        self._sse = sse
        self._on_final = on_final
        self._shell = shell
        self._reader = reader
        self._wants_logprobs = wants_logprobs
        self.finals: list[FinalReply | None] = [None]
        self._sequence_number = 0
        self._output: list[OutputItem] = []
        self._open: _OpenItem | None = None
        self._answered = False
        """A message or a call was written (else the end writes an empty message)."""
        self._pending_logprobs: list[ChatTokenLogprob] = []
        """Scores of tokens whose text has not been given out yet (held by the readers)."""
        self._finish_reason = "stop"

    async def _event(self, kind: str, **fields: Any) -> None:
        payload = {"type": kind, **fields, "sequence_number": self._sequence_number}
        self._sequence_number += 1
        await self._sse.send(encoder.encode(payload), event=kind)

    @property
    def num_reasoning_tokens(self) -> int:
        return self._reader.num_reasoning_tokens

    async def start(self) -> None:
        snapshot = self._shell.make("in_progress", [])
        await self._event("response.created", response=snapshot)
        await self._event("response.in_progress", response=snapshot)

    async def tokens(self, index: int, chunk: TokenChunk) -> None:
        if self._wants_logprobs:
            self._pending_logprobs += chat_logprobs(chunk.logprobs or []).content
        await self._write(self._reader.feed(chunk.text, chunk.num_tokens))

    async def ended(self, index: int, final: FinalReply) -> None:
        self.finals[index] = final
        read, self._finish_reason = self._reader.finish(final.finish_reason)
        await self._write(read)

    async def finish(self, token_usage: Usage) -> None:
        status = final_status(self._finish_reason)
        if not self._answered:
            await self._open_item("message")
        if self._pending_logprobs and self._open is not None and self._open.kind == "message":
            await self._text("")
        await self._close(status)
        event = "response.incomplete" if status == "incomplete" else "response.completed"
        response = self._shell.make(status, self._output, token_usage)
        if self._on_final is not None:
            await self._on_final(response)
        await self._event(event, response=response)

    async def fail(self, error: ApiError) -> None:
        output = list(self._output)
        if self._open is not None:
            output.append(self._open.item("incomplete"))
        failure = ResponseError(error.code or error.error_type, error.message)
        await self._event("response.failed", response=self._shell.make("failed", output, error=failure))

    async def close(self) -> None:
        await self._sse.close()

    async def _write(self, read: Read) -> None:
        if read.reasoning:
            await self._reasoning(read.reasoning)
        await self._text(read.content)
        for call in read.calls:
            await self._call(call)

    async def _reasoning(self, text: str) -> None:
        item = await self._item("reasoning")
        item.parts.append(text)
        await self._event("response.reasoning_text.delta", item_id=item.id, output_index=item.output_index,
                          content_index=0, delta=text)

    async def _text(self, text: str) -> None:
        in_message = self._open is not None and self._open.kind == "message"
        if not text and not (in_message and self._pending_logprobs):
            return
        item = await self._item("message")
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        item.parts.append(text)
        item.logprobs += logprobs
        await self._event("response.output_text.delta", item_id=item.id, output_index=item.output_index,
                          content_index=0, delta=text, logprobs=logprobs)

    async def _item(self, kind: ItemKind) -> _OpenItem:
        """The open item of `kind`, opened now (the one open before closed) if needed."""
        if self._open is not None and self._open.kind == kind:
            return self._open
        await self._close("completed")
        return await self._open_item(kind)

    async def _open_item(self, kind: ItemKind) -> _OpenItem:
        item = self._open = _OpenItem(kind, len(self._output))
        self._answered |= kind == "message"
        await self._event("response.output_item.added", output_index=item.output_index,
                          item=item.item("in_progress", empty=True))
        if kind == "message":
            await self._event("response.content_part.added", item_id=item.id, output_index=item.output_index,
                              content_index=0, part=OutputText(text=""))
        return item

    async def _close(self, status: Status) -> None:
        open_item, self._open = self._open, None
        if open_item is None:
            return
        item = open_item.item(status)
        place = {"item_id": open_item.id, "output_index": open_item.output_index, "content_index": 0}
        if isinstance(item, MessageItem):
            part = item.content[0]
            await self._event("response.output_text.done", **place, text=part.text, logprobs=part.logprobs)
            await self._event("response.content_part.done", **place, part=part)
        else:
            await self._event("response.reasoning_text.done", **place, text=item.content[0].text)
        await self._event("response.output_item.done", output_index=open_item.output_index, item=item)
        self._output.append(item)

    async def _call(self, call: ToolCallOut) -> None:
        await self._close("completed")
        self._answered = True
        output_index = len(self._output)
        item = FunctionCallItem(id=function_call_id(), call_id=call.id, name=call.function.name,
                                arguments=call.function.arguments)
        place = {"item_id": item.id, "output_index": output_index}
        await self._event("response.output_item.added", output_index=output_index,
                          item=replace(item, arguments="", status="in_progress"))
        await self._event("response.function_call_arguments.delta", **place, delta=item.arguments)
        await self._event("response.function_call_arguments.done", **place, name=item.name,
                          arguments=item.arguments)
        await self._event("response.output_item.done", output_index=output_index, item=item)
        self._output.append(item)
