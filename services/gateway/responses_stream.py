"""A streamed Responses API answer: OpenAI's typed events, each an SSE ``event:`` with its
``data:`` (numbered by ``sequence_number``), and no ``[DONE]``.

    response.created, response.in_progress
    per message item:  response.output_item.added, response.content_part.added,
                       response.output_text.delta ..., response.output_text.done,
                       response.content_part.done, response.output_item.done
    per function call: response.output_item.added, response.function_call_arguments.delta,
                       response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (at max_output_tokens) | response.failed

A message item opens at the first text and closes when a call comes or the answer ends; an
answer with neither text nor calls still has one (empty) message, as the non-streamed
response has. A call's arguments come in one delta (the call is read whole, as in chat).
An error after the stream started is a ``response.failed`` holding the error and what was
written so far.
"""

from __future__ import annotations

from typing import Any

from msgspec.structs import replace

from shoal.services.gateway.errors import ApiError
from shoal.services.gateway.openai_api import ChatTokenLogprob, ToolCallOut, Usage, chat_logprobs, encoder
from shoal.services.gateway.responses_api import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ResponseError,
    ResponseShell,
    Status,
    final_status,
    function_call_id,
    message_id,
)
from shoal.services.gateway.sse import SseStream
from shoal.services.gateway.tool_call_parser import ToolCallReader
from shoal.shared.messages import FinalReply, TokenChunk


class _OpenMessage:
    """The message item being written: its place, id, and text so far."""

    def __init__(self, output_index: int) -> None:
        self.output_index = output_index
        self.id = message_id()
        self.parts: list[str] = []
        self.logprobs: list[ChatTokenLogprob] = []

    def item(self, status: Status) -> MessageItem:
        return MessageItem(id=self.id, status=status,
                           content=[OutputText(text="".join(self.parts), logprobs=self.logprobs)])


class StreamedResponse:
    """The events of one streamed response (one choice: the Responses API has no ``n``)."""

    def __init__(self, sse: SseStream, shell: ResponseShell, tool_reader: ToolCallReader | None,
                 wants_logprobs: bool) -> None:
        self._sse = sse
        self._shell = shell
        self._reader = tool_reader
        self._wants_logprobs = wants_logprobs
        self.finals: list[FinalReply | None] = [None]
        self._sequence_number = 0
        self._output: list[OutputItem] = []
        self._message: _OpenMessage | None = None
        self._pending_logprobs: list[ChatTokenLogprob] = []
        """Scores of tokens whose text has not been given out yet (held by the call reader)."""
        self._finish_reason = "stop"

    async def _event(self, kind: str, **fields: Any) -> None:
        payload = {"type": kind, **fields, "sequence_number": self._sequence_number}
        self._sequence_number += 1
        await self._sse.send(encoder.encode(payload), event=kind)

    async def start(self) -> None:
        snapshot = self._shell.make("in_progress", [])
        await self._event("response.created", response=snapshot)
        await self._event("response.in_progress", response=snapshot)

    async def tokens(self, index: int, chunk: TokenChunk) -> None:
        if self._wants_logprobs:
            self._pending_logprobs += chat_logprobs(chunk.logprobs or []).content
        if self._reader is None:
            await self._text(chunk.text)
            return
        text, calls = self._reader.feed(chunk.text)
        await self._text(text)
        for call in calls:
            await self._call(call)

    async def ended(self, index: int, final: FinalReply) -> None:
        self.finals[index] = final
        self._finish_reason = final.finish_reason
        if self._reader is not None:
            text, calls, self._finish_reason = self._reader.finish(final.finish_reason)
            await self._text(text)
            for call in calls:
                await self._call(call)

    async def finish(self, token_usage: Usage) -> None:
        status = final_status(self._finish_reason)
        if self._message is None and not self._output:
            await self._open_message()
        if self._pending_logprobs and self._message is not None:
            await self._text("")
        await self._close_message(status)
        event = "response.incomplete" if status == "incomplete" else "response.completed"
        await self._event(event, response=self._shell.make(status, self._output, token_usage))

    async def fail(self, error: ApiError) -> None:
        output = list(self._output)
        if self._message is not None:
            output.append(self._message.item("incomplete"))
        failure = ResponseError(error.code or error.error_type, error.message)
        await self._event("response.failed", response=self._shell.make("failed", output, error=failure))

    async def close(self) -> None:
        await self._sse.close()

    async def _text(self, text: str) -> None:
        if not text and (self._message is None or not self._pending_logprobs):
            return
        message = self._message or await self._open_message()
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        message.parts.append(text)
        message.logprobs += logprobs
        await self._event("response.output_text.delta", item_id=message.id, output_index=message.output_index,
                          content_index=0, delta=text, logprobs=logprobs)

    async def _open_message(self) -> _OpenMessage:
        message = self._message = _OpenMessage(len(self._output))
        await self._event("response.output_item.added", output_index=message.output_index,
                          item=replace(message.item("in_progress"), content=[]))
        await self._event("response.content_part.added", item_id=message.id, output_index=message.output_index,
                          content_index=0, part=OutputText(text=""))
        return message

    async def _close_message(self, status: Status) -> None:
        message, self._message = self._message, None
        if message is None:
            return
        item = message.item(status)
        part = item.content[0]
        place = {"item_id": message.id, "output_index": message.output_index, "content_index": 0}
        await self._event("response.output_text.done", **place, text=part.text, logprobs=part.logprobs)
        await self._event("response.content_part.done", **place, part=part)
        await self._event("response.output_item.done", output_index=message.output_index, item=item)
        self._output.append(item)

    async def _call(self, call: ToolCallOut) -> None:
        await self._close_message("completed")
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
