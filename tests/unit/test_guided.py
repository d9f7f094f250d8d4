"""vLLM's structured-output fields at the gateway (services/gateway/guided.py): which grammar
a request asks for, and refusals naming the field."""

from __future__ import annotations

import re
from typing import Any

import pytest

from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.guided import Grammar, StructuredOutputs, choice_regex, request_grammar


def _grammar(**fields: Any) -> Grammar | None:
    base: dict[str, Any] = dict(response_format=None, guided_json=None, guided_regex=None, guided_choice=None,
                                guided_grammar=None, structured=None)
    return request_grammar(**(base | fields))


def test_a_choice_matches_each_string_literally_and_nothing_else() -> None:
    choices = ["a.b", "(x|y)", "été 1", "\\d+"]
    pattern = choice_regex(choices)
    # Python reads \x{..} as Rust's regex does only after rewriting it to \x.. / \u....
    python = re.sub(r"\\x\{([0-9a-f]+)\}", lambda m: re.escape(chr(int(m.group(1), 16))), pattern)
    assert all(re.fullmatch(python, choice) for choice in choices)
    assert not any(re.fullmatch(python, other) for other in ("axb", "x", "été", "12", "a.b(x|y)"))


def test_each_field_becomes_its_grammar() -> None:
    assert _grammar() is None
    assert _grammar(response_format='{"type": "object"}') == Grammar("response_format", json_schema='{"type": "object"}')
    assert _grammar(guided_json={"type": "integer"}) == Grammar("guided_json", json_schema='{"type":"integer"}')
    assert _grammar(guided_regex="a+") == Grammar("guided_regex", regex="a+")
    assert _grammar(guided_choice=["x"]) == Grammar("guided_choice", regex="(x)")
    assert _grammar(structured=StructuredOutputs(json_object=True)) == Grammar(
        "structured_outputs", json_schema='{"type": "object"}')
    assert _grammar(structured=StructuredOutputs(choice=["x", "y"])) == Grammar("structured_outputs", regex="(x|y)")


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": "{}", "guided_json": "{}"}, "guided_json"),
    ({"guided_json": "{}", "guided_regex": "a"}, "guided_regex"),
    ({"structured": StructuredOutputs(regex="a", json_object=True)}, "structured_outputs"),
    ({"structured": StructuredOutputs(grammar="root ::= 'a'")}, "structured_outputs"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
])
def test_two_grammars_or_an_ebnf_grammar_are_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        _grammar(**fields)
    assert caught.value.param == param and caught.value.message
