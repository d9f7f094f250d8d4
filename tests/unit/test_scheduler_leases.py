"""Model leases of a placement pass: who holds one, taking and releasing it, what a plan leases."""

from __future__ import annotations

from shoal.services.scheduler.leases import get_touched_models, is_leased_by_other, release_lease, take_lease
from shoal.shared.messages import ModelSpec
from shoal.shared.placement.plan import Eviction, Placement, PlacementPlan
from shoal.shared.placement.snapshot import CandidateLevel

NOW = 1_000.0
SPEC = ModelSpec(key="org/m", path="org/m", desired_replicas=2)


def _leased(owner: str | None, until: float | None) -> ModelSpec:
    return ModelSpec(key="org/m", path="org/m", desired_replicas=2, lease_owner=owner, lease_until=until)


def test_only_another_schedulers_unlapsed_lease_keeps_a_pass_out() -> None:
    assert not is_leased_by_other(SPEC, "s1", NOW)
    assert is_leased_by_other(_leased("s2", NOW + 5.0), "s1", NOW)
    assert not is_leased_by_other(_leased("s1", NOW + 5.0), "s1", NOW), "its own lease never stops a scheduler"
    assert not is_leased_by_other(_leased("s2", NOW), "s1", NOW), "lapsed at lease_until"
    assert not is_leased_by_other(_leased("s2", NOW - 1.0), "s1", NOW)
    assert not is_leased_by_other(_leased("s2", None), "s1", NOW)


def test_a_lease_names_its_owner_until_now_plus_the_ttl_and_changes_nothing_else() -> None:
    leased = take_lease(SPEC, "s1", NOW, 60.0)
    assert leased == _leased("s1", NOW + 60.0)


def test_releasing_writes_the_plans_desired_count_or_keeps_the_specs() -> None:
    assert release_lease(_leased("s1", NOW + 60.0), "s1", 5) == ModelSpec(key="org/m", path="org/m",
                                                                         desired_replicas=5)
    assert release_lease(_leased("s1", NOW + 60.0), "s1", None) == SPEC
    assert release_lease(_leased("s1", NOW + 60.0), "s1", 0) == ModelSpec(key="org/m", path="org/m")


def test_a_lease_that_is_not_ours_or_a_model_that_is_gone_is_left_alone() -> None:
    assert release_lease(_leased("s2", NOW + 60.0), "s1", 5) is None
    assert release_lease(SPEC, "s1", 5) is None
    assert release_lease(None, "s1", 5) is None


def _placement(model: str, replica_id: str) -> Placement:
    return Placement(model=model, replica_id=replica_id, node_id="n0", gpu_bytes={0: 1}, gpu_memory_fraction=0.1,
                     kind="fractional", from_level="COLD", candidate_level=CandidateLevel.FREE,
                     memory_source="measured", cpu_bytes=1)


def _eviction(model: str, replica_id: str) -> Eviction:
    return Eviction(model=model, replica_id=replica_id, node_id="n0", from_level="HOT", to_level="WARM",
                    freed_gpu_bytes={0: 1}, reason="pressure")


def test_a_plan_leases_every_model_it_places_evicts_or_rescales() -> None:
    plan = PlacementPlan(placements=(_placement("org/a", "a1"), _placement("org/a", "a2")),
                         evictions=(_eviction("org/b", "b1"),), desired_replicas={"org/c": 0, "org/a": 2})
    assert get_touched_models(plan) == {"org/a", "org/b", "org/c"}
    assert get_touched_models(PlacementPlan()) == set()
