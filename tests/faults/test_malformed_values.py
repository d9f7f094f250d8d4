"""A KV value that does not decode (hand-written, a newer version, a forged write) is logged,
repaired by CAS or left out of placement — never a crash loop, never a GPU read as empty."""

from __future__ import annotations

from pathlib import Path

from shoal.services.scheduler.service import SchedulerService
from shoal.shared import subjects
from shoal.shared.bus import connect
from shoal.shared.config import NodeConfig, SchedulerConfig
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.faults.harness import REPLICA_BYTES, fault_cluster, model

GARBAGE = b'{"node_id": 7, "occupants": "all of them"'


async def test_malformed_gpu_and_replica_records_are_repaired_and_nothing_is_placed_on_them(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    node = NodeConfig(node_id="n", models_root=str(demo_models_root), heartbeat_interval_s=1.0,
                      reconcile_interval_s=3600.0)  # repaired when the test says (below)
    async with fault_cluster(nats_server.url, demo_models_root, tmp_path / "logs", [model("m")],
                             node=node) as cluster:
        (replica,) = await cluster.wait_serving("m")
        gpu_key = subjects.gpu_kv_key("n", 0)
        replica_key = subjects.replica_kv_key("m", replica.replica_id)
        await cluster.bus.gpus.kv.put(gpu_key, GARBAGE)
        await cluster.bus.replicas.kv.put(replica_key, b"\xff not json")
        await cluster.bus.gpus.kv.put(subjects.gpu_kv_key("n", 9), GARBAGE)  # a GPU no node has

        # A scheduler started now (a restart) starts, and places nothing on a GPU it cannot read.
        late_bus = await connect(nats_server.url, "late")
        late = SchedulerService(late_bus, SchedulerConfig(scheduler_id="late", reconcile_interval_s=0.5))
        try:
            await late.start([model("other")])
            assert not [r for r in await cluster.replicas("other") if r.level == "HOT"], \
                "nothing placed on a GPU whose occupants are unknown"

            async def repaired() -> bool:
                gpu = await cluster.bus.gpus.get(gpu_key)
                record = await cluster.bus.replicas.get(replica_key)
                return (gpu is not None and [o.replica_id for o in gpu.value.occupants] == [replica.replica_id]
                        and record is not None and record.value.state == "ready")

            assert not await repaired()
            await cluster.agent.reconcile()  # one round of what runs every node.reconcile_interval_s
            await cluster.wait_for(repaired, "the node agent rebuilt both records", timeout_s=5)
            gpu_entry = await cluster.bus.gpus.get(gpu_key)
            assert gpu_entry is not None and gpu_entry.value.occupants[0].num_bytes == REPLICA_BYTES
            assert (await cluster.worker_pids()).keys() == {replica.replica_id}, "its worker kept running"
            answer = await cluster.complete("m")
            assert answer.status == 200, answer.body
            # Once the GPU reads again, the other model gets its replica beside m's.
            await cluster.wait_serving("other", timeout_s=90)
            for scheduler in (*cluster.schedulers, late):
                assert scheduler._reconciling is not None and not scheduler._reconciling.done()
            await cluster.assert_no_orphans()
            await cluster.assert_memory_matches_records()
        finally:
            await late.stop()
            await late_bus.close()
