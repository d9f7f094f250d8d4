"""Failure backoff: the count, the hold, the never-served rule, the reply while held."""

from __future__ import annotations

import pytest

from shoal.services.scheduler.backoff import (
    MAX_HOLD_S,
    FailureCount,
    count_failure,
    get_held_reply,
    get_hold_s,
)
from shoal.shared.messages import ModelSpec

NOW = 1_000.0


def test_the_first_failure_of_a_run_holds_nothing_then_the_hold_doubles_up_to_its_cap() -> None:
    assert [get_hold_s(n) for n in range(1, 11)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 120.0, 120.0]
    assert MAX_HOLD_S == 120.0
    assert get_hold_s(0) == 0.0


def test_a_replica_that_served_is_replaced_and_the_first_failure_is_not_held() -> None:
    count = count_failure(num_failures=0, desired_replicas=2, never_served=False, now=NOW)
    assert count == FailureCount(num_failures=1, desired_replicas=2, hold_until=None)


def test_failures_in_a_row_hold_placement_from_the_failure_time() -> None:
    assert count_failure(num_failures=1, desired_replicas=2, never_served=False, now=NOW) == FailureCount(
        num_failures=2, desired_replicas=2, hold_until=NOW + 1.0)
    assert count_failure(num_failures=4, desired_replicas=2, never_served=False, now=NOW) == FailureCount(
        num_failures=5, desired_replicas=2, hold_until=NOW + 8.0)
    assert count_failure(num_failures=40, desired_replicas=2, never_served=False, now=NOW) == FailureCount(
        num_failures=41, desired_replicas=2, hold_until=NOW + MAX_HOLD_S)


def test_a_replica_that_never_served_lowers_the_desired_count_by_one_never_below_zero() -> None:
    assert count_failure(num_failures=0, desired_replicas=3, never_served=True, now=NOW) == FailureCount(
        num_failures=1, desired_replicas=2, hold_until=None)
    assert count_failure(num_failures=2, desired_replicas=1, never_served=True, now=NOW) == FailureCount(
        num_failures=3, desired_replicas=0, hold_until=NOW + 2.0)
    assert count_failure(num_failures=0, desired_replicas=0, never_served=True, now=NOW).desired_replicas == 0


def test_a_hold_ends_at_its_time() -> None:
    assert not ModelSpec(key="m", path="m").is_held(NOW)
    assert ModelSpec(key="m", path="m", hold_until=NOW + 0.5).is_held(NOW)
    assert not ModelSpec(key="m", path="m", hold_until=NOW).is_held(NOW)
    assert not ModelSpec(key="m", path="m", hold_until=NOW - 1.0).is_held(NOW)


def test_while_held_placement_is_refused_with_the_time_left_at_least_a_second() -> None:
    spec = ModelSpec(key="org/m", path="org/m", num_failures=4, last_error="worker exited with 1",
                     hold_until=NOW + 30.0)
    reply = get_held_reply(spec, NOW)
    assert reply is not None
    assert (reply.ok, reply.status, reply.retry_after_s, reply.model) == (False, "failing", 30.0, spec)
    assert reply.message == "replicas of org/m keep failing (4 in a row); last error: worker exited with 1"
    late = get_held_reply(spec, NOW + 29.75)
    assert late is not None and late.retry_after_s == 1.0
    assert get_held_reply(spec, NOW + 30.0) is None
    assert get_held_reply(ModelSpec(key="org/m", path="org/m"), NOW) is None


@pytest.mark.parametrize("never_served", [False, True])
def test_counting_does_not_read_a_clock_of_its_own(never_served: bool) -> None:
    first = count_failure(num_failures=3, desired_replicas=1, never_served=never_served, now=NOW)
    again = count_failure(num_failures=3, desired_replicas=1, never_served=never_served, now=NOW)
    assert first == again and first.hold_until == NOW + 4.0
