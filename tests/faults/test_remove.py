"""`remove` of a model stops every replica it has — a held one (``stopping``, after a node step
that failed) included, which no placement pass may evict — and deletes its request consumer:
nothing of the model runs or waits afterwards."""

from __future__ import annotations

from pathlib import Path

import nats.js.errors
import pytest

from shoal.shared import subjects
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.faults.harness import fault_cluster, model


async def test_remove_stops_held_replicas_and_deletes_the_consumer(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    async with fault_cluster(nats_server.url, demo_models_root, tmp_path / "logs",
                             [model("m", min_replicas=2), model("keep")],
                             reconcile_interval_s=3600.0) as cluster:  # no reconciler frees the held one first
        first, second = await cluster.wait_serving("m", 2)
        await cluster.wait_serving("keep")
        scheduler = cluster.schedulers[0]
        # A failed park leaves a replica held: memory counted, its worker still running.
        await scheduler.store.hold_replica(second, "to_cache failed")
        assert {r.state for r in await cluster.replicas("m")} == {"ready", "stopping"}
        assert {first.replica_id, second.replica_id} <= (await cluster.worker_pids()).keys()

        reply = await scheduler.remove("m")

        assert reply.ok, reply
        assert await cluster.replicas("m") == []
        assert (await cluster.worker_pids()).keys().isdisjoint({first.replica_id, second.replica_id})
        assert await cluster.bus.models.get(subjects.model_token("m")) is None
        with pytest.raises(nats.js.errors.NotFoundError):
            await cluster.bus.js.consumer_info(subjects.REQUESTS_STREAM, subjects.consumer_name("m"))
        for entry in (await cluster.bus.gpus.get_all()).values():
            assert {o.model for o in entry.value.occupants} == {"keep"}, entry.value
        # The other model is untouched.
        assert (await cluster.complete("keep")).status == 200
        await cluster.assert_no_orphans()
        await cluster.assert_memory_matches_records()
