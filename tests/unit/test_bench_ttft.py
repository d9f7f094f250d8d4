"""The TTFT benchmark's pure parts: per-side figures, the table, the rounds' order.

The benchmark itself (`shoal up`, llama-server, a model in this process) is not run here;
see docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_ttft  # noqa: E402
from bench_ttft import Side, Timing  # noqa: E402


def make_side(name: str, rounds: list[list[float]], per_token_s: float = 0.001) -> Side:
    return Side(name, [[Timing(ttft_s, per_token_s) for ttft_s in r] for r in rounds])


def test_side_figures_are_medians_over_requests_and_rounds() -> None:
    side = make_side("gateway", [[0.010, 0.030, 0.020], [0.012, 0.014, 0.100]])
    assert side.get_ttft_ms() == 17.0  # median of all six: (0.014 + 0.020) / 2
    assert side.get_best_round_ttft_ms() == 14.0  # round medians 20 and 14 ms
    assert side.get_per_token_ms() == 1.0


def test_table_gives_each_side_as_a_multiple_of_the_baseline() -> None:
    sides = [make_side("engine", [[0.010]]), make_side("gateway", [[0.018]], 0.0005),
             make_side("llama.cpp", [[0.012]])]
    table = bench_ttft.render_table(sides, "llama.cpp")
    lines = table.splitlines()
    assert lines[0].endswith("| TTFT / llama.cpp |")
    assert lines[2] == "| engine | 10.00 | 10.00 | 1.000 (1,000) | 0.83 |"
    assert lines[3] == "| gateway | 18.00 | 18.00 | 0.500 (2,000) | 1.50 |"
    assert lines[4] == "| llama.cpp | 12.00 | 12.00 | 1.000 (1,000) | 1.00 |"


def test_table_without_the_baseline_has_no_ratio_column() -> None:
    table = bench_ttft.render_table([make_side("engine", [[0.010]])], "llama.cpp")
    assert "TTFT /" not in table
    assert table.splitlines()[2] == "| engine | 10.00 | 10.00 | 1.000 (1,000) |"


def test_rounds_alternate_the_order_of_the_sides() -> None:
    names = ["engine", "gateway", "llama.cpp"]
    assert bench_ttft.get_round_order(names, 0) == names
    assert bench_ttft.get_round_order(names, 1) == ["llama.cpp", "gateway", "engine"]
    assert bench_ttft.get_round_order(names, 2) == names


def test_arguments_are_checked() -> None:
    args = bench_ttft.parse_args(["--model", "demo/llama-100m", "--threads", "2", "--no-llama"])
    assert (args.model, args.threads, args.no_llama, args.prompt_tokens, args.max_tokens) == (
        "demo/llama-100m", 2, True, 64, 128)
    with pytest.raises(SystemExit) as exited:
        bench_ttft.parse_args(["--max-tokens", "1"])
    assert exited.value.code == 2
