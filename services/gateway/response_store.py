"""Stored Responses API answers: the ``shoal_responses`` KV bucket.

A response made with ``store`` (OpenAI's default) is kept `ttl_s` after it was made, so a
later request can go on from it (``previous_response_id``) through any gateway, and a client
can read it back (``GET /v1/responses/{id}``) or delete it. Each entry holds the response as
it was answered and the conversation it ends (its input turns after those of the response it
went on from, then its answer), so going on from a response is one read, however long the
chain. ``instructions`` are not carried over, as OpenAI has it.

A chain runs as one chat session (docs/sessions.md), named after its first response: a replica
keeps the conversation's KV between turns, so a turn computes only its new input.

Each entry keeps its input items too (``GET /v1/responses/{id}/input_items``), and every
input and output item's id is indexed (key ``item.<id>`` -> the response's id), so an
``item_reference`` in a later request finds the item it names.

Bounded by the bucket itself (file storage, at most `RESPONSES_MAX_BYTES`; an entry at most
the NATS server's ``max_payload``): a response that cannot be stored is logged and answered
all the same, then not found when asked for.
"""

from __future__ import annotations

import asyncio
import re

import msgspec
import nats.errors
import nats.js.errors
import structlog
from msgspec import Struct
from nats.js import JetStreamContext
from nats.js.api import StorageType

from shoal.services.gateway.errors import NotFound
from shoal.services.gateway.openai_api import InMessage
from shoal.services.gateway.responses_api import MessageItem, ReasoningItem, ResponseObject, Turn, answer_turn
from shoal.services.gateway.responses_items import (
    ITEM_ID,
    ContentPart,
    InputItem,
    InputMessageItem,
    ItemReference,
)
from shoal.shared import subjects
from shoal.shared.bus import ensure_expiring_bucket

log = structlog.get_logger(__name__)

RESPONSES_MAX_BYTES = 1024**3
_RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9_-]{1,128}")


class StoredResponse(Struct, kw_only=True):
    response: ResponseObject
    conversation: list[InMessage]
    """Every turn up to and including this response's answer (no ``instructions``)."""
    session_id: str | None
    """The chain's chat session."""
    input_items: list[InputItem] = msgspec.field(default_factory=list)
    """This response's own input (not its chain's), references resolved."""

    @property
    def item_ids(self) -> set[str]:
        return {*(item.id for item in self.input_items), *(item.id for item in self.response.output)}

    def find_item(self, item_id: str) -> InputItem | ReasoningItem | None:
        """An input or output item by id; an output message as the assistant's input message."""
        for item in self.input_items:
            if item.id == item_id:
                return item
        for output in self.response.output:
            if output.id == item_id:
                return (InputMessageItem(id=output.id, role="assistant",
                                         content=[ContentPart("output_text", part.text) for part in output.content])
                        if isinstance(output, MessageItem) else output)
        return None


_decoder = msgspec.json.Decoder(StoredResponse)
_encoder = msgspec.json.Encoder()


def _item_key(item_id: str) -> str:
    return f"item.{item_id}"


def check_response_id(response_id: str, param: str | None = None) -> str:
    """`response_id` if it can name a stored response, else a 404 (never a bad key)."""
    if not _RESPONSE_ID.fullmatch(response_id):
        raise NotFound(f"no response {response_id[:160]!r}: response ids look like resp_...", param=param)
    return response_id


class ResponseStore:
    """The ``shoal_responses`` bucket (see the module doc)."""

    def __init__(self, js: JetStreamContext, ttl_s: float) -> None:
        self._js = js
        self.ttl_s = ttl_s
        self._kv: nats.js.kv.KeyValue | None = None

    async def start(self) -> None:
        """Create the bucket, or open it as another gateway created it."""
        self._kv = await ensure_expiring_bucket(
            self._js, subjects.RESPONSES_BUCKET,
            "Shoal's stored Responses API answers: <response id> -> the response and its conversation",
            ttl_s=self.ttl_s, max_bytes=RESPONSES_MAX_BYTES, storage=StorageType.FILE)

    @property
    def kv(self) -> nats.js.kv.KeyValue:
        assert self._kv is not None, "ResponseStore.start() was not awaited"
        return self._kv

    async def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; a 404 naming `param` when there is none (never made, not
        stored, expired, deleted)."""
        check_response_id(response_id, param)
        try:
            entry = await self.kv.get(response_id)
        except nats.js.errors.KeyNotFoundError:
            entry = None
        if entry is None or not entry.value:
            raise NotFound(f"no stored response {response_id!r} (not stored, expired after "
                           f"{self.ttl_s:g} s, or deleted)", param=param)
        try:
            return _decoder.decode(entry.value)
        except msgspec.DecodeError as exc:
            log.error("stored_response_malformed", response_id=response_id, error=str(exc))
            raise NotFound(f"stored response {response_id!r} is unreadable", param=param) from exc

    async def keep(self, response: ResponseObject, turn: Turn) -> None:
        """Store `response`, the answer to `turn`, if the turn stores and it was answered."""
        if turn.stores and response.status in ("completed", "incomplete"):
            await self.put(StoredResponse(response=response, conversation=[*turn.conversation, answer_turn(response)],
                                          session_id=turn.chat.session_id, input_items=turn.items))

    async def put(self, stored: StoredResponse) -> None:
        """Store `stored`, then index its items' ids (the response first: an index entry never
        names a response that is not there yet)."""
        key = stored.response.id
        try:
            await self.kv.put(key, _encoder.encode(stored))
            await asyncio.gather(*(self.kv.put(_item_key(item_id), key.encode()) for item_id in stored.item_ids))
        except (TimeoutError, nats.errors.Error) as exc:  # too large, bucket full, NATS away
            log.warning("response_not_stored", response_id=key, error=str(exc))

    async def resolve(self, items: list[InputItem | ItemReference]) -> list[InputItem]:
        """`items` with each reference replaced by the stored item it names (a 404 naming
        ``input`` for one that is not stored; a reasoning item's reference is dropped, as a
        reasoning item is)."""
        found: list[InputItem] = []
        for item in items:
            if not isinstance(item, ItemReference):
                found.append(item)
                continue
            referenced = await self._stored_item(item.id)
            if referenced is None:
                raise NotFound(f"input[{item.index}]: no stored item {item.id[:128]!r} (not stored, expired after "
                               f"{self.ttl_s:g} s, or deleted)", param="input")
            if not isinstance(referenced, ReasoningItem):
                found.append(referenced)
        return found

    async def _stored_item(self, item_id: str) -> InputItem | ReasoningItem | None:
        """The item of that id in the stored response the index names, if any."""
        if not ITEM_ID.fullmatch(item_id):
            return None
        try:
            entry = await self.kv.get(_item_key(item_id))
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry is None or not entry.value:
            return None
        try:
            stored = await self.get(entry.value.decode(errors="replace"))
        except NotFound:
            return None
        return stored.find_item(item_id)

    async def delete(self, response_id: str) -> None:
        """Forget a stored response; a 404 when there is none."""
        await self.get(response_id)
        await self.kv.purge(response_id)
