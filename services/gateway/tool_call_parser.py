"""Function calling, answer side: one choice's generated text, as it streams, read into content
and calls (`ToolPlan` says how).

``tool_choice: auto`` reads the text in the model's format (its ``tool_call_parser`` setting,
named as vLLM names its parsers):

* ``hermes`` (the default: Qwen2.5 and Qwen3, Hermes 2 and 3, and the many models tuned on
  them): each call is ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
  ``</tool_call>``; text outside the tags is content, and a block that is not such JSON stays
  in it as written. Content streams as it comes, less a tail that may start a tag; a call
  is given out whole once its closing tag has come.
* ``llama3_json`` (Llama 3.1 to 3.3): an answer that starts with ``{`` is calls, JSON objects
  ``{"name": ..., "parameters": {...}}`` separated by ``;`` (the ``<|python_tag|>`` before
  them is a special token, not in the text); read when the choice ends, and content as
  written should they not parse. Any other answer is content, streamed as it comes.
* ``mistral`` (Mistral 7B v0.3, Nemo, Small): an answer that starts with ``[`` is a JSON array of
  ``{"name": ..., "arguments": {...}}`` (the ``[TOOL_CALLS]`` token before it is special, not in
  the text); read as ``llama3_json`` is.
* ``pythonic`` (Llama 3.2 and 4, ToolACE): an answer that starts with ``[`` is a Python list of
  calls with literal keyword arguments, ``[get_weather(city="Paris")]``, parsed (never run) when
  the choice ends; read as ``llama3_json`` is.

A forced choice (``required``, a named function) makes the whole text the grammar's JSON,
read when the choice ends; should it not parse (cut off by ``max_tokens``), it is the content.

Arguments are given out as JSON text written again (``json.dumps``), whatever spacing the model wrote.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from shoal.services.gateway.openai_api import FunctionCall, ToolCallOut
from shoal.services.gateway.tools import ToolPlan

Piece = str | FunctionCall
"""Content text, or a call."""


class _Format(Protocol):
    def feed(self, text: str) -> list[Piece]: ...
    def finish(self) -> list[Piece]: ...


class ToolCallReader:
    """One choice's text in, (content, calls) out; `finish` when the choice ends."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._format = _FORMATS[plan.format]() if plan.choice == "auto" else _Forced(plan)
        self._num_calls = 0
        self._after_call = False
        """Since the last call, only whitespace: the format's, not content (dropped)."""

    @property
    def made_calls(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> tuple[str, list[ToolCallOut]]:
        """The content and the whole calls that `text` completes."""
        return self._given_out(self._format.feed(text))

    def finish(self, finish_reason: str) -> tuple[str, list[ToolCallOut], str]:
        """What remains when the choice ended, and its finish reason: ``tool_calls`` when it
        made calls and stopped by itself (not at ``max_tokens``)."""
        content, calls = self._given_out(self._format.finish())
        if self.made_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, calls, finish_reason

    def _given_out(self, pieces: list[Piece]) -> tuple[str, list[ToolCallOut]]:
        content: list[str] = []
        calls: list[ToolCallOut] = []
        for piece in pieces:
            if isinstance(piece, str):
                content.append(self._visible(piece))
            elif self._plan.parallel or self._num_calls == 0:  # else only the first call is kept
                calls.append(ToolCallOut(f"call_{uuid.uuid4().hex[:24]}", piece))
                self._num_calls += 1
                self._after_call = True
        return "".join(content), calls

    def _visible(self, text: str) -> str:
        """The content given out of `text`; whitespace right after a call is the format's, not content."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text


OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class _Hermes:
    def __init__(self) -> None:
        self._pending = ""
        """Text not yet given out: a possible tag start, or a call's body."""
        self._in_call = False

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        pieces: list[Piece] = []
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE_TAG)
                if end < 0:
                    return pieces
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE_TAG):]
                self._in_call = False
                pieces.append(_hermes_call(body) or OPEN_TAG + body + CLOSE_TAG)
            else:
                start = self._pending.find(OPEN_TAG)
                if start < 0:
                    cut = len(self._pending) - _tag_start_length(self._pending)
                    pieces.append(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return pieces
                pieces.append(self._pending[:start])
                self._pending = self._pending[start + len(OPEN_TAG):]
                self._in_call = True

    def finish(self) -> list[Piece]:
        pending, self._pending = self._pending, ""
        if self._in_call:  # no closing tag: a call if its JSON is whole
            return [_hermes_call(pending) or OPEN_TAG + pending]
        return [pending]


def _tag_start_length(text: str) -> int:
    """How long a tail of `text` is a proper start of `OPEN_TAG` (held back: the tag may follow)."""
    for length in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0


def _hermes_call(body: str) -> FunctionCall | None:
    try:
        return _call_of(json.loads(body))
    except ValueError:
        return None


class _WholeAnswer:
    """An answer that opens with `opening` is calls, read by `parse` when it ends (the content
    as written should it not parse); any other answer is content, streamed as it comes."""

    def __init__(self, opening: str, parse: Callable[[str], list[FunctionCall] | None]) -> None:
        self._opening = opening
        self._parse = parse
        self._pending = ""
        self._calls: bool | None = None
        """Whether the answer is calls; None until its first non-blank character."""

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        if self._calls is None and self._pending.strip():
            self._calls = self._pending.lstrip().startswith(self._opening)
        if self._calls is False:
            pending, self._pending = self._pending, ""
            return [pending]
        return []

    def finish(self) -> list[Piece]:
        pending, self._pending = self._pending, ""
        calls = self._parse(pending) if self._calls else None
        return list(calls) if calls else [pending]


def _json_calls(text: str) -> list[FunctionCall] | None:
    """JSON call objects one after another, separated by ``;`` or blanks; None unless all are."""
    decoder = json.JSONDecoder()
    calls: list[FunctionCall] = []
    position = 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
        if position == len(text):
            return calls or None
        try:
            item, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        call = _call_of(item)
        if call is None:
            return None
        calls.append(call)


def _json_array_calls(text: str) -> list[FunctionCall] | None:
    """A JSON array of call objects (Mistral's, and a ``required`` choice's grammar); None
    unless the text is one."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    calls = [_call_of(item) for item in items] if isinstance(items, list) else [None]
    return None if not calls or None in calls else [call for call in calls if call is not None]


def _pythonic_calls(text: str) -> list[FunctionCall] | None:
    """A Python list of calls with literal keyword arguments, ``[f(a=1), g(b="x")]`` (read by
    `ast`, never run); None unless the text is one."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls: list[FunctionCall] = []
    for node in tree.body.elts:
        if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args
                or any(keyword.arg is None for keyword in node.keywords)):  # positional or **kwargs
            return None
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
            calls.append(FunctionCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # not a literal, not JSON
            return None
    return calls


class _Forced:
    """The grammar's JSON, whole when the choice ends: an array of calls (``required``), or
    the named function's arguments. Cut short (``max_tokens``), it is still the calls begun, as
    OpenAI and vLLM answer: the last one's arguments as far as they came (not JSON: the
    frameworks report it as an invalid call, rather than finding no call at all)."""

    def __init__(self, plan: ToolPlan) -> None:
        self._function = plan.function if plan.choice == "named" else None
        self._pending = ""

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        return []

    def finish(self) -> list[Piece]:
        text, self._pending = self._pending, ""
        calls = self._calls(text)
        return list(calls) if calls else [text]

    def _calls(self, text: str) -> list[FunctionCall] | None:
        if self._function is None:
            return _json_array_calls(text) or _calls_begun(text)
        try:
            answer = json.loads(text)
        except ValueError:
            return [FunctionCall(self._function, text.strip())]  # the grammar's: a prefix of the arguments
        return [FunctionCall(self._function, json.dumps(answer, ensure_ascii=False))] if isinstance(answer, dict) else None


_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(.*)', re.DOTALL)
"""A ``required`` call cut short, as its grammar writes it (name first): its name, and its
arguments as far as they came."""


def _calls_begun(text: str) -> list[FunctionCall] | None:
    """The calls of a ``required`` answer cut short (a prefix of its grammar's array): each
    whole one, then the one cut, if its name came."""
    decoder = json.JSONDecoder()
    at = text.find("[") + 1
    if at == 0:
        return None
    calls: list[FunctionCall] = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ","):
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        if (call := _call_of(item)) is not None:
            calls.append(call)
    if (cut := _CUT_CALL.match(text, at)) is not None:
        calls.append(FunctionCall(json.loads(cut.group(1)), cut.group(2).strip()))
    return calls or None


def _call_of(item: Any) -> FunctionCall | None:
    """``{"name": ..., "arguments": {...}}`` (or ``"parameters"``, as Llama writes) as a call."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        return FunctionCall(item["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return FunctionCall(item["name"], json.dumps(arguments, ensure_ascii=False))


_FORMATS: dict[str, Callable[[], _Format]] = {
    "hermes": _Hermes,
    "llama3_json": lambda: _WholeAnswer("{", _json_calls),
    "mistral": lambda: _WholeAnswer("[", _json_array_calls),
    "pythonic": lambda: _WholeAnswer("[", _pythonic_calls),
}
