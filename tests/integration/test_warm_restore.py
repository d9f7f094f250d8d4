"""WARM and back through a real node agent and real workers; what placement reserves.

One node agent with a virtual GPU, the real scheduler, real `shoal worker` processes
serving a real demo model over a real nats-server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from shoal.services.node_agent.agent import NodeAgent
from shoal.services.node_agent.gpus import discover_gpus
from shoal.services.scheduler.service import SchedulerService
from shoal.shared import subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.config import LoggingConfig, NodeConfig, SchedulerConfig, WorkerConfig
from shoal.shared.messages import (
    ErrorReply,
    FinalReply,
    InferenceRequest,
    ModelSpec,
    ReplicaRecord,
    Reply,
    SamplingParams,
    encode_msgpack,
    reply_decoder,
)
from shoal.shared.metrics import Registry
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.integration.model_records import wait_for_measured_spec

MODEL = "demo/llama-5m"


@asynccontextmanager
async def one_node_cluster(nats_url: str, models_root: Path, log_dir: Path, *, fork_server: bool = True,
                           metrics: Registry | None = None) -> AsyncIterator[tuple[Bus, SchedulerService]]:
    """A node agent on one 2 GiB virtual GPU and a scheduler with `MODEL` registered; yields a
    bus of the test's own and the scheduler."""
    buses = [await connect(nats_url, name) for name in ("scheduler", "node-a", "test")]
    agent = NodeAgent(buses[1], discover_gpus("virtual:1x2GiB"),
                      NodeConfig(node_id="node-a", models_root=str(models_root), worker_fork_server=fork_server),
                      WorkerConfig(torch_threads=1), LoggingConfig(), nats_url=nats_url, log_dir=log_dir,
                      metrics=metrics)
    await agent.start()
    scheduler = SchedulerService(buses[0], SchedulerConfig(reconcile_interval_s=3600))
    await scheduler.start([ModelSpec(key=MODEL, path=MODEL)])
    try:
        yield buses[2], scheduler
    finally:
        await scheduler.stop()
        await agent.stop()
        for bus in buses:
            await bus.close()


@pytest.fixture
async def cluster(nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path
                  ) -> AsyncIterator[tuple[Bus, SchedulerService]]:
    async with one_node_cluster(nats_server.url, demo_models_root, tmp_path / "node-a") as running:
        yield running


async def _replicas(bus: Bus) -> dict[str, ReplicaRecord]:
    entries = await bus.replicas.get_all(subjects.model_token(MODEL) + ".*")
    return {e.value.replica_id: e.value for e in entries.values()}


async def _ready(bus: Bus, count: int) -> dict[str, ReplicaRecord]:
    """Wait until `count` replicas serve (the test's timeout bounds the wait)."""
    while True:
        replicas = await _replicas(bus)
        assert not any(r.state == "failed" for r in replicas.values()), [r.error for r in replicas.values()]
        serving = {rid: r for rid, r in replicas.items() if r.serving}
        if len(serving) >= count:
            return serving
        await asyncio.sleep(0.25)


async def _spec(bus: Bus) -> ModelSpec:
    entry = await bus.models.get(subjects.model_token(MODEL))
    assert entry is not None
    return entry.value


async def _occupant_bytes(bus: Bus, replica_id: str) -> dict[int, tuple[int, str]]:
    found = {}
    for entry in (await bus.gpus.get_all()).values():
        occupant = entry.value.find(replica_id)
        if occupant is not None:
            found[entry.value.index] = (occupant.num_bytes, occupant.state)
    return found


async def _complete(bus: Bus, request_id: str) -> FinalReply:
    request = InferenceRequest(request_id=request_id, model=MODEL,
                               params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                               deadline=time.time() + 120, reply_to=subjects.reply_subject("test", request_id),
                               gateway_id="test", prompt="Once upon")
    final: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()

    async def on_reply(msg) -> None:  # type: ignore[no-untyped-def]
        reply = reply_decoder.decode(msg.data)
        if isinstance(reply, FinalReply | ErrorReply) and not final.done():
            final.set_result(reply)

    subscription = await bus.nc.subscribe(request.reply_to, cb=on_reply)
    try:
        await bus.js.publish(subjects.infer_subject(MODEL), encode_msgpack(request),
                             headers={subjects.HDR_REPLY_TO: request.reply_to})
        reply = await final
    finally:
        await subscription.unsubscribe()
    assert isinstance(reply, FinalReply), reply
    return reply


