"""What a JSON schema means to Shoal's grammar: an object that lists its properties and says
nothing of others takes no others.

JSON Schema lets such an object hold any other key; a grammar that allows them lets a small
model invent keys until ``max_tokens`` (observed: ``{"city": "Paris", "fore those station…``),
and the clients that send these schemas (pydantic models through LangChain, OpenAI's SDK) mean
the listed fields only. vLLM's default grammar backend reads them so too, and OpenAI's strict
mode requires it. A schema that wants more keys says so (``additionalProperties``,
``patternProperties`` or ``unevaluatedProperties``).
"""

from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose value maps names to schemas."""
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
"""Keywords whose value is a list of schemas."""
_SCHEMAS = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
            "unevaluatedItems", "unevaluatedProperties", "propertyNames")
"""Keywords whose value is a schema (``items`` may also be a list, as older drafts wrote it)."""
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """`schema` with ``additionalProperties: false`` on every object schema that has
    ``properties`` and none of `_OPEN_KEYWORDS`, at any depth; values (``const``, ``enum``,
    ``default``) are left as they are. A new structure: `schema` is not changed."""
    if isinstance(schema, list):  # ``items`` as a list
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for keyword in _SCHEMA_MAPS:
        if isinstance(closed.get(keyword), dict):
            closed[keyword] = {name: closed_objects(sub) for name, sub in closed[keyword].items()}
    for keyword in _SCHEMA_LISTS:
        if isinstance(closed.get(keyword), list):
            closed[keyword] = [closed_objects(sub) for sub in closed[keyword]]
    for keyword in _SCHEMAS:
        if keyword in closed:
            closed[keyword] = closed_objects(closed[keyword])
    if "properties" in closed and not any(keyword in closed for keyword in _OPEN_KEYWORDS):
        closed["additionalProperties"] = False
    return closed
