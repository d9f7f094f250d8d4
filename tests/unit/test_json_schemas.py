"""An object schema that lists its properties takes no others (services/worker/engine/json_schemas.py)."""

from __future__ import annotations

import copy
from typing import Any

from shoal.services.worker.engine.json_schemas import closed_objects

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
        "tags": {"type": "object", "additionalProperties": {"type": "object", "properties": {"x": {}}}},
        "properties": {"type": "object", "properties": {"y": {}}},  # a field named "properties"
        "kind": {"const": {"properties": {"kept": "as a value"}}},
    },
    "$defs": {"Pet": {"anyOf": [{"type": "object", "properties": {"cat": {}}},
                                {"type": "object", "properties": {"dog": {}}, "additionalProperties": True}]}},
}


def test_every_object_with_properties_is_closed_at_any_depth_unless_it_opens_itself() -> None:
    original = copy.deepcopy(PERSON)
    closed = closed_objects(PERSON)
    assert original == PERSON, "the client's schema is not changed"
    assert closed["additionalProperties"] is False
    properties = closed["properties"]
    assert properties["address"]["additionalProperties"] is False
    assert properties["tags"]["additionalProperties"]["additionalProperties"] is False  # the values' schema
    assert "additionalProperties" not in properties["tags"]["additionalProperties"]["properties"]["x"]
    assert properties["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]["properties"], \
        "a map of property schemas is not itself an object schema"
    assert properties["kind"] == {"const": {"properties": {"kept": "as a value"}}}, "values are not schemas"
    cat, dog = closed["$defs"]["Pet"]["anyOf"]
    assert cat["additionalProperties"] is False and dog["additionalProperties"] is True


def test_objects_without_properties_and_open_ones_stay_open() -> None:
    assert closed_objects({"type": "object"}) == {"type": "object"}  # json_object: any object
    pattern = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}}
    assert closed_objects(pattern) == pattern
    assert closed_objects({"type": "array", "items": [{"properties": {}}]}) == {
        "type": "array", "items": [{"properties": {}, "additionalProperties": False}]}
    assert closed_objects(True) is True