async def test_a_replica_goes_warm_and_back_hot_and_serves_and_placement_reserves_the_measured_figure(
        cluster: tuple[Bus, SchedulerService]) -> None:
    bus, scheduler = cluster
    assert (await scheduler.scale(MODEL, 1)).ok
    (first,) = (await _ready(bus, 1)).values()
    spec = await wait_for_measured_spec(bus, MODEL)
    measured = spec.measured_serving_bytes
    assert measured is not None and spec.estimated_bytes is not None and measured != spec.estimated_bytes
    assert sum(first.gpu_bytes.values()) == spec.estimated_bytes, "the first replica had only the estimate"

    # A later placement reserves what the node agent measured, not the estimate.
    assert (await scheduler.scale(MODEL, 2)).ok
    serving = await _ready(bus, 2)
    (second,) = [r for rid, r in serving.items() if rid != first.replica_id]
    assert second.gpu_bytes == {0: measured}
    assert await _occupant_bytes(bus, second.replica_id) == {0: (measured, "serving")}

    # Both parked WARM: their workers keep the weights in CPU RAM, the GPU holds nothing.
    for replica_id in serving:
        reply = await scheduler.evict(MODEL, replica_id)
        assert reply.ok, reply.message
    replicas = await _replicas(bus)
    assert {(r.level, r.state) for r in replicas.values()} == {("WARM", "sleeping")}
    for replica_id in replicas:
        assert {state for _, state in (await _occupant_bytes(bus, replica_id)).values()} == {"sleeping"}

    # Back HOT: a WARM replica is restored (from_cache), not a new one created, and serves.
    reply = await scheduler.ensure(MODEL, 1)
    assert reply.ok, reply.message
    (restored,) = (await _ready(bus, 1)).values()
    assert restored.replica_id in serving
    assert restored.gpu_bytes == {0: measured}
    assert await _occupant_bytes(bus, restored.replica_id) == {0: (measured, "serving")}
    for number in range(3):
        final = await _complete(bus, f"after-restore-{number}")
        assert (final.replica_id, final.completion_tokens) == (restored.replica_id, 6)
    # A restore's reading never lowers the figure measured at creation.
    assert (await _spec(bus)).measured_serving_bytes == measured
    assert restored.measured_bytes is not None


async def test_a_failed_restore_stops_the_worker_and_is_reported_once(cluster: tuple[Bus, SchedulerService]) -> None:
    bus, scheduler = cluster
    assert (await scheduler.scale(MODEL, 1)).ok
    (replica,) = (await _ready(bus, 1)).values()
    assert replica.pid is not None
    assert (await scheduler.evict(MODEL, replica.replica_id)).ok
    # The model's figure drops below its weights: restoring onto that allocation must fail.
    spec = await _spec(bus)
    await bus.models.put(subjects.model_token(MODEL), ModelSpec(**{
        **{f: getattr(spec, f) for f in spec.__struct_fields__}, "measured_serving_bytes": 1 << 20}))

    with capture_logs() as logs:
        reply = await scheduler.ensure(MODEL, 1)
        assert "from_cache" in reply.message and "failed" in reply.message, reply.message

        def failures() -> list[dict]:
            return [e for e in logs if e["event"] == "replica_failed" and e.get("replica") == replica.replica_id
                    and "never_served" in e]

        # Freed by the scheduler, which logs the failure once its model record is updated,
        # after the replica record is gone (the test timeout bounds the wait).
        while replica.replica_id in await _replicas(bus) or not failures():
            await asyncio.sleep(0.1)
        assert not Path(f"/proc/{replica.pid}").exists(), "the worker of a failed restore must be stopped"
        await asyncio.sleep(0.5)  # a second report, if one came, would be logged by now
        failed = failures()
    assert len(failed) == 1, failed
    assert not failed[0]["never_served"]
