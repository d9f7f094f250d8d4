"""How many GPUs each policy needs to meet the SLO, by simulating it at several cluster sizes.

For each policy: a grid of node counts from `search.min_nodes` to the upper bound (room for
one GPU per replica of every model, unless `search.max_nodes` says), then bisection between
the grid's largest size that misses the target and the smallest that meets it. Every run is
kept (the attainment-vs-GPUs plot shows them all). SLO attainment is assumed to grow with
the cluster; the table reports the smallest size found that meets it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shoal.sim.engine import Simulator
from shoal.sim.metrics import RunResult
from shoal.sim.policies import POLICIES
from shoal.sim.scenario import PolicyName, Scenario
from shoal.sim.traces import Trace

Progress = Callable[[RunResult], None]


@dataclass
class PolicySearch:
    """Every run of one policy, by node count, and the smallest count that met the SLO."""

    policy: PolicyName
    runs: dict[int, RunResult] = field(default_factory=dict)
    required_nodes: int | None = None

    @property
    def required(self) -> RunResult | None:
        return None if self.required_nodes is None else self.runs[self.required_nodes]

    def sorted_runs(self) -> list[RunResult]:
        return [self.runs[n] for n in sorted(self.runs)]


def get_grid(min_nodes: int, max_nodes: int, num_points: int) -> list[int]:
    """`num_points` node counts spread evenly from `min_nodes` to `max_nodes` (fewer when the
    range is narrow), ascending."""
    if max_nodes <= min_nodes:
        return [min_nodes]
    step = (max_nodes - min_nodes) / (num_points - 1)
    return sorted({round(min_nodes + i * step) for i in range(num_points)})


def run_once(scenario: Scenario, trace: Trace, policy: PolicyName, num_nodes: int) -> RunResult:
    return Simulator(scenario.with_nodes(num_nodes), trace, POLICIES[policy]).run()


def search_policy(scenario: Scenario, trace: Trace, policy: PolicyName, *,
                  progress: Progress | None = None) -> PolicySearch:
    """The grid, then bisection (see the module doc)."""
    search = PolicySearch(policy)

    def run(num_nodes: int) -> bool:
        if num_nodes not in search.runs:
            result = run_once(scenario, trace, policy, num_nodes)
            search.runs[num_nodes] = result
            if progress is not None:
                progress(result)
        return search.runs[num_nodes].meets_slo

    grid = get_grid(scenario.search.min_nodes, scenario.get_max_nodes(), scenario.search.num_grid_points)
    first_met = next((n for n in grid if run(n)), None)
    if first_met is None:
        return search
    below = [n for n in grid if n < first_met]
    low, high = (below[-1] if below else scenario.search.min_nodes - 1), first_met
    while high - low > 1:
        middle = (low + high) // 2
        if run(middle):
            high = middle
        else:
            low = middle
    search.required_nodes = high
    return search


def compare(scenario: Scenario, trace: Trace, policies: Sequence[PolicyName] | None = None, *,
            num_nodes: int | None = None, progress: Progress | None = None) -> list[PolicySearch]:
    """Every policy of the scenario, searched (or run once at `num_nodes`)."""
    searches = []
    for policy in policies or scenario.policies:
        if num_nodes is None:
            searches.append(search_policy(scenario, trace, policy, progress=progress))
            continue
        result = run_once(scenario, trace, policy, num_nodes)
        if progress is not None:
            progress(result)
        searches.append(PolicySearch(policy, {num_nodes: result}, num_nodes if result.meets_slo else None))
    return searches
