"""Trace generators: their statistics on large samples, and CSV replay and conversion."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from shoal.sim.scenario import ArrivalSpec, ModelGroup, ScenarioError, TokenSpec, parse_scenario
from shoal.sim.traces import (
    convert_azure,
    draw_renewal,
    draw_tokens,
    fit_zipf_exponent,
    generate_arrivals,
    generate_trace,
    get_head_share,
    get_zipf_shares,
    rank_models,
    read_trace_csv,
    write_trace_csv,
)


def cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


def fit_exponent(counts: np.ndarray) -> float:
    """Maximum-likelihood Zipf exponent of per-rank counts (ranks 1..n): the mean log rank of
    the data equals the model's."""
    ranks = np.arange(1, len(counts) + 1)
    observed = float((counts * np.log(ranks)).sum() / counts.sum())
    low, high = 0.0, 10.0
    for _ in range(80):
        middle = (low + high) / 2
        shares = get_zipf_shares(len(counts), middle)
        if float((shares * np.log(ranks)).sum()) > observed:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def test_poisson_arrivals_have_the_rate_and_a_cv_of_one() -> None:
    times = draw_renewal(np.random.default_rng(1), 50.0, 4000.0, ArrivalSpec(kind="poisson"))
    assert len(times) / 4000.0 == pytest.approx(50.0, rel=0.02)
    assert cv(times) == pytest.approx(1.0, rel=0.02)
    assert times.min() >= 0 and times.max() < 4000.0 and np.all(np.diff(times) >= 0)


@pytest.mark.parametrize("target_cv", [0.5, 2.0, 4.0])
def test_gamma_arrivals_have_the_rate_and_the_cv(target_cv: float) -> None:
    times = draw_renewal(np.random.default_rng(2), 20.0, 20000.0, ArrivalSpec(kind="gamma", cv=target_cv))
    assert len(times) / 20000.0 == pytest.approx(20.0, rel=0.04)
    assert cv(times) == pytest.approx(target_cv, rel=0.05)


@pytest.mark.parametrize("exponent", [0.8, 1.2, 2.0])
def test_model_popularity_follows_the_zipf_exponent(exponent: float) -> None:
    shares = get_zipf_shares(50, exponent)
    times, models = generate_arrivals(np.random.default_rng(3), shares, 2000.0,
                                      ArrivalSpec(kind="poisson", rate_per_s=200.0))
    counts = np.bincount(models, minlength=50)
    assert fit_exponent(counts) == pytest.approx(exponent, abs=0.03)
    assert len(times) / 2000.0 == pytest.approx(200.0, rel=0.02)
    assert np.all(np.diff(times) >= 0)


def test_the_fitted_exponent_reproduces_the_published_skew() -> None:
    """Aegaeon (SOSP '25): 94.1% of the models receive 1.35% of the requests."""
    for num_models in (20, 100, 500):
        exponent = fit_zipf_exponent(num_models, 0.059, 0.9865)
        assert get_head_share(num_models, exponent, 0.059) == pytest.approx(0.9865, abs=1e-6)
    scenario = parse_scenario({
        "models": [{"name": "m", "count": 100, "params_b": 1.0, "measured_bytes": "4GiB"}],
        "trace": {"duration_s": 3600.0, "arrivals": {"rate_per_s": 100.0}},
    })
    trace = generate_trace(scenario.trace, scenario.models, 0)
    counts = np.bincount(trace.model, minlength=100)
    tail_share = counts[6:].sum() / counts.sum()  # the 94 least popular of 100
    assert tail_share == pytest.approx(0.0135, abs=0.002)


