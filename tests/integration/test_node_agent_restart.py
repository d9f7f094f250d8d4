"""A node agent restarted (planned or not) finds its replicas' workers gone: it hands them back
as ``lost``, as a dead node's are, and the scheduler places them again; the model's failure
count and backoff stay untouched (a restart says nothing against the model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.aio.msg import Msg

from shoal.services.node_agent.agent import NodeAgent
from shoal.services.node_agent.gpus import discover_gpus
from shoal.services.scheduler.service import SchedulerService
from shoal.shared import subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.config import LoggingConfig, NodeConfig, SchedulerConfig, WorkerConfig
from shoal.shared.messages import ModelSpec, ReplicaRecord
from shoal.shared.nats_server import EmbeddedNatsServer

MODEL = "demo/llama-5m"


def _agent(bus: Bus, nats_url: str, models_root: Path, log_dir: Path) -> NodeAgent:
    return NodeAgent(bus, discover_gpus("virtual:1x2GiB"), NodeConfig(node_id="n", models_root=str(models_root)),
                     WorkerConfig(torch_threads=1), LoggingConfig(), nats_url=nats_url, log_dir=log_dir)


async def _serving(bus: Bus) -> ReplicaRecord:
    while True:
        records = [e.value for e in (await bus.replicas.get_all(subjects.model_token(MODEL) + ".*")).values()]
        assert not any(r.state == "failed" for r in records), [r.error for r in records]
        if serving := [r for r in records if r.serving]:
            return serving[0]
        await asyncio.sleep(0.1)


async def test_a_restarted_node_agent_hands_its_replicas_back_without_counting_a_failure(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    buses = [await connect(nats_server.url, name) for name in ("scheduler", "node", "node-again", "test")]
    first = _agent(buses[1], nats_server.url, demo_models_root, tmp_path / "logs")
    await first.start()
    scheduler = SchedulerService(buses[0], SchedulerConfig(reconcile_interval_s=0.5))
    await scheduler.start([ModelSpec(key=MODEL, path=MODEL, min_replicas=1, desired_replicas=1)])
    running = first
    try:
        async with asyncio.timeout(120):
            before = await _serving(buses[3])
        failures: list[bytes] = []

        async def on_failure(msg: Msg) -> None:
            failures.append(msg.data)

        await buses[3].nc.subscribe(subjects.event_subject("replica_failed"), cb=on_failure)
        await first.stop()  # its worker stops with it; the record stays, as after a crash
        running = _agent(buses[2], nats_server.url, demo_models_root, tmp_path / "logs-again")
        await running.start()
        async with asyncio.timeout(120):
            while (after := await _serving(buses[3])).replica_id == before.replica_id:
                await asyncio.sleep(0.1)
        assert await buses[3].replicas.get(subjects.replica_kv_key(MODEL, before.replica_id)) is None, \
            "the lost replica was freed"
        spec = (await buses[3].models.get(subjects.model_token(MODEL))).value  # type: ignore[union-attr]
        assert (spec.last_error, spec.desired_replicas) == (None, 1), spec
        assert failures == [], "no failure reported, none counted against the model"
        assert after.node_id == "n"
    finally:
        await scheduler.stop()
        await running.stop()
        for bus in buses:
            await bus.close()
