"""Model leases: how a placement pass keeps other schedulers' plans for its models out (pure).

A pass commits its plan in several writes (model specs, GPU keys, replica records). So
that no two plans for one model interleave, it first *leases* every model the plan
touches: a CAS on each spec, from the revision the plan read, that names the pass's
scheduler as ``lease_owner`` until ``lease_until`` (now + the reservation TTL). Then

* a later pass of any scheduler sees the lease and backs off (re-reads and re-plans), or
  holds an older revision and loses its CAS;
* the lease is released, with the plan's new desired counts, once the GPU keys and
  replica records are written (or at once when the commit lost a race);
* a lease left by a crashed scheduler lapses at ``lease_until``; the scheduler's own
  lease never stops it.
"""

from __future__ import annotations

import msgspec

from shoal.shared.messages import ModelSpec
from shoal.shared.placement.plan import PlacementPlan


def get_touched_models(plan: PlacementPlan) -> set[str]:
    """The models whose specs `plan` leases: new desired counts, placements, evictions."""
    return set(plan.desired_replicas) | {p.model for p in plan.placements} | {e.model for e in plan.evictions}


def is_leased_by_other(spec: ModelSpec, owner: str, now: float) -> bool:
    """Whether another scheduler than `owner` holds a lease on `spec` that has not lapsed at `now`."""
    return spec.lease_owner not in (None, owner) and spec.lease_until is not None and spec.lease_until > now


def take_lease(spec: ModelSpec, owner: str, now: float, ttl_s: float, desired_replicas: int | None = None
               ) -> ModelSpec:
    """`spec` leased to `owner` for `ttl_s` from `now` (written by CAS from the revision read),
    with the plan's desired count (None keeps the spec's). The count is written before any
    record of the plan: a scheduler that dies mid-commit leaves the intent, which the next
    reconciler completes, never records that the old count would undo."""
    desired = spec.desired_replicas if desired_replicas is None else desired_replicas
    return msgspec.structs.replace(spec, lease_owner=owner, lease_until=now + ttl_s, desired_replicas=desired)


def release_lease(spec: ModelSpec | None, owner: str, desired_replicas: int | None) -> ModelSpec | None:
    """`spec` with `owner`'s lease released and the plan's desired count written.

    Args:
        desired_replicas: the model's new desired count; None keeps the spec's.

    Returns:
        None when there is nothing to release: the model is gone, or the lease is not
        `owner`'s (it lapsed and another scheduler took it).
    """
    if spec is None or spec.lease_owner != owner:
        return None
    desired = spec.desired_replicas if desired_replicas is None else desired_replicas
    return msgspec.structs.replace(spec, lease_owner=None, lease_until=None, desired_replicas=desired)
