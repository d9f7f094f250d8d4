"""A node that dies (its agent and its workers, as a machine crash or power loss): its replicas
turn ``lost`` when its heartbeats lapse, the gateway finds the lost replica's worker silent too
and NAKs the deliveries it held, and the requests run on a replacement on another node — seconds
after the death, not after JetStream's 30 s ``ack_wait``. A lost replica whose worker still
answers keeps its requests (test_partition.py: only the agent was cut off)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from shoal.services.node_agent.agent import NodeAgent
from shoal.services.node_agent.gpus import discover_gpus
from shoal.shared.bus import connect
from shoal.shared.config import LoggingConfig, NodeConfig, WorkerConfig
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.faults.harness import agent_cut_off_cluster, kill_worker
from tests.faults.test_worker_kill import ACK_WAIT_S, MAX_TOKENS, assert_complete, start_requests

NODE_TTL_S = 3.0


async def test_a_dead_node_s_requests_run_again_on_another_node_before_ack_wait(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    async with agent_cut_off_cluster(nats_server.url, demo_models_root, tmp_path / "logs",
                                     node_ttl_s=NODE_TTL_S) as (proxy, cluster):
        (replica,) = await cluster.wait_serving("m")
        reference = await cluster.complete("m", max_tokens=MAX_TOKENS)
        # A second node, empty: where the replacement goes once the first is lost.
        other_bus = await connect(nats_server.url, "node-2")
        other = NodeAgent(other_bus, discover_gpus("virtual:1x400MiB"),
                          NodeConfig(node_id="n2", models_root=str(demo_models_root), heartbeat_interval_s=1.0,
                                     reconcile_interval_s=1.0),
                          WorkerConfig(torch_threads=1), LoggingConfig(), nats_url=nats_server.url,
                          log_dir=tmp_path / "logs-2")
        await other.start()
        try:
            tasks = await start_requests(cluster, replica.replica_id, 4)
            # The first node dies: its agent falls silent, its worker is gone with it.
            proxy.cut()
            kill_worker((await cluster.worker_pids())[replica.replica_id])
            died_at = time.monotonic()
            answers = await asyncio.gather(*tasks)
            answered_s = max(a.answered_at for a in answers) - died_at
            for answer in answers:
                assert_complete(answer)
                assert answer.text == reference.text, "greedy: the rerun gives the same text"
            (replacement,) = await cluster.serving("m")
            assert replacement.node_id == "n2" and replacement.replica_id != replica.replica_id
            (lost,) = [r for r in await cluster.replicas("m") if r.replica_id == replica.replica_id]
            assert lost.state == "lost", "the dead node's replica stays counted until its node is back"
            assert answered_s < ACK_WAIT_S - 5, f"answered {answered_s:.1f}s after the death: waited for ack_wait"
            print(f"\nNODE DEATH (node TTL {NODE_TTL_S:.0f}s): {len(answers)}/{len(answers)} requests answered "
                  f"{answered_s:.1f}s after the node died, on a replacement on n2")
        finally:
            proxy.restore()
            await other.stop()
            await other_bus.close()
