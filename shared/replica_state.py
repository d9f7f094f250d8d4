"""Pure changes to one replica record, the bodies of CAS mutations on ``shoal_replicas`` that
the scheduler and the node agent both write (as shared/gpu_state.py for GPU records): None
when nothing changes."""

from __future__ import annotations

import msgspec

from shoal.shared.messages import ReplicaRecord

GIVEN_UP = ("failed", "stopping", "lost")
"""States of a replica nobody serves from any more: its memory is freed once its worker is gone."""


def mark_lost(current: ReplicaRecord | None, error: str, now: float) -> ReplicaRecord | None:
    """`current` ``lost`` (its worker gone with its node or node agent), unless given up already."""
    if current is None or current.state in GIVEN_UP:
        return None
    return msgspec.structs.replace(current, state="lost", error=error, updated_at=now)
