"""The policy's view of the simulated cluster (`ClusterState`): what build_snapshot and the
fairness views say, and that the lighter snapshot of a pass that may not evict decides
exactly as the full one."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

import pytest

from shoal.shared.placement.fairness import IntentView
from shoal.shared.placement.plan import PlacementPlan
from shoal.shared.placement.planner import ClusterPlanner
from shoal.sim.engine import Simulator
from shoal.sim.policies import POLICIES
from shoal.sim.state import ClusterState, SimReplica
from shoal.sim.traces import generate_trace
from tests.unit.test_sim_causality import busy_scenario
from tests.unit.test_sim_engine import two_models

GiB = 1 << 30


def placed(plan: PlacementPlan) -> list[tuple[str, str, str, dict[int, int], str]]:
    return [(p.model, p.replica_id, p.node_id, dict(p.gpu_bytes), p.from_level) for p in plan.placements]


class CheckingSimulator(Simulator):
    """Runs every no-eviction pass twice: on the full snapshot and on the light one, from the
    same random state, and checks that both plans are the same."""

    num_checked = 0

    def run_pass(self, operate: Callable[[ClusterPlanner], object], *, claimant: str | None = None,
                 full_nodes: Collection[int] | None = None, listed_models: Collection[str] = (),
                 commit: bool = True) -> PlacementPlan | None:
        if full_nodes is None or full_nodes or not commit:
            return super().run_pass(operate, claimant=claimant, full_nodes=full_nodes, listed_models=listed_models,
                                    commit=commit)
        rng = random.Random()
        rng.setstate(self.rng.getstate())
        now = self.now
        full = ClusterPlanner(self.state.build_snapshot(now, self.desired, claimant=claimant),
                              config=self.config, rng=rng, clock=lambda: now)
        operate(full)
        expected = full.finish()
        plan = super().run_pass(operate, claimant=claimant, full_nodes=full_nodes, listed_models=listed_models)
        assert plan is not None
        assert placed(plan) == placed(expected)
        assert plan.desired_replicas == expected.desired_replicas
        assert [u.model for u in plan.unplaced] == [u.model for u in expected.unplaced]
        assert plan.evictions == expected.evictions  # only WARM copies superseded ("moved")
        assert all(e.from_level == "WARM" for e in plan.evictions)
        assert self.rng.getstate() == rng.getstate()
        CheckingSimulator.num_checked += 1
        return plan


@pytest.mark.parametrize("policy", ["shoal", "seed", "lru"])
@pytest.mark.parametrize("seed", [11, 12])
def test_a_pass_that_may_not_evict_decides_the_same_on_the_light_snapshot(policy: str, seed: int) -> None:
    scenario = busy_scenario(seed)
    trace = generate_trace(scenario.trace, scenario.models, scenario.seed)
    before = CheckingSimulator.num_checked
    result = CheckingSimulator(scenario, trace, POLICIES[policy]).run()  # type: ignore[index]
    assert CheckingSimulator.num_checked - before > 20
    assert result.counters.get("loads_from_cpu", 0) + result.counters.get("loads_from_disk", 0) > 10


def make_state() -> tuple[ClusterState, Simulator]:
    sim = Simulator(two_models(cluster={"num_nodes": 2, "gpus_per_node": 2}),
                    generate_trace(two_models().trace, two_models().models, 0).truncated(0.0), POLICIES["shoal"])
    return sim.state, sim


def add(state: ClusterState, sim: Simulator, replica_id: str, model: str, node: int, gpu_bytes: dict[int, int],
        *, state_code: int, serving_since: float = 0.0) -> SimReplica:
    replica = SimReplica(replica_id, sim.model_by_key[model], node, dict(gpu_bytes),
                         state.get_slots(node, gpu_bytes), 30 * GiB)
    state.add_replica(replica)
    state.hold(replica)
    replica.state = state_code
    replica.serving_since = serving_since
    return replica


def test_the_snapshot_reads_like_the_schedulers() -> None:
    """Serving replicas inside their minimum runtime and loading ones are protected; draining
    ones are pinned bytes, not replicas; intents pin their bytes for younger claimants only."""
    from shoal.sim.state import LOADING, SERVING

    state, sim = make_state()
    add(state, sim, "old", "a", 0, {0: 20 * GiB}, state_code=SERVING, serving_since=0.0)
    add(state, sim, "young", "b", 0, {1: 20 * GiB}, state_code=SERVING, serving_since=95.0)
    add(state, sim, "loading", "a", 1, {0: 20 * GiB}, state_code=LOADING)
    leaving = add(state, sim, "leaving", "b", 1, {1: 30 * GiB}, state_code=SERVING)
    state.start_leaving(leaving)
    leaving.state = 2  # DRAINING
    state.put_intents("a", {3: 10 * GiB}, since=50.0)
    state.put_intents("b", {3: 15 * GiB}, since=60.0)

    snapshot = state.build_snapshot(100.0, {}, claimant="b")
    first, second = snapshot.nodes
    assert [(r.replica_id, r.protected) for r in first.replicas] == [("old", False), ("young", True)]
    assert [(r.replica_id, r.protected) for r in second.replicas] == [("loading", True)]
    # GPU 1 of node 1: the leaving replica's 30 GiB, plus a's older intent (10 GiB) for b.
    assert dict(second.pinned_gpu_bytes) == {1: 30 * GiB + 10 * GiB}
    assert state.build_snapshot(100.0, {}, claimant="a").nodes[1].pinned_gpu_bytes == {1: 30 * GiB}
    assert state.build_snapshot(100.0, {}, claimant=None).nodes[1].pinned_gpu_bytes == {1: 30 * GiB + 25 * GiB}
    # What b's claim can count on there: the leaving bytes are on their way back; a's are not.
    assert state.get_available_bytes(3, "b", 100.0) == 80 * GiB - 10 * GiB
    # Where a wake would go once leaving replicas are gone: their bytes count as free.
    assert state.build_snapshot(100.0, {}, claimant="a", leaving_is_free=True).nodes[1].pinned_gpu_bytes == {}
    # The light snapshot: other models' replicas are pinned bytes.
    light = state.build_snapshot(100.0, {}, claimant="a", full_nodes=(), listed_models={"a"})
    assert [r.replica_id for r in light.nodes[0].replicas] == ["old"]
    assert dict(light.nodes[0].pinned_gpu_bytes) == {1: 20 * GiB}
    assert state.gpus[3].intents == [IntentView("a", 10 * GiB, 50.0, float("inf")),
                                     IntentView("b", 15 * GiB, 60.0, float("inf"))]
    views = state.get_occupant_views([0, 1], 100.0)
    assert [(v.replica_id, v.serving) for v in views] == [("old", True), ("young", True)]
