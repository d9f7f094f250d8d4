"""vLLM's ``truncate_prompt_tokens`` at the gateway: validated, carried to the worker in the
sampling parameters (for embeddings too), refused where it would contradict another field.
How a prompt is cut: tests/unit/test_chat_prompts.py; end to end: tests/e2e/test_openai_client.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shoal.services.gateway.embeddings_api import EMBED_PARAMS, EmbeddingRequest, batches, embed_params
from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import CompletionRequest, decode_body, sampling_params


def _completion(**fields: Any) -> CompletionRequest:
    return decode_body(json.dumps({"model": "m", "prompt": "x", **fields}).encode(), CompletionRequest)


def test_the_cut_reaches_the_sampling_parameters() -> None:
    params = sampling_params(_completion(truncate_prompt_tokens=5), None, 16)
    assert (params.truncate_prompt_tokens, params.truncation_side) == (5, "left")
    assert sampling_params(_completion(), None, 16).truncate_prompt_tokens is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"truncate_prompt_tokens": 0}, "at least one token"),
    ({"truncate_prompt_tokens": 4, "echo": True}, "echo"),
])
def test_a_cut_that_cannot_be_honoured_is_a_400_naming_it(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as caught:
        sampling_params(_completion(**fields), None, 16)
    assert caught.value.param == "truncate_prompt_tokens" and message in caught.value.message


def test_below_minus_one_is_refused_at_decoding() -> None:
    with pytest.raises(BadRequest) as caught:
        _completion(truncate_prompt_tokens=-2)
    assert caught.value.param == "truncate_prompt_tokens"


def test_many_inputs_are_batches_no_larger_than_the_models_queue() -> None:
    body = EmbeddingRequest(model="m", input=[f"text {i}" for i in range(300)])
    assert [len(part.input) for part in batches(body, max_queue=256)] == [128, 128, 44]
    assert [len(part.input) for part in batches(body, max_queue=100)] == [100, 100, 100]
    assert batches(EmbeddingRequest(model="m", input=list(range(300))), 256)[0].input == list(range(300))  # one prompt of ids
    assert [p for part in batches(body, 128) for p in part.input] == body.input


def test_an_embedding_request_carries_its_cut() -> None:
    assert embed_params(EmbeddingRequest(model="m", input="x")) is EMBED_PARAMS
    params = embed_params(EmbeddingRequest(model="m", input="x", truncate_prompt_tokens=-1, truncation_side="right"))
    assert params.embed and (params.truncate_prompt_tokens, params.truncation_side) == (-1, "right")
