"""The session cache's cost model: its formula, the non-negative fits, and saved profiles."""

from __future__ import annotations

import itertools
import math

import pytest

from shoal.shared.kv_cache.cost_model import (
    CostModel,
    CostProfile,
    PrefillSample,
    SwapSample,
    fit_prefill_costs,
    fit_swap_costs,
)


def test_rebuild_cost_is_linear_in_the_context() -> None:
    costs = CostModel(seconds_per_token=2e-4, seconds_per_token_pair=1e-7, seconds_per_pass=5e-3)
    step = [costs.get_rebuild_seconds(64, context) for context in (0, 512, 1024, 1536)]
    differences = [b - a for a, b in itertools.pairwise(step)]
    assert all(math.isclose(d, 64 * 512 * 1e-7) for d in differences)
    # 64 tokens at context 0: 64 x 2e-4 + (64 x 65 / 2) x 1e-7; the pass's fixed cost only
    # in a whole prefill.
    assert math.isclose(step[0], 64 * 2e-4 + 2080 * 1e-7)
    assert math.isclose(costs.get_prefill_seconds(64, 0), step[0] + 5e-3)
    assert costs.get_prefill_seconds(0, 100) == 0.0
    # Recomputing a leading run of chunks in one pass costs the sum of its chunks' rebuilds.
    whole = costs.get_rebuild_seconds(128, 0)
    assert math.isclose(whole, costs.get_rebuild_seconds(64, 0) + costs.get_rebuild_seconds(64, 64))


def test_costs_must_be_finite_and_non_negative() -> None:
    with pytest.raises(ValueError, match="seconds_per_token must be"):
        CostModel(seconds_per_token=-1.0, seconds_per_token_pair=0.0)
    with pytest.raises(ValueError, match="swap_seconds_per_block"):
        CostModel(seconds_per_token=0.0, seconds_per_token_pair=0.0, swap_seconds_per_block=math.inf)


def test_the_fit_recovers_the_constants_of_timed_passes() -> None:
    truth = CostModel(seconds_per_token=3e-5, seconds_per_token_pair=2e-8, seconds_per_pass=4e-3)
    samples = [
        PrefillSample(n, ctx, truth.get_prefill_seconds(n, ctx) * (1 + 0.01 * ((n + ctx) % 3 - 1)))
        for n in (64, 256)
        for ctx in (0, 448, 896, 1792)
    ]
    per_pass, per_token, per_pair = fit_prefill_costs(samples)
    assert per_pass == pytest.approx(4e-3, rel=0.1)
    assert per_token == pytest.approx(3e-5, rel=0.1)
    assert per_pair == pytest.approx(2e-8, rel=0.1)


def test_a_fit_never_goes_negative() -> None:
    # Noise that makes the unconstrained fit's attention term negative: attention too small
    # to see, so the best non-negative fit sets it to zero.
    samples = [
        PrefillSample(64, 0, 0.0101),
        PrefillSample(64, 1000, 0.0099),
        PrefillSample(256, 0, 0.0302),
        PrefillSample(256, 1000, 0.0298),
    ]
    per_pass, per_token, per_pair = fit_prefill_costs(samples)
    assert per_pair == 0.0 and per_token > 0 and per_pass >= 0
    per_call, per_block = fit_swap_costs([SwapSample(4, 1e-4), SwapSample(16, 3.4e-4), SwapSample(64, 1.3e-3)])
    assert per_block == pytest.approx(2e-5, rel=0.05) and per_call >= 0


def test_too_few_or_degenerate_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        fit_prefill_costs([PrefillSample(64, 0, 0.01)])
    with pytest.raises(ValueError, match="at least 2"):
        fit_swap_costs([SwapSample(4, 0.1)])


def test_a_profile_round_trips_and_bad_ones_say_what_is_wrong() -> None:
    profile = CostProfile("llama:layers=4", CostModel(1e-4, 1e-7, 2e-3, 1e-5, 3e-5), num_samples=11)
    assert CostProfile.from_json(profile.to_json()) == profile
    for data, message in [
        (b"{", "not JSON"),
        (b"[]", "string 'key'"),
        (b'{"key": "k"}', "object 'cost_model'"),
        (b'{"key": "k", "cost_model": {"seconds_per_token": "1"}}', "must be a number"),
        (b'{"key": "k", "cost_model": {"seconds_per_token": 1e-4}}', "seconds_per_token_pair"),
        (b'{"key": "k", "cost_model": {"x": 1}}', "unknown cost_model fields"),
        (b'{"key": "k", "cost_model": {"seconds_per_token": -1, "seconds_per_token_pair": 0}}', ">= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            CostProfile.from_json(data)


def test_timings_that_show_no_growth_are_charged_to_the_tokens() -> None:
    # A busy machine: the pass time does not grow with tokens or context at all. A model
    # with only a fixed cost would make every rebuild free; the time goes to the tokens.
    samples = [PrefillSample(n, ctx, 0.2) for n in (64, 256) for ctx in (0, 1000)]
    per_pass, per_token, per_pair = fit_prefill_costs(samples)
    assert per_pass == 0.0 and (per_token > 0 or per_pair > 0)
