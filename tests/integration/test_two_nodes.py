"""Two node agents on one machine form a two-node cluster; real scheduler, real workers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shoal.services.node_agent.agent import NodeAgent
from shoal.services.node_agent.gpus import discover_gpus
from shoal.services.scheduler.service import SchedulerService
from shoal.shared import subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.config import LoggingConfig, NodeConfig, SchedulerConfig, WorkerConfig
from shoal.shared.messages import ModelSpec, ReplicaRecord
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.integration.model_records import wait_for_measured_spec

SMALL = "demo/llama-5m"
LARGE = "demo/llama-100m"


@pytest.fixture
async def cluster(nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path
                  ) -> AsyncIterator[tuple[Bus, SchedulerService]]:
    buses = [await connect(nats_server.url, name) for name in ("scheduler", "node-a", "node-b", "test")]
    agents = []
    for bus, node_id, gpus in ((buses[1], "node-a", "virtual:1x1GiB"), (buses[2], "node-b", "virtual:1x4GiB")):
        agent = NodeAgent(bus, discover_gpus(gpus), NodeConfig(node_id=node_id, models_root=str(demo_models_root)),
                          WorkerConfig(), LoggingConfig(), nats_url=nats_server.url, log_dir=tmp_path / node_id)
        await agent.start()
        agents.append(agent)
    scheduler = SchedulerService(buses[0], SchedulerConfig(reconcile_interval_s=3600))
    await scheduler.start([ModelSpec(key=SMALL, path=SMALL), ModelSpec(key=LARGE, path=LARGE)])
    try:
        yield buses[3], scheduler
    finally:
        await scheduler.stop()
        for agent in agents:
            await agent.stop()
        for bus in buses:
            await bus.close()


async def _replicas(bus: Bus, model: str) -> list[ReplicaRecord]:
    return [e.value for e in (await bus.replicas.get_all(subjects.model_token(model) + ".*")).values()]


async def _wait_ready(bus: Bus, model: str, count: int, timeout_s: float = 120.0) -> list[ReplicaRecord]:
    for _ in range(int(timeout_s * 4)):
        replicas = await _replicas(bus, model)
        if sum(r.state == "ready" for r in replicas) >= count:
            return replicas
        assert not any(r.state == "failed" for r in replicas), [r.error for r in replicas]
        await asyncio.sleep(0.25)
    raise AssertionError(f"{model}: {count} ready replicas expected, have {await _replicas(bus, model)}")


async def test_placement_uses_both_nodes_and_a_large_model_lands_where_it_fits(cluster: tuple[Bus, SchedulerService]
                                                                               ) -> None:
    bus, scheduler = cluster
    nodes = await bus.nodes.get_all()
    assert set(nodes) == {"node-a", "node-b"}

    small = await scheduler.scale(SMALL, 2)
    assert small.ok, small.message
    small_replicas = await _wait_ready(bus, SMALL, 2)
    assert {r.node_id for r in small_replicas} == {"node-a", "node-b"}, "two replicas should spread over both nodes"

    large = await scheduler.scale(LARGE, 1)
    assert large.ok, large.message
    (large_replica,) = await _wait_ready(bus, LARGE, 1)
    spec = await wait_for_measured_spec(bus, LARGE)
    assert spec.estimated_bytes is not None and spec.estimated_bytes > (1 << 30), "too large for node-a's GPU"
    assert large_replica.node_id == "node-b"

    # The node agent measured what the replica really holds and recorded it on the model.
    assert spec.measured_serving_bytes is not None and 0 < spec.measured_serving_bytes < spec.estimated_bytes
    gpus = {k: e.value for k, e in (await bus.gpus.get_all()).items()}
    assert all(g.reserved_bytes <= g.total_bytes for g in gpus.values())
    assert {o.state for g in gpus.values() for o in g.occupants} == {"serving"}
