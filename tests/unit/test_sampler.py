"""The sampler on hand-made logits: which tokens each setting may draw, and the penalties' values."""

from __future__ import annotations

import pytest
import torch

from shoal.services.worker.engine.sampler import (
    MIN_LOGPROB,
    SamplingState,
    TokenHistory,
    sample,
    token_logprobs,
)
from shoal.shared.messages import SamplingParams

# Token 0 most likely, then 1, 2, ...: probabilities 0.4, 0.3, 0.2, 0.06, 0.04.
PROBS = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
LOGITS = PROBS.log()


def _draws(params: SamplingParams, num_draws: int = 400) -> set[int]:
    """Tokens drawn from LOGITS over `num_draws` steps of one seeded request."""
    state = SamplingState.from_params(params)
    drawn: set[int] = set()
    for _ in range(num_draws):
        drawn.update(sample(LOGITS[None, :].clone(), [state]))
    return drawn


def test_temperature_alone_draws_every_token() -> None:
    assert _draws(SamplingParams(temperature=1.0, seed=0)) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize(("top_k", "allowed"), [(1, {0}), (2, {0, 1}), (3, {0, 1, 2}), (0, {0, 1, 2, 3, 4})])
def test_top_k_keeps_the_k_most_likely(top_k: int, allowed: set[int]) -> None:
    assert _draws(SamplingParams(temperature=1.0, top_k=top_k, seed=1)) == allowed


@pytest.mark.parametrize(("min_p", "allowed"), [(0.45, {0, 1, 2}), (0.6, {0, 1}), (0.9, {0}), (0.125, {0, 1, 2, 3})])
def test_min_p_drops_tokens_below_its_fraction_of_the_best(min_p: float, allowed: set[int]) -> None:
    # threshold min_p * 0.4: 0.18, 0.24, 0.36, 0.05 (none on a token's probability)
    assert _draws(SamplingParams(temperature=1.0, min_p=min_p, seed=2)) == allowed


def test_top_k_top_p_and_min_p_combine_to_the_smallest_set() -> None:
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.65, min_p=0.1, seed=3)
    assert _draws(params) == {0, 1}  # top_p 0.65 stops after 0.4 + 0.3


def test_a_seeded_request_draws_the_same_tokens_beside_any_batch() -> None:
    params = SamplingParams(temperature=0.8, top_k=3, min_p=0.05, seed=42)
    alone_state = SamplingState.from_params(params)
    alone = [sample(LOGITS[None, :].clone(), [alone_state])[0] for _ in range(50)]
    batched_state, other = SamplingState.from_params(params), SamplingState.from_params(SamplingParams(seed=7))
    batched = [sample(torch.stack([LOGITS.flip(0), LOGITS]), [other, batched_state])[1] for _ in range(50)]
    assert alone == batched


def test_presence_and_frequency_penalties_subtract_per_generated_token() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    state = SamplingState.from_params(
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    )
    # prompt [0, 0] does not count; generated: token 1 three times, token 3 once
    history = TokenHistory([0, 0, 1, 1, 3, 1], num_prompt_tokens=2)
    # token 1: 2.1 - (0.5 + 3 * 0.25) = 0.85, below token 0's 2.0, which the prompt does not penalize
    logits = torch.tensor([[2.0, 2.1, 0.5, -1.0]])
    assert sample(logits, [state], [history]) == [0]
    assert sample(logits, [state], [TokenHistory([0, 0], num_prompt_tokens=2)]) == [1]
    # token 3: -1.0 - 0.75 = -1.75, below token 2's 0.5 even when token 3 led by a little
    logits = torch.tensor([[-9.0, -9.0, 0.5, 1.2]])
    assert sample(logits, [state], [history]) == [2]
    assert sample(logits, [state], [TokenHistory([0, 0], num_prompt_tokens=2)]) == [3]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    state = SamplingState.from_params(SamplingParams(temperature=0.0, repetition_penalty=2.0))
    history = TokenHistory([1, 2], num_prompt_tokens=1)  # the prompt counts for this one
    # token 1: 3.0 -> 1.5; token 2: -0.5 -> -1.0; unseen token 0 keeps 2.0 and wins
    assert sample(torch.tensor([[2.0, 3.0, -0.5]]), [state], [history]) == [0]
    # all seen and negative: multiplied, so the least negative still wins, now by more
    assert sample(torch.tensor([[-0.2, -0.1, -0.5]]), [state], [TokenHistory([0, 1, 2], 3)]) == [1]


def test_rows_without_penalties_need_no_history_and_are_unchanged() -> None:
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    plain = SamplingState.from_params(SamplingParams(temperature=0.0))
    assert sample(logits, [plain, plain]) == [1, 0]
    penalized = SamplingState.from_params(SamplingParams(temperature=0.0, presence_penalty=2.0))
    histories = [TokenHistory([1], 0), TokenHistory([0], 0)]
    assert sample(logits, [penalized, plain], histories) == [0, 0]
    assert logits.tolist() == [[0.0, 1.0], [1.0, 0.0]], "penalties must not write into the engine's logits"


