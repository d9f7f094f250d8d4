"""nats-server down for 20 s with requests in flight, then back on the same port and store:
every request in flight is answered, the node's replicas are not given up for a heartbeat
that lapsed only because the bus was down, and afterwards every worker has a live record and
every record its worker (no process left over, no memory counted twice)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from shoal.shared.nats_server import EmbeddedNatsServer
from tests.faults.harness import Answer, fault_cluster, model

OUTAGE_S = 20.0
NODE_TTL_S = 15.0
"""The default node TTL: the outage outlasts it, so every heartbeat lapses while the bus is down."""


async def test_a_20s_nats_outage_loses_no_request_and_leaves_no_orphan(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    async with fault_cluster(nats_server.url, demo_models_root, tmp_path / "logs", [model("m", min_replicas=2)],
                             node_ttl_s=NODE_TTL_S) as cluster:
        replicas = await cluster.wait_serving("m", 2)
        pids_before = await cluster.worker_pids()
        before = len(cluster.notices)
        answers: list[asyncio.Task[Answer]] = [
            asyncio.create_task(cluster.complete("m", max_tokens=400, stream=i % 2 == 1)) for i in range(6)]

        async def all_started() -> bool:
            return sum(1 for _, n in cluster.notices[before:] if n.state == "started") >= len(answers)

        await cluster.wait_for(all_started, "every request started", timeout_s=60)
        await asyncio.to_thread(nats_server.stop)
        await asyncio.sleep(OUTAGE_S)
        await asyncio.to_thread(nats_server.start)
        back_at = time.monotonic()

        results = await asyncio.wait_for(asyncio.gather(*answers), timeout=120)
        for answer in results:
            assert answer.status == 200, answer.body
            if answer.events:
                assert not any("error" in e for e in answer.events), answer.events[-1]
                assert answer.events[-1]["usage"]["completion_tokens"] == 400
            else:
                assert answer.body["usage"]["completion_tokens"] == 400, answer.body
        answered_s = max(a.answered_at for a in results) - back_at

        async def settled() -> bool:
            records = await cluster.replicas("m")
            return len([r for r in records if r.serving]) == 2 and \
                (await cluster.worker_pids()).keys() == {r.replica_id for r in records}

        await cluster.wait_for(settled, "two serving replicas, one worker each", timeout_s=60)
        assert await cluster.worker_pids() == pids_before, "no replica given up for the bus's outage"
        assert {r.replica_id for r in await cluster.serving("m")} == {r.replica_id for r in replicas}
        await cluster.assert_no_orphans()
        await cluster.assert_memory_matches_records()
        held = sum(e.value.reserved_bytes for e in (await cluster.bus.gpus.get_all()).values())
        assert held == sum(sum(r.gpu_bytes.values()) for r in replicas)
        assert (await cluster.complete("m")).status == 200
        print(f"\nNATS OUTAGE {OUTAGE_S:.0f}s: {len(results)}/{len(results)} requests in flight answered, "
              f"the last {answered_s:.1f}s after the server came back; workers unchanged")
