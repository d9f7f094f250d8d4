"""Three scheduler processes placing 200 replicas onto the same virtual nodes at once.

The schedulers are real `shoal scheduler` processes. The nodes are stand-ins
for node agents that register their GPUs and acknowledge every command without
starting workers: 200 real model workers do not fit on a test machine, and
what this test is about is the GPU state the schedulers write with CAS.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.micro import add_service

from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.messages import (
    GpuInfo,
    GpuRecord,
    ModelSpec,
    NodeRecord,
    NodeReply,
    ScaleModel,
    node_command_decoders,
    now,
    scheduler_reply_decoder,
)
from shoal.shared.micro import add_json_endpoint, request_json
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.e2e.conftest import free_port

GIB = 1 << 30
NUM_NODES = 8
GPUS_PER_NODE = 8
GPU_BYTES = 24 * GIB
NUM_MODELS = 20
REPLICAS_PER_MODEL = 10
SIZES_GIB = (1, 2, 3, 4, 6)


class StandInNodes:
    """Registers nodes and GPUs like node agents do, and says yes to every command."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self.commands: Counter[str] = Counter()
        self._heartbeat: asyncio.Task[None] | None = None

    async def start(self) -> None:
        service = await add_service(self._bus.nc, name="stand-in-nodes", version="0.0.1")
        for n in range(NUM_NODES):
            node_id = f"node-{n}"
            for verb in ("create", "stop", "to_cache", "from_cache"):
                await add_json_endpoint(service, f"{verb}-{n}", subjects.node_subject(node_id, verb),
                                        node_command_decoders[verb].decode, self._answer(verb))
            for index in range(GPUS_PER_NODE):
                await self._bus.gpus.put(subjects.gpu_kv_key(node_id, index),
                                         GpuRecord(node_id=node_id, index=index, total_bytes=GPU_BYTES, virtual=True))
        await self._beat()
        self._heartbeat = asyncio.create_task(self._beat_forever())

    def _answer(self, verb: str):  # type: ignore[no-untyped-def]
        async def handle(_command: object) -> NodeReply:
            self.commands[verb] += 1
            return NodeReply(ok=True)

        return handle

    async def _beat(self) -> None:
        gpus = [GpuInfo(index=i, total_bytes=GPU_BYTES, virtual=True) for i in range(GPUS_PER_NODE)]
        for n in range(NUM_NODES):
            await self._bus.nodes.put(f"node-{n}", NodeRecord(node_id=f"node-{n}", hostname="test", gpus=gpus,
                                                             cpu_ram_bytes=256 * GIB, virtual=True,
                                                             heartbeat_at=now()))

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(3.0)
            await self._beat()

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()


@pytest.fixture
async def nodes(bus: Bus) -> AsyncIterator[StandInNodes]:
    stand_in = StandInNodes(bus)
    await stand_in.start()
    yield stand_in
    await stand_in.stop()


@pytest.fixture
def schedulers(nats_server: EmbeddedNatsServer, tmp_path: Path) -> Iterator[list[int]]:
    """Three `shoal scheduler` processes; yields their metrics ports."""
    ports = [free_port() for _ in range(3)]
    env = {**os.environ, "SHOAL_DEMO_MODELS": "false", "SHOAL_SCHEDULER_RECONCILE_INTERVAL_S": "2"}
    processes = [
        subprocess.Popen([sys.executable, "-m", "shoal.cli.main", "scheduler", "--nats-url", nats_server.url,
                          "--metrics-port", str(port), "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
        for port in ports
    ]
    try:
        for process in processes:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert "is up" in line, line + process.stdout.read()
        yield ports
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def _scrape(port: int, metric: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(metric + "{"))


async def test_three_schedulers_never_over_commit_a_gpu(bus: Bus, nodes: StandInNodes, schedulers: list[int]) -> None:
    models = [f"org/model-{i}" for i in range(NUM_MODELS)]
    for i, model in enumerate(models):
        size = SIZES_GIB[i % len(SIZES_GIB)] * GIB
        await bus.models.put(subjects.model_token(model),
                             ModelSpec(key=model, path=model, memory_override_bytes=size, weight_bytes=size // 3))

    async def scale(model: str) -> None:
        reply = await request_json(bus.nc, subjects.scheduler_subject("scale"), ScaleModel(model, REPLICAS_PER_MODEL),
                                   scheduler_reply_decoder, timeout_s=120.0)
        assert reply.ok, reply.message

    await asyncio.gather(*(scale(model) for model in models))
    await asyncio.sleep(4.0)  # let every reconciler pass once more over the result

    gpus = {key: entry.value for key, entry in (await bus.gpus.get_all()).items()}
    replicas = [entry.value for entry in (await bus.replicas.get_all()).values()]
    for key, gpu in gpus.items():
        assert gpu.reserved_bytes <= gpu.total_bytes, f"{key} is over-committed"
    occupants = {(gpu.node_id, gpu.index, o.replica_id): o for gpu in gpus.values() for o in gpu.occupants}
    for record in replicas:
        assert record.level == "HOT"
        for index, num_bytes in record.gpu_bytes.items():
            occupant = occupants.get((record.node_id, index, record.replica_id))
            assert occupant is not None and occupant.num_bytes == num_bytes, f"{record.name} has no matching occupant"
    recorded = {(r.node_id, i, r.replica_id) for r in replicas for i in r.gpu_bytes}
    assert set(occupants) == recorded, "every occupant must belong to a replica record"
    per_model = Counter(r.model for r in replicas)
    assert per_model == {model: REPLICAS_PER_MODEL for model in models}
    assert nodes.commands["create"] >= NUM_MODELS * REPLICAS_PER_MODEL
    conflicts = sum(_scrape(port, "shoal_scheduler_gpu_cas_conflicts_total") for port in schedulers)
    assert conflicts > 0, "three schedulers on the same GPUs must have raced"
