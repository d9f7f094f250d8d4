"""vLLM's structured-output fields: ``guided_json``, ``guided_regex`` and ``guided_choice``
(and the ``structured_outputs`` object newer vLLM takes instead: ``json``, ``regex``,
``choice``, ``json_object``), on chat and completions alike.

Each becomes the grammar the worker masks tokens with (services/worker/engine/structured.py):
a JSON schema, or a regular expression (a choice is the alternation of its strings, matched
literally). One grammar shapes one answer: two of these fields, or one with
``response_format``, are a 400 naming the second. ``guided_grammar`` (vLLM's EBNF) is
refused: llguidance reads another grammar dialect, and a grammar read in the wrong one would
shape answers wrongly rather than fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from shoal.services.gateway.errors import BadRequest

MAX_REGEX_CHARS = 16_384
MAX_CHOICES = 1024
Regex = Annotated[str, Meta(min_length=1, max_length=MAX_REGEX_CHARS)]
Choices = Annotated[list[Annotated[str, Meta(max_length=4096)]], Meta(min_length=1, max_length=MAX_CHOICES)]


class StructuredOutputs(Struct, kw_only=True):
    json: dict[str, Any] | str | None = None
    regex: Regex | None = None
    choice: Choices | None = None
    json_object: bool | None = None
    grammar: str | None = None


@dataclass(frozen=True)
class Grammar:
    """What shapes the answer: a JSON schema (JSON text) or a regular expression, and the
    request field it came from."""

    param: str
    json_schema: str | None = None
    regex: str | None = None


def choice_regex(choices: list[str]) -> str:
    """A regular expression matching exactly one of `choices` (every character but letters
    and digits written as ``\\x{...}``, so none is read as syntax)."""
    return "(" + "|".join("".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in choice)
                          for choice in choices) + ")"


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else msgspec.json.encode(schema).decode()


def _grammars(guided_json: dict[str, Any] | str | None, guided_regex: str | None, guided_choice: list[str] | None,
              structured: StructuredOutputs | None) -> list[Grammar]:
    found: list[Grammar] = []
    if guided_json is not None:
        found.append(Grammar("guided_json", json_schema=_schema_text(guided_json)))
    if guided_regex is not None:
        found.append(Grammar("guided_regex", regex=guided_regex))
    if guided_choice is not None:
        found.append(Grammar("guided_choice", regex=choice_regex(guided_choice)))
    if structured is not None:
        if structured.grammar is not None:
            raise BadRequest("structured_outputs.grammar is not supported: send json, regex or choice",
                             code="unsupported_parameter", param="structured_outputs")
        if structured.json is not None:
            found.append(Grammar("structured_outputs", json_schema=_schema_text(structured.json)))
        if structured.regex is not None:
            found.append(Grammar("structured_outputs", regex=structured.regex))
        if structured.choice is not None:
            found.append(Grammar("structured_outputs", regex=choice_regex(structured.choice)))
        if structured.json_object:
            found.append(Grammar("structured_outputs", json_schema='{"type": "object"}'))
    return found


def request_grammar(*, response_format: str | None, guided_json: dict[str, Any] | str | None,
                    guided_regex: str | None, guided_choice: list[str] | None, guided_grammar: str | None,
                    structured: StructuredOutputs | None) -> Grammar | None:
    """The one grammar a request asks for (`response_format`: the schema its
    ``response_format`` asks for), if any."""
    if guided_grammar is not None:
        raise BadRequest("guided_grammar is not supported: send guided_json, guided_regex or guided_choice",
                         code="unsupported_parameter", param="guided_grammar")
    found = [Grammar("response_format", json_schema=response_format)] if response_format is not None else []
    found += _grammars(guided_json, guided_regex, guided_choice, structured)
    if len(found) > 1:
        first, second = found[0].param, found[1].param
        what = (f"{first} and {second} both shape" if first != second
                else f"{first}: json, regex, choice and json_object each shape")
        raise BadRequest(f"{what} the answer; send one", param=second)
    return found[0] if found else None
