"""The swap benchmark's pure parts: the trace window, the Zipf model draw, the summary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import itertools

import swap_workload as sw

TRACE = [(0.0, 100, 10), (1.5, 5000, 900), (2.0, 3, 1), (9.0, 50, 5)]


def test_zipf_weights_fall_as_a_power_of_the_rank() -> None:
    weights = sw.zipf_weights(6, 1.1)
    assert sum(weights) == pytest.approx(1.0)
    assert weights[0] / weights[1] == pytest.approx(2**1.1)
    assert weights == sorted(weights, reverse=True)
    assert weights[0] == pytest.approx(0.436, abs=0.001) and weights[-1] == pytest.approx(0.061, abs=0.001)


def test_the_window_keeps_arrivals_relative_to_its_start_and_caps_tokens() -> None:
    requests = sw.make_requests(TRACE, ["a", "b"], start_s=1.0, window_s=5.0, exponent=1.0, max_prompt_tokens=256,
                                max_output_tokens=16, seed=0)
    assert [(r.at_s, r.num_prompt_tokens, r.num_output_tokens) for r in requests] == [(0.5, 256, 16), (1.0, 3, 1)]


def test_the_model_draw_is_seeded_and_follows_the_weights() -> None:
    trace = [(i * 0.01, 10, 10) for i in range(20_000)]
    first = sw.make_requests(trace, ["a", "b", "c"], start_s=0, window_s=1e9, exponent=1.0, max_prompt_tokens=9,
                             max_output_tokens=9, seed=7)
    again = sw.make_requests(trace, ["a", "b", "c"], start_s=0, window_s=1e9, exponent=1.0, max_prompt_tokens=9,
                             max_output_tokens=9, seed=7)
    assert first == again
    share_a = sum(r.model == "a" for r in first) / len(first)
    assert share_a == pytest.approx(sw.zipf_weights(3, 1.0)[0], abs=0.02)


def test_the_real_trace_reads_as_seconds_from_its_first_request() -> None:
    if not sw.TRACE.is_file():
        pytest.skip(f"the trace is not at {sw.TRACE}")
    trace = sw.read_trace()
    assert trace[0][0] == 0.0 and len(trace) == 19366
    assert all(b[0] >= a[0] for a, b in itertools.pairwise(trace))
    assert 3000 < trace[-1][0] < 3700, "about one hour"


def test_the_summary_counts_failures_and_names_the_longest_wait() -> None:
    summary = sw.summarize("shoal", [("a", 0.1), ("b", 2.0), ("a", None), ("c", 0.3)], num_swaps=6, duration_s=120)
    assert (summary.num_requests, summary.num_failed) == (4, 1)
    assert (summary.longest_wait_s, summary.longest_wait_model) == (2.0, "b")
    assert summary.ttft_p50_s == 0.3 and summary.ttft_p99_s == 2.0
    assert summary.swaps_per_minute == 3.0
    assert "| shoal | 4 | 1 |" in sw.render_replay_table([summary])
