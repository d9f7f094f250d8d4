"""Failure backoff: what one more failed replica does to its model's record (pure).

A replica that fails is freed (`failures.FailureHandler`); its model's spec then counts
the failure:

    failures in a row   hold (placement refused for)
    1                   0 s    (replaced at once)
    2                   1 s
    3                   2 s
    n                   min(MAX_HOLD_S, 2 ** (n - 2)) s

and a replica that never served (failed before its first ready) lowers the model's
desired count by one (seed 002: a replica that cannot come up is not retried forever;
the next request asks again). A replica that served keeps the count: it is replaced.

The run ends when a replica of the model becomes ready: the node agent clears
``num_failures``, ``last_error`` and ``hold_until`` (`NodeAgent._record_ready_model`).

While held, the scheduler answers placement commands with status ``failing`` and a
``Retry-After`` of the time left; the gateway answers 503 to requests that wait for
the model with no replica on its way (`gateway.cluster.ClusterView.failing_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.shared.messages import ModelSpec, SchedulerReply

MAX_HOLD_S = 120.0
"""The longest a run of failures holds a model's placement back."""


@dataclass(frozen=True, slots=True)
class FailureCount:
    """A model's failure fields after one more failure."""

    num_failures: int
    desired_replicas: int
    hold_until: float | None
    """Placement is refused until then; None: not held (the first failure of a run)."""


def get_hold_s(num_failures: int) -> float:
    """How long placement waits after `num_failures` failures in a row (0 for the first)."""
    if num_failures <= 1:
        return 0.0
    return min(MAX_HOLD_S, 2.0 ** (num_failures - 2))


def count_failure(*, num_failures: int, desired_replicas: int, never_served: bool, now: float) -> FailureCount:
    """The model's fields after one of its replicas failed.

    Args:
        num_failures: failures in a row before this one.
        desired_replicas: the model's desired replica count.
        never_served: the replica failed before it was ever ready.
        now: clock time of the failure.
    """
    failures = num_failures + 1
    hold_s = get_hold_s(failures)
    desired = max(0, desired_replicas - 1) if never_served else desired_replicas
    return FailureCount(failures, desired, now + hold_s if hold_s else None)


def get_held_reply(spec: ModelSpec, now: float) -> SchedulerReply | None:
    """The scheduler's answer to a placement command while `spec` is held; None when it is not."""
    if spec.hold_until is None or not spec.is_held(now):
        return None
    return SchedulerReply(ok=False, status="failing", model=spec, retry_after_s=max(1.0, spec.hold_until - now),
                          message=f"replicas of {spec.key} keep failing ({spec.num_failures} in a row); "
                                  f"last error: {spec.last_error}")