def test_logit_bias_adds_to_its_tokens_before_the_choice_greedy_or_sampled() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    biased = SamplingState.from_params(SamplingParams(temperature=0.0, logit_bias={0: -100.0, 3: 2.5}))
    # token 0 banned; token 3: -1.0 + 2.5 = 1.5 beats token 1's 1.0
    assert sample(logits, [biased]) == [3]
    assert logits.tolist() == [[2.0, 1.0, 0.5, -1.0]], "the bias must not write into the engine's logits"
    # the forward's argmax (token 0) is not taken for a biased row, and is for the others
    plain = SamplingState.from_params(SamplingParams(temperature=0.0))
    assert sample(torch.cat([logits, logits]), [biased, plain], argmax=torch.tensor([0, 0])) == [3, 0]
    assert sample(torch.cat([logits, logits]), [plain, plain], argmax=torch.tensor([0, 0])) == [0, 0]
    # sampled: a +100 bias makes its token (the least likely) certain; -100 bans tokens 0-2
    certain = SamplingParams(temperature=1.0, seed=4, logit_bias={4: 100.0})
    assert _draws(certain, num_draws=100) == {4}
    banned = SamplingParams(temperature=1.0, seed=5, logit_bias={0: -100.0, 1: -100.0, 2: -100.0})
    assert _draws(banned) == {3, 4}


def test_a_bias_and_penalties_combine() -> None:
    state = SamplingState.from_params(SamplingParams(temperature=0.0, presence_penalty=1.0, logit_bias={2: 0.6}))
    history = TokenHistory([5, 0], num_prompt_tokens=1)  # token 0 generated once: 2.0 - 1.0 = 1.0
    # token 2: 0.5 + 0.6 = 1.1 beats both token 0's 1.0 and token 1's 1.0
    assert sample(torch.tensor([[2.0, 1.0, 0.5, -1.0, -1.0, -1.0]]), [state], [history]) == [2]


def test_logprobs_report_the_raw_distribution_for_the_rows_that_ask() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    states = [SamplingState.from_params(SamplingParams(temperature=0.5, logit_bias={4: 50.0}, logprobs=2)),
              SamplingState.from_params(SamplingParams(temperature=0.0)),
              SamplingState.from_params(SamplingParams(temperature=0.0, logprobs=0))]
    token_ids = sample(logits, states)
    assert token_ids == [4, 4, 0]
    first, second, third = token_logprobs(logits, states, token_ids)
    assert second is None
    # the bias and the temperature chose token 4; its reported log probability is the model's
    assert first is not None and first.token_id == 4 and first.logprob == pytest.approx(PROBS[4].log().item())
    assert [t for t, _ in first.top] == [0, 1]
    assert [v for _, v in first.top] == pytest.approx([PROBS[0].log().item(), PROBS[1].log().item()])
    assert third is not None and third.top == () and third.logprob == pytest.approx(PROBS[0].log().item())
    assert token_logprobs(logits, [states[1]] * 3, token_ids) is None


def test_an_impossible_token_reports_the_floor_not_minus_infinity() -> None:
    logits = torch.tensor([[0.0, float("-inf")]])
    state = SamplingState.from_params(SamplingParams(temperature=1.0, seed=0, logprobs=1))
    (entry,) = token_logprobs(logits, [state], [1])  # as if drawn (it cannot be)
    assert entry is not None and entry.logprob == MIN_LOGPROB


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_the_ending_tokens_until_that_many_are_chosen(temperature: float) -> None:
    """Token 0 ends the request and is by far the likeliest: it is chosen only from the fourth token on."""
    logits = torch.tensor([[9.0, 1.0, 0.5, 0.0, -1.0]])
    state = SamplingState.from_params(SamplingParams(temperature=temperature, seed=5, min_tokens=3),
                                      ending_ids=frozenset({0, 4}))
    chosen = [sample(logits.clone(), [state], argmax=logits.argmax(dim=-1))[0] for _ in range(5)]
    assert all(token not in (0, 4) for token in chosen[:3]) and chosen[3:] == [0, 0], chosen
    unheld = SamplingState.from_params(SamplingParams(temperature=temperature, seed=5, min_tokens=3))
    assert sample(logits.clone(), [unheld])[0] == 0, "nothing to mask without ending tokens (ignore_eos)"


def test_min_tokens_counts_each_row_apart_in_a_batch() -> None:
    logits = torch.tensor([[9.0, 1.0, 0.0], [9.0, 1.0, 0.0]])
    short, long = (SamplingState.from_params(SamplingParams(temperature=0.0, min_tokens=n), ending_ids=frozenset({0}))
                   for n in (1, 2))
    assert [sample(logits.clone(), [short, long]) for _ in range(3)] == [[1, 1], [0, 1], [0, 0]]
