"""Several generations in one request (services/gateway/choices.py): how a request is split into
its choices, and how their streams and results are joined."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from shoal.services.gateway.choices import choice_seed, expand, merged
from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import CompletionRequest, check_num_choices, completion_prompts
from shoal.shared.messages import InferenceRequest, SamplingParams

BASE = InferenceRequest(request_id="abc", model="org/m", params=SamplingParams(max_tokens=4, seed=10),
                        deadline=1.0, reply_to="reply.abc", session_id="s1")


def _reply_subject(wire_id: str) -> str:
    return f"reply.{wire_id}"


def test_one_generation_keeps_the_request_as_it_came() -> None:
    (choice,) = expand(BASE, [{"prompt": "hi"}], 1, _reply_subject)
    assert choice.index == 0 and choice.counts_prompt
    assert choice.request.request_id == "abc" and choice.request.reply_to == "reply.abc"
    assert choice.request.prompt == "hi" and choice.request.params.seed == 10 and choice.request.session_id == "s1"


def test_choices_are_numbered_prompt_by_prompt_with_their_own_ids_and_seeds() -> None:
    choices = expand(BASE, [{"prompt": "a"}, {"prompt_token_ids": [1, 2]}], 3, _reply_subject)
    assert [c.index for c in choices] == list(range(6))
    assert [c.request.request_id for c in choices] == [f"abc-{i}" for i in range(6)]
    assert [c.request.reply_to for c in choices] == [f"reply.abc-{i}" for i in range(6)]
    assert [c.request.prompt for c in choices] == ["a"] * 3 + [None] * 3
    assert [c.request.prompt_token_ids for c in choices] == [None] * 3 + [[1, 2]] * 3
    # choice j of each prompt samples with seed + j: a batch equals its prompts sent one by one
    assert [c.request.params.seed for c in choices] == [10, 11, 12, 10, 11, 12]
    assert [c.counts_prompt for c in choices] == [True, False, False, True, False, False]
    # the session goes with the first choice only; the rest of the request is unchanged
    assert [c.request.session_id for c in choices] == ["s1"] + [None] * 5
    assert all(c.request.params.max_tokens == 4 and c.request.model == "org/m" for c in choices)


def test_unseeded_choices_stay_unseeded_and_seeds_wrap_into_int64() -> None:
    unseeded = InferenceRequest(request_id="x", model="m", params=SamplingParams(max_tokens=1), deadline=1.0,
                                reply_to="r")
    assert [c.request.params.seed for c in expand(unseeded, [{"prompt": "a"}], 2, _reply_subject)] == [None, None]
    assert choice_seed(2**63 - 1, 1) == -(2**63)
    assert choice_seed(2**63 - 2, 1) == 2**63 - 1
    assert choice_seed(-5, 3) == -2


def _completion(prompt: Any) -> CompletionRequest:
    return CompletionRequest(model="m", prompt=prompt)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", [("hi", None)]),
        ([5, 6], [(None, [5, 6])]),
        (["hi"], [("hi", None)]),
        ([[5, 6]], [(None, [5, 6])]),
        (["a", "b"], [("a", None), ("b", None)]),
        ([[1], [2, 3]], [(None, [1]), (None, [2, 3])]),
    ],
)
def test_completion_prompts_one_or_a_batch(prompt: Any, expected: list[tuple[Any, Any]]) -> None:
    prompts = completion_prompts(_completion(prompt), max_chars=100)
    assert [(p["prompt"], p["prompt_token_ids"]) for p in prompts] == expected


@pytest.mark.parametrize("prompt", [["a", ""], [[1], []], [["a"]], [1, "a"], [True], [[-1]], [{"x": 1}]])
def test_bad_prompts_in_a_batch_are_400_naming_prompt(prompt: Any) -> None:
    with pytest.raises(BadRequest) as caught:
        completion_prompts(_completion(prompt), max_chars=100)
    assert caught.value.param == "prompt"


def test_the_character_bound_counts_the_whole_batch() -> None:
    completion_prompts(_completion(["a" * 50, "b" * 50]), max_chars=100)
    with pytest.raises(BadRequest, match="101 characters") as caught:
        completion_prompts(_completion(["a" * 50, "b" * 51]), max_chars=100)
    assert (caught.value.status, caught.value.code) == (400, "context_length_exceeded")


def test_at_most_128_generations_per_request() -> None:
    check_num_choices(64, 2)
    check_num_choices(1, 128)
    with pytest.raises(BadRequest) as caught:
        check_num_choices(2, 65)
    assert caught.value.param == "n" and "130 generations" in caught.value.message
    with pytest.raises(BadRequest) as caught:
        check_num_choices(1, 129)
    assert caught.value.param == "prompt"


async def _items(values: list[Any], delay_s: float = 0.0, fail_after: int | None = None,
                 closed: list[int] | None = None, name: int = 0) -> AsyncIterator[Any]:
    try:
        for i, value in enumerate(values):
            if fail_after is not None and i == fail_after:
                raise BadRequest(f"stream {name} failed")
            await asyncio.sleep(delay_s)
            yield value
    finally:
        if closed is not None:
            closed.append(name)


async def test_merged_yields_every_item_with_its_streams_index_as_it_comes() -> None:
    fast, slow = _items(["a", "b", "c"], 0.001), _items(["x", "y"], 0.02)
    got = [item async for item in merged([slow, fast])]
    assert sorted(got) == [(0, "x"), (0, "y"), (1, "a"), (1, "b"), (1, "c")]
    assert got[0] == (1, "a"), "the fast stream is not held behind the slow one"
    assert [v for i, v in got if i == 1] == ["a", "b", "c"], "each stream keeps its order"


async def test_merged_of_one_stream_is_that_stream() -> None:
    assert [item async for item in merged([_items([1, 2])])] == [(0, 1), (0, 2)]


async def test_the_first_error_ends_the_merge_and_stops_the_other_streams() -> None:
    closed: list[int] = []
    streams = [_items(range(1000), 0.01, closed=closed, name=0), _items([1, 2, 3], 0.0, fail_after=1,
                                                                        closed=closed, name=1)]
    with pytest.raises(BadRequest, match="stream 1 failed"):
        async for _ in merged(streams):
            pass
    assert sorted(closed) == [0, 1], "the still-running stream is cancelled, not left behind"


async def test_leaving_a_merge_early_stops_its_streams() -> None:
    closed: list[int] = []
    events = merged([_items(range(1000), 0.01, closed=closed, name=i) for i in range(3)])
    async for _ in events:
        break
    await events.aclose()
    assert sorted(closed) == [0, 1, 2]
