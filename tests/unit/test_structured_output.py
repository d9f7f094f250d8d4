"""Structured output (services/worker/engine/structured.py): a JSON schema or a regular
expression as a token mask, on the demo models' real tokenizer; and what a grammar or
tokenizer it cannot use gets."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from shoal.services.worker.engine.sampler import SamplingState, sample
from shoal.services.worker.engine.structured import MAX_WHITESPACE, Grammars, mask_rows
from shoal.services.worker.generation import RequestRejected
from shoal.shared.messages import SamplingParams
from tests.token_echo import TokenEcho

SCHEMA = json.dumps({"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
                     "required": ["color", "ok"], "additionalProperties": False})
JSON = SamplingParams(json_schema=SCHEMA)


@pytest.fixture(scope="module")
def tokenizer(demo_models_root: Path) -> object:
    return AutoTokenizer.from_pretrained(demo_models_root / "demo" / "llama-5m")


def test_the_mask_allows_only_what_the_schema_allows_next(tokenizer: object) -> None:
    grammars = Grammars(tokenizer)
    started = grammars.matcher(JSON)
    for token_id in tokenizer.encode('{"color":"re', add_special_tokens=False):
        started.advance(token_id)
    logits = torch.zeros(3, len(tokenizer) + 7)  # the model's rows may outnumber the tokenizer's
    mask_rows(logits, [2, 0], [grammars.matcher(JSON), started])
    assert torch.isfinite(logits[1]).all(), "a row without a grammar is left alone"
    opening = [tokenizer.decode([t]) for t in torch.isfinite(logits[2]).nonzero().flatten().tolist()]
    assert opening and all(text.lstrip(" \t\r\n").startswith("{") or not text.strip() for text in opening)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and max(allowed) < len(tokenizer)
    assert all("red".startswith("re" + tokenizer.decode([t]).split('"')[0]) for t in allowed), \
        [tokenizer.decode([t]) for t in allowed]


def test_greedy_and_sampled_rows_write_json_that_matches_and_then_end(tokenizer: object) -> None:
    eos = tokenizer.eos_token_id
    grammars = Grammars(tokenizer)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, seed=3)):
        state = SamplingState.from_params(params)
        state.matcher = grammars.matcher(JSON)
        generator = torch.Generator().manual_seed(7)
        token_ids: list[int] = []
        while not token_ids or token_ids[-1] != eos:
            logits = torch.randn(1, len(tokenizer), generator=generator)  # a model that knows no JSON
            token_ids += sample(logits, [state])
            assert len(token_ids) < 200, "the grammar must end the text"
        text = tokenizer.decode(token_ids[:-1])
        assert json.loads(text)["color"] in ("red", "green") and set(json.loads(text)) == {"color", "ok"}
        assert " " * (MAX_WHITESPACE + 1) not in text


def test_an_object_that_lists_its_properties_takes_no_other_key(tokenizer: object) -> None:
    """No ``additionalProperties`` in the schema (as pydantic writes it): after the one property,
    only the object's end may come, not another key."""
    schema = json.dumps({"type": "object", "properties": {"color": {"enum": ["red", "green"]}}})
    matcher = Grammars(tokenizer).matcher(SamplingParams(json_schema=schema))
    for token_id in tokenizer.encode('{"color":"red"', add_special_tokens=False):
        matcher.advance(token_id)
    logits = torch.zeros(1, len(tokenizer))
    mask_rows(logits, [0], [matcher])
    allowed = [tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()]
    assert allowed and all(text.strip() in ("", "}") or text.strip().startswith("}") for text in allowed), allowed


def test_an_unusable_schema_or_tokenizer_is_a_400_naming_response_format(tokenizer: object) -> None:
    for schema in ('{"type": 5}', "not json", '{"$ref": "#/nowhere"}'):
        with pytest.raises(RequestRejected) as caught:
            Grammars(tokenizer).matcher(SamplingParams(json_schema=schema))
        assert caught.value.param == "response_format" and caught.value.status == 400
    with pytest.raises(RequestRejected) as caught:
        Grammars(TokenEcho()).matcher(JSON)
    assert caught.value.param == "response_format"


def _generate(tokenizer: object, matcher_params: SamplingParams, params: SamplingParams) -> str:
    """The text a model that knows nothing writes under the grammar, up to its end-of-sequence."""
    state = SamplingState.from_params(params)
    state.matcher = Grammars(tokenizer).matcher(matcher_params)
    generator = torch.Generator().manual_seed(11)
    token_ids: list[int] = []
    while not token_ids or token_ids[-1] != tokenizer.eos_token_id:
        token_ids += sample(torch.randn(1, len(tokenizer), generator=generator), [state])
        assert len(token_ids) < 100, "the grammar must end the text"
    return str(tokenizer.decode(token_ids[:-1]))


def test_a_regex_shapes_the_text_and_then_ends_it(tokenizer: object) -> None:
    regex = SamplingParams(regex=r"[0-9]{3}-[a-z]{2}", grammar_param="guided_regex")
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, seed=4)):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", _generate(tokenizer, regex, params))


def test_an_unusable_regex_is_a_400_naming_its_field(tokenizer: object) -> None:
    with pytest.raises(RequestRejected) as caught:
        Grammars(tokenizer).matcher(SamplingParams(regex="(unclosed", grammar_param="guided_regex"))
    assert caught.value.param == "guided_regex" and "regular expression" in str(caught.value)
