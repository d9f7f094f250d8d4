"""The Responses API's input items: a body's ``input`` read into typed items, each with an id,
and those items as the chat turns they mean.

Items are kept with a stored response (response_store.py), so ``GET
/v1/responses/{id}/input_items`` lists them and a later request can name one, or an output
item of a stored response, by an ``item_reference``:

* ``message``: a turn (a string, or ``input_text`` / ``output_text`` parts); its ``id`` is
  the client's when it sends one, else a new ``msg_...``.
* ``function_call``: joins the assistant turn before it as one of its calls (chat templates
  expect one turn with its calls); ``function_call_output``: a tool turn.
* ``reasoning``: skipped (no Shoal model reads past thinking); ``item_reference``: replaced
  by the item it names before the turns are made (`ItemReference`).
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import FunctionCall, FunctionName, InMessage, InToolCall

ITEM_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
"""Ids Shoal keeps as sent (and indexes as NATS KV keys); another is replaced by a new one."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ContentPart(Struct):
    type: str
    text: str


class InputMessageItem(Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ContentPart]
    status: str = "completed"


class FunctionCallItem(Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class FunctionCallOutputItem(Struct, kw_only=True, tag_field="type", tag="function_call_output"):
    id: str
    call_id: str
    output: str
    status: str = "completed"


InputItem = InputMessageItem | FunctionCallItem | FunctionCallOutputItem


class ItemReference(Struct, kw_only=True):
    """``{"type": "item_reference", "id": ...}``: an item of a stored response, by its id."""

    id: str
    index: int
    """Its place in ``input`` (errors name ``input[index]``)."""


# What a client sends (ids optional, content a string or parts, unknown fields ignored).

class _Part(Struct):
    type: str
    text: str | None = None
    refusal: str | None = None
    """A ``refusal`` part's text (an assistant's output replayed)."""


class _Message(Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_Part]
    id: str | None = None


class _FunctionCall(Struct, kw_only=True):
    call_id: Annotated[str, Meta(min_length=1)]
    name: FunctionName
    arguments: str
    id: str | None = None


class _FunctionCallOutput(Struct, kw_only=True):
    call_id: Annotated[str, Meta(min_length=1)]
    output: str | list[_Part]
    id: str | None = None


class _Reference(Struct, kw_only=True):
    id: Annotated[str, Meta(min_length=1)]


_SCHEMAS: dict[str, type[Struct]] = {"message": _Message, "function_call": _FunctionCall,
                                     "function_call_output": _FunctionCallOutput, "item_reference": _Reference}
_SKIPPED = frozenset({"reasoning"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def read_input(value: str | list[dict[str, Any]]) -> list[InputItem | ItemReference]:
    """A body's ``input`` as items; each bad item is a 400 naming its place (``input[2]``)."""
    if isinstance(value, str):
        return [InputMessageItem(id=new_id("msg"), role="user", content=[ContentPart("input_text", value)])]
    items: list[InputItem | ItemReference] = []
    for i, raw in enumerate(value):
        kind = raw.get("type", "message")
        if kind in _SKIPPED:
            continue
        schema = _SCHEMAS.get(kind) if isinstance(kind, str) else None
        if schema is None:
            raise BadRequest(f"input[{i}]: item type {kind!r} is not supported (Shoal takes "
                             f"{', '.join(sorted(_SCHEMAS))})", param="input")
        try:
            item = msgspec.convert(raw, schema)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"input[{i}]: {exc}", param="input") from exc
        match item:
            case _Message():
                role_part = "output_text" if item.role == "assistant" else "input_text"
                items.append(InputMessageItem(id=_kept_id(item.id, "msg"), role=item.role,
                                              content=[ContentPart(role_part, _text(item.content, i, item.role))]))
            case _FunctionCall():
                items.append(FunctionCallItem(id=_kept_id(item.id, "fc"), call_id=item.call_id, name=item.name,
                                              arguments=item.arguments))
            case _FunctionCallOutput():
                items.append(FunctionCallOutputItem(id=_kept_id(item.id, "fco"), call_id=item.call_id,
                                                    output=_text(item.output, i)))
            case _Reference():
                items.append(ItemReference(id=item.id, index=i))
    return items


def _kept_id(sent: str | None, prefix: str) -> str:
    return sent if sent is not None and ITEM_ID.fullmatch(sent) else new_id(prefix)


def _text(content: str | list[_Part], i: int, role: str | None = None) -> str:
    """The text of an item's content: its text parts, and an assistant's ``refusal`` parts (its
    output replayed, as OpenAI takes it back)."""
    if isinstance(content, str):
        return content
    readable = _TEXT_PARTS | {"refusal"} if role == "assistant" else _TEXT_PARTS
    kinds = {part.type for part in content} - readable
    if kinds:
        raise BadRequest(f"input[{i}].content: only text parts are supported, got {sorted(kinds)}", param="input")
    return "".join((part.refusal if part.type == "refusal" else part.text) or "" for part in content)


def resolved(items: list[InputItem | ItemReference]) -> list[InputItem]:
    """`items`, which must hold no reference (a 400 naming the first: only a stored response's
    items can be named, and resolving them is the store's, `ResponseStore.resolve`)."""
    for item in items:
        if isinstance(item, ItemReference):
            raise BadRequest(f"input[{item.index}]: item_reference {item.id[:128]!r} names no stored item",
                             param="input")
    return [item for item in items if not isinstance(item, ItemReference)]


def turns_of(items: list[InputItem]) -> list[InMessage]:
    """The chat turns `items` mean (a 400 if they hold none)."""
    messages: list[InMessage] = []
    for item in items:
        match item:
            case InputMessageItem():
                messages.append(InMessage(role=item.role, content="".join(part.text for part in item.content)))
            case FunctionCallItem():
                call = InToolCall(item.call_id, FunctionCall(item.name, item.arguments))
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant" and last.tool_call_id is None:
                    last.tool_calls = [*(last.tool_calls or ()), call]
                else:
                    messages.append(InMessage(role="assistant", content=None, tool_calls=[call]))
            case FunctionCallOutputItem():
                messages.append(InMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    if not messages:
        raise BadRequest("input holds no message", param="input")
    return messages


class ItemList(Struct, kw_only=True):
    """``GET /v1/responses/{id}/input_items``: a page of a response's input items."""

    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


def page(items: list[InputItem], *, limit: int, order: Literal["asc", "desc"], after: str | None) -> ItemList:
    """Up to `limit` of `items` in `order`, from the one after `after` (an item id; a 400 if
    none of them has it)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.id for item in ordered]
        if after not in ids:
            raise BadRequest(f"after: no input item {after[:128]!r} in this response", param="after")
        start = ids.index(after) + 1
    chosen = ordered[start:start + limit]
    return ItemList(data=chosen, first_id=chosen[0].id if chosen else None,
                    last_id=chosen[-1].id if chosen else None, has_more=start + limit < len(ordered))
