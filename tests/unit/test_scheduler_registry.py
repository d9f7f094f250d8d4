"""What a (re-)registration stores: the operator's fields, what the cluster learned, the count."""

from __future__ import annotations

from shoal.services.scheduler.registry import merge_registration, with_facts
from shoal.shared.messages import ModelFacts, ModelSpec

LEARNED = {"measured_serving_bytes": 5_000, "measured_at": 10.0, "weight_bytes": 3_000, "num_parameters": 1_500,
           "estimated_bytes": 6_000}


def _spec(**fields: object) -> ModelSpec:
    return ModelSpec(**{"key": "org/m", "path": "org/m", **fields})  # type: ignore[arg-type]


def test_a_new_model_is_stored_as_given() -> None:
    incoming = _spec(desired_replicas=1)
    assert merge_registration(None, incoming) is incoming


def test_a_re_registration_keeps_what_was_learned_and_raises_the_count_to_the_minimum() -> None:
    current = _spec(desired_replicas=3, registered_at=1.0, lease_owner="s1", lease_until=9.0, max_queue=4, **LEARNED)
    merged = merge_registration(current, _spec(desired_replicas=1, registered_at=2.0, max_queue=8))
    assert merged == _spec(desired_replicas=3, registered_at=1.0, lease_owner="s1", lease_until=9.0, max_queue=8,
                           **LEARNED)
    assert merge_registration(current, _spec(desired_replicas=5)).desired_replicas == 5  # type: ignore[union-attr]


def test_a_new_footprint_forgets_the_measurements() -> None:
    current = _spec(registered_at=1.0, **LEARNED)
    for changed in ({"path": "org/other"}, {"dtype": "float16"}, {"kv_cache_tokens": 8192}):
        merged = merge_registration(current, _spec(**changed))
        assert merged == _spec(registered_at=1.0, **changed)


def test_an_identical_registration_changes_nothing() -> None:
    current = _spec(desired_replicas=2, registered_at=1.0, **LEARNED)
    assert merge_registration(current, _spec(desired_replicas=2, registered_at=7.0)) is None


def test_facts_from_a_node_agent_fill_the_sizes_and_a_configured_length_wins() -> None:
    facts = ModelFacts(weight_bytes=3_000, num_parameters=1_500, estimated_bytes=6_000, max_model_len=2048)
    assert with_facts(_spec(), facts) == _spec(weight_bytes=3_000, num_parameters=1_500, estimated_bytes=6_000,
                                                max_model_len=2048)
    assert with_facts(_spec(max_model_len=512), facts).max_model_len == 512
