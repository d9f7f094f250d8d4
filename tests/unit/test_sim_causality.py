"""The simulated scheduler sees only the past: what it decides before time T cannot depend on
requests that arrive after T.

Two traces share every request before T and differ after it. Every decision logged before
T (loads, evictions, wakes, claims, blocks) and every first token before T must be the same
in both runs. A simulator that peeks at the trace (here: one that pre-places the model of
the trace's last request) is caught by the same comparison.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from shoal.sim.engine import LoggedEvent, Simulator
from shoal.sim.policies import POLICIES
from shoal.sim.scenario import Scenario, parse_scenario
from shoal.sim.traces import Trace, generate_trace

SPLIT_S = 900.0


def busy_scenario(seed: int = 11) -> Scenario:
    """Too many models for the GPUs: wakes, preemptions, idle sleeps, refills."""
    return parse_scenario({
        "seed": seed,
        "cluster": {"num_nodes": 2, "gpus_per_node": 2, "cpu_ram_bytes": "200GiB"},
        "models": [
            {"name": "hot", "params_b": 7.0, "measured_bytes": "40GiB", "replicas": 1},
            {"name": "small", "count": 6, "params_b": 3.0, "measured_bytes": "20GiB", "replicas": 0,
             "fairness": {"min_runtime_s": 20, "max_wait_s": 3}, "sleep": {"idle_timeout_s": 60}},
            {"name": "large", "count": 3, "params_b": 14.0, "measured_bytes": "60GiB", "replicas": 0,
             "fairness": {"min_runtime_s": 20, "max_wait_s": 3}, "sleep": {"idle_timeout_s": 60}},
            {"name": "pair", "params_b": 70.0, "measured_bytes": "140GiB", "num_gpus": 2, "replicas": 0,
             "sleep": {"idle_timeout_s": 60, "level": "cold"}},
        ],
        "trace": {"duration_s": 1800, "arrivals": {"kind": "gamma", "cv": 2.5, "rate_per_s": 1.5},
                  "popularity": {"exponent": 0.9}},
    })


def diverging_traces(scenario: Scenario) -> tuple[Trace, Trace]:
    """The scenario's trace, and one equal to it before SPLIT_S and different after."""
    first = generate_trace(scenario.trace, scenario.models, scenario.seed)
    other = generate_trace(scenario.trace, scenario.models, scenario.seed + 1)
    keep = first.time_s < SPLIT_S
    take = other.time_s >= SPLIT_S
    second = Trace(first.model_keys, np.concatenate([first.time_s[keep], other.time_s[take]]),
                   np.concatenate([first.model[keep], other.model[take]]),
                   np.concatenate([first.prompt_tokens[keep], other.prompt_tokens[take]]),
                   np.concatenate([first.output_tokens[keep], other.output_tokens[take]]), first.duration_s)
    assert not np.array_equal(first.model[~keep], second.model[second.time_s >= SPLIT_S]), "the futures differ"
    return first, second


def decisions_before(sim: Simulator, trace: Trace, split_s: float) -> tuple[list[LoggedEvent], np.ndarray]:
    """What a run decided before `split_s`: its logged events, and the first tokens it gave."""
    sim.run()
    assert sim.events is not None
    events = [e for e in sim.events if e.time_s < split_s]
    early = trace.time_s < split_s
    first_token = trace.time_s[early] + np.frombuffer(sim.metrics.ttft)[: int(early.sum())]
    return events, np.where(first_token < split_s, first_token, np.inf)


class PeekingSimulator(Simulator):
    """Cheats: places, at the start, the model that the trace's last request asks for."""

    def _place_at_start(self) -> None:
        last = self.models[int(self.trace.model[-1])]
        last.desired = max(last.desired, 1)
        self.desired[last.key] = last.desired
        super()._place_at_start()


@pytest.mark.parametrize("policy", ["shoal", "lru", "seed", "dedicated"])
def test_decisions_before_a_time_do_not_depend_on_requests_after_it(policy: str) -> None:
    scenario = busy_scenario()
    first, second = diverging_traces(scenario)
    runs = [decisions_before(Simulator(scenario, trace, POLICIES[policy], record_events=True), trace, SPLIT_S)
            for trace in (first, second)]  # type: ignore[index]
    (first_events, first_tokens), (second_events, second_tokens) = runs
    assert first_events == second_events
    assert np.array_equal(first_tokens, second_tokens)
    assert len(first_events) > 10, "the prefix has decisions to compare"
    if policy == "shoal":
        kinds = {e.kind for e in first_events}
        assert {"wake", "evict", "claimed"} <= kinds, "the prefix exercises wakes and evictions"


def test_the_comparison_catches_a_simulator_that_peeks_at_the_trace() -> None:
    scenario = busy_scenario()
    first, second = diverging_traces(scenario)
    if first.model[-1] == second.model[-1]:
        second = Trace(second.model_keys, second.time_s, np.concatenate([second.model[:-1], [(first.model[-1] + 1) % 11]]
                                                                        ).astype(np.int32),
                       second.prompt_tokens, second.output_tokens, second.duration_s)
    runs = [decisions_before(PeekingSimulator(scenario, trace, POLICIES["shoal"], record_events=True), trace, SPLIT_S)
            for trace in (first, second)]
    assert runs[0][0] != runs[1][0]


RUN_DIGEST = """
import hashlib, numpy as np
from tests.unit.test_sim_causality import busy_scenario
from shoal.sim.engine import Simulator
from shoal.sim.policies import POLICIES
from shoal.sim.traces import generate_trace
scenario = busy_scenario()
trace = generate_trace(scenario.trace, scenario.models, scenario.seed)
sim = Simulator(scenario, trace, POLICIES["shoal"], record_events=True)
sim.run()
print(hashlib.sha256(repr(sim.events).encode() + np.frombuffer(sim.metrics.ttft).tobytes()).hexdigest())
"""


def test_results_do_not_depend_on_the_process_hash_seed() -> None:
    """Set and dict orders of strings change with PYTHONHASHSEED; the results must not."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run([sys.executable, "-c", RUN_DIGEST], cwd=root, env=env, capture_output=True, text=True,
                              check=True, timeout=120)
        digests.add(done.stdout.strip())
    scenario = busy_scenario()
    trace = generate_trace(scenario.trace, scenario.models, scenario.seed)
    sim = Simulator(scenario, trace, POLICIES["shoal"], record_events=True)
    sim.run()
    digests.add(hashlib.sha256(repr(sim.events).encode() + np.frombuffer(sim.metrics.ttft).tobytes()).hexdigest())
    assert len(digests) == 1
