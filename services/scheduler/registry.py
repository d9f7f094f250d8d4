"""The model registry in ``shoal_models``: models from the config file and the admin API."""

from __future__ import annotations

import msgspec

from shoal.shared.messages import ModelSpec


def merge_registration(current: ModelSpec | None, incoming: ModelSpec) -> ModelSpec | None:
    """The spec to store when `incoming` is (re-)registered over `current`.

    What the operator configures comes from `incoming`; what the cluster learned
    (measured memory, inspected sizes) and the desired replica count survive,
    the count raised to at least the configured minimum. None: nothing changes.
    """
    if current is None:
        return incoming
    learned = {
        "registered_at": current.registered_at,
        "lease_owner": current.lease_owner,
        "lease_until": current.lease_until,
        "desired_replicas": max(current.desired_replicas, incoming.desired_replicas),
    }
    same_footprint = (incoming.path, incoming.dtype, incoming.kv_cache_tokens) == (
        current.path,
        current.dtype,
        current.kv_cache_tokens,
    )
    if same_footprint:
        learned |= {
            "measured_serving_bytes": current.measured_serving_bytes,
            "measured_at": current.measured_at,
            "weight_bytes": current.weight_bytes,
            "num_parameters": current.num_parameters,
            "estimated_bytes": current.estimated_bytes,
        }
    merged = msgspec.structs.replace(incoming, **learned)
    return None if merged == current else merged