def test_a_diurnal_rate_keeps_the_mean_and_peaks_when_told() -> None:
    spec = ArrivalSpec(kind="poisson", rate_per_s=20.0, diurnal_amplitude=0.5, diurnal_period_s=86400.0,
                       diurnal_peak_s=14 * 3600.0)
    times, _ = generate_arrivals(np.random.default_rng(4), np.array([0.5, 0.5]), 86400.0, spec)
    assert len(times) / 86400.0 == pytest.approx(20.0, rel=0.01)
    hourly = np.bincount((times // 3600).astype(int), minlength=24)
    assert int(np.argmax(hourly)) in (13, 14)
    assert int(np.argmin(hourly)) in (1, 2)
    # rate(t) = 20 (1 + 0.5 cos(2 pi (t - 14 h) / 24 h)); over the two hours around the peak
    # (and the trough) the cosine averages +-sin(pi / 12) / (pi / 12).
    mean_cos = math.sin(math.pi / 12) / (math.pi / 12)
    assert hourly[13:15].mean() == pytest.approx(20 * 3600 * (1 + 0.5 * mean_cos), rel=0.02)
    assert hourly[1:3].mean() == pytest.approx(20 * 3600 * (1 - 0.5 * mean_cos), rel=0.03)


def test_token_lengths_are_lognormal_around_the_median_and_clipped() -> None:
    spec = TokenSpec(prompt_tokens=1000, output_tokens=100, prompt_sigma=1.0, output_sigma=0.5,
                     max_prompt_tokens=5000, max_output_tokens=300)
    prompts, outputs = draw_tokens(np.random.default_rng(5), 200_000, spec)
    assert float(np.median(prompts)) == pytest.approx(1000, rel=0.02)
    assert float(np.median(outputs)) == pytest.approx(100, rel=0.02)
    assert prompts.max() == 5000 and outputs.max() == 300 and prompts.min() >= 1
    assert float(np.log(outputs[outputs < 300]).std()) == pytest.approx(0.5, rel=0.1)
    fixed = draw_tokens(np.random.default_rng(5), 3, TokenSpec(kind="fixed", prompt_tokens=7, output_tokens=9))
    assert fixed[0].tolist() == [7, 7, 7] and fixed[1].tolist() == [9, 9, 9]


def test_models_are_ranked_round_robin_across_groups() -> None:
    groups = [ModelGroup(name="a", count=3, params_b=1.0, measured_bytes=1),
              ModelGroup(name="b", count=1, params_b=1.0, measured_bytes=1),
              ModelGroup(name="c", count=2, params_b=1.0, measured_bytes=1)]
    assert rank_models(groups, interleave=True) == ["a-000", "b", "c-000", "a-001", "c-001", "a-002"]
    assert rank_models(groups, interleave=False) == ["a-000", "a-001", "a-002", "b", "c-000", "c-001"]


def test_a_trace_written_as_csv_reads_back_the_same(tmp_path: Path) -> None:
    scenario = parse_scenario({
        "models": [{"name": "m", "count": 5, "params_b": 1.0, "measured_bytes": "4GiB"}],
        "trace": {"duration_s": 600.0, "arrivals": {"kind": "gamma", "cv": 2.0, "rate_per_s": 3.0}},
    })
    trace = generate_trace(scenario.trace, scenario.models, 9)
    path = tmp_path / "trace.csv"
    write_trace_csv(trace, path)
    again = read_trace_csv(path, trace.model_keys, duration_s=600.0)
    assert np.allclose(again.time_s, trace.time_s, atol=1e-6)
    for name in ("model", "prompt_tokens", "output_tokens"):
        assert np.array_equal(getattr(again, name), getattr(trace, name))


@pytest.mark.parametrize(("text", "needle"), [
    ("when,model,prompt_tokens,output_tokens\n", "the first line must be"),
    ("time_s,model,prompt_tokens,output_tokens\n1.0,zzz,10,10\n", ":2: model 'zzz' is not in the scenario's catalog"),
    ("time_s,model,prompt_tokens,output_tokens\n1.0,a,10,10\nx,a,1,1\n", ":3: expected time_s,model"),
    ("time_s,model,prompt_tokens,output_tokens\n1.0,a,0,10\n", ":2: time_s must be >= 0 and token counts >= 1"),
])
def test_a_bad_csv_trace_is_an_error_naming_the_line(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ScenarioError) as caught:
        read_trace_csv(path, ["a"])
    assert needle in str(caught.value)


def test_the_azure_trace_is_spread_over_the_models_by_popularity(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(4000):
        lines.append(f"2023-11-16 18:{15 + i // 3600 % 40:02d}:{i % 60:02d}.{i:07d},{100 + i % 7},{20 + i % 5}")
    path.write_text("\n".join(lines) + "\n")
    keys = [f"m{i}" for i in range(10)]
    trace = convert_azure(path, keys, exponent=1.5, seed=1, time_scale=2.0)
    assert len(trace) == 4000 and trace.time_s[0] == 0.0
    assert trace.time_s.max() <= 60 * 60 / 2.0
    assert sorted(set(trace.prompt_tokens.tolist())) == list(range(100, 107))
    counts = np.bincount(trace.model, minlength=10)
    assert counts[0] > counts[1] > counts[5]
    assert counts[0] / 4000 == pytest.approx(float(get_zipf_shares(10, 1.5)[0]), abs=0.03)
    with pytest.raises(ScenarioError, match="not an Azure LLM trace"):
        convert_azure(_bad_azure(tmp_path), keys, exponent=1.0, seed=1)


def _bad_azure(tmp_path: Path) -> Path:
    path = tmp_path / "bad_azure.csv"
    path.write_text("time,a,b\n1,2,3\n")
    return path


def test_zipf_shares_sum_to_one_and_fall_with_rank() -> None:
    shares = get_zipf_shares(30, 1.1)
    assert math.isclose(float(shares.sum()), 1.0)
    assert np.all(np.diff(shares) < 0)
    assert np.allclose(get_zipf_shares(4, 0.0), 0.25)
