"""How many GPUs each policy needs to meet the SLO, by simulating it at several cluster sizes.

For each policy: a grid of GPU counts from `search.min_gpus` to the upper bound (one GPU per
replica of every model, unless `search.max_gpus` says), then bisection, to the GPU, between
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
    """Every run of one policy, by GPU count, and the smallest count that met the SLO."""

    policy: PolicyName
    runs: dict[int, RunResult] = field(default_factory=dict)
    required_gpus: int | None = None

    @property
    def required(self) -> RunResult | None:
        return None if self.required_gpus is None else self.runs[self.required_gpus]

    def sorted_runs(self) -> list[RunResult]:
        return [self.runs[n] for n in sorted(self.runs)]


def get_grid(low: int, high: int, num_points: int) -> list[int]:
    """`num_points` counts spread evenly from `low` to `high` (fewer when the range is narrow),
    ascending."""
    if high <= low:
        return [low]
    step = (high - low) / (num_points - 1)
    return sorted({round(low + i * step) for i in range(num_points)})


def run_once(scenario: Scenario, trace: Trace, policy: PolicyName, num_gpus: int) -> RunResult:
    return Simulator(scenario.with_gpus(num_gpus), trace, POLICIES[policy]).run()


def search_policy(scenario: Scenario, trace: Trace, policy: PolicyName, *,
                  progress: Progress | None = None) -> PolicySearch:
    """The grid, then bisection (see the module doc)."""
    search = PolicySearch(policy)

    def run(num_gpus: int) -> bool:
        if num_gpus not in search.runs:
            result = run_once(scenario, trace, policy, num_gpus)
            search.runs[num_gpus] = result
            if progress is not None:
                progress(result)
        return search.runs[num_gpus].meets_slo

    grid = get_grid(scenario.search.min_gpus, scenario.get_max_gpus(), scenario.search.num_grid_points)
    first_met = next((n for n in grid if run(n)), None)
    if first_met is None:
        return search
    below = [n for n in grid if n < first_met]
    low, high = (below[-1] if below else scenario.search.min_gpus - 1), first_met
    while high - low > 1:
        middle = (low + high) // 2
        if run(middle):
            high = middle
        else:
            low = middle
    search.required_gpus = high
    return search


def compare(scenario: Scenario, trace: Trace, policies: Sequence[PolicyName] | None = None, *,
            num_gpus: int | None = None, progress: Progress | None = None) -> list[PolicySearch]:
    """Every policy of the scenario, searched (or run once at `num_gpus`). After a search, every
    other policy is also run at the size Shoal needs, for a comparison at equal size."""
    searches = []
    for policy in policies or scenario.policies:
        if num_gpus is None:
            searches.append(search_policy(scenario, trace, policy, progress=progress))
            continue
        result = run_once(scenario, trace, policy, num_gpus)
        if progress is not None:
            progress(result)
        searches.append(PolicySearch(policy, {num_gpus: result}, num_gpus if result.meets_slo else None))
    shoal = next((s for s in searches if s.policy == "shoal"), None)
    if num_gpus is None and shoal is not None and shoal.required_gpus is not None:
        for search in searches:
            if shoal.required_gpus not in search.runs:
                result = run_once(scenario, trace, search.policy, shoal.required_gpus)
                search.runs[shoal.required_gpus] = result
                if progress is not None:
                    progress(result)
    return searches
