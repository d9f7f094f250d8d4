"""A small real cluster for the sleep/wake tests: nats-server, one node agent with a virtual
GPU, one or two schedulers, a gateway, and real workers serving the llama-5m checkpoint under
several model keys (so "two of three models fit" is a matter of memory, not of weights)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from shoal.services.node_agent.agent import NodeAgent
from shoal.services.node_agent.gpus import discover_gpus
from shoal.services.scheduler.service import SchedulerService
from shoal.shared import subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.config import LoggingConfig, NodeConfig, SchedulerConfig, WorkerConfig
from shoal.shared.messages import GpuRecord, ModelSpec, ReplicaRecord
from shoal.shared.model_settings import FairnessSettings, SleepSettings
from tests.integration.gateway_harness import gateway_running

MiB = 1 << 20
CHECKPOINT = "demo/llama-5m"
REPLICA_BYTES = 96 * MiB
"""Each model's memory override: a 200 MiB GPU holds two replicas, not three (measured, a
replica of this checkpoint holds ~72 MiB: still two)."""
GPU_SPEC = "virtual:1x200MiB"
QUICK = FairnessSettings(min_runtime_s=0.5, max_wait_s=0.2)


def model(key: str, *, fairness: FairnessSettings = QUICK, sleep: SleepSettings | None = None) -> ModelSpec:
    return ModelSpec(key=key, path=CHECKPOINT, memory_override_bytes=REPLICA_BYTES, fairness=fairness,
                     sleep=sleep or SleepSettings(drain_timeout_s=30.0))


@dataclass
class SleepWakeCluster:
    bus: Bus
    url: str
    schedulers: list[SchedulerService]
    gpu_key: str
    max_reserved_seen: list[int] = field(default_factory=lambda: [0])

    async def complete(self, model_key: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
        """One completion through the gateway, retried (as OpenAI clients do) while the gateway
        answers 503 with Retry-After; returns the JSON body of its 200."""
        body = {"model": model_key, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, **extra}
        async with aiohttp.ClientSession() as session:
            for _ in range(60):
                async with session.post(self.url + "/v1/completions", json=body) as response:
                    payload = await response.json(content_type=None)
                    if response.status == 503 and "Retry-After" in response.headers:
                        await asyncio.sleep(min(2.0, float(response.headers["Retry-After"])))
                        continue
                    assert response.status == 200, payload
                    return payload
        raise AssertionError(f"{model_key}: still 503 after 60 tries")

    async def post(self, model_key: str, max_tokens: int = 4) -> tuple[int, dict[str, Any], dict[str, str]]:
        """One completion, no retry: (status, body, headers)."""
        body = {"model": model_key, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        async with aiohttp.ClientSession() as session, session.post(self.url + "/v1/completions", json=body) as resp:
            return resp.status, await resp.json(content_type=None), dict(resp.headers)

    async def metric_total(self, name: str) -> float:
        """The sum of a metric's samples over every scheduler's registry."""
        total = 0.0
        for scheduler in self.schedulers:
            text = scheduler.metrics.render()
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith(name + "{") or line.startswith(name + " "))
        return total

    async def replicas(self, model_key: str) -> list[ReplicaRecord]:
        entries = await self.bus.replicas.get_all(subjects.model_token(model_key) + ".*")
        return [e.value for e in entries.values()]

    async def spec(self, model_key: str) -> ModelSpec:
        entry = await self.bus.models.get(subjects.model_token(model_key))
        assert entry is not None
        return entry.value

    async def eligible_in(self, model_key: str, seconds: float) -> None:
        """Make `model_key`'s serving replica preemptible `seconds` from now (its minimum runtime
        counted from when it started serving), however long the models placed after it took to
        load: a test that needs it inside its minimum runtime a while longer does not depend on
        the machine's load."""
        since = next(o.since for o in (await self.gpu()).occupants if o.model == model_key and o.state == "serving")
        spec = await self.spec(model_key)
        fairness = msgspec.structs.replace(spec.fairness, min_runtime_s=time.time() - since + seconds)
        await self.bus.models.put(subjects.model_token(model_key), msgspec.structs.replace(spec, fairness=fairness))

    async def gpu(self) -> GpuRecord:
        entry = await self.bus.gpus.get(self.gpu_key)
        assert entry is not None
        return entry.value

    async def serving(self) -> set[str]:
        """Models with a serving replica now."""
        found = set()
        for entry in (await self.bus.replicas.get_all()).values():
            if entry.value.serving:
                found.add(entry.value.model)
        return found

    async def expect_serving(self, models: set[str], why: str = "", timeout_s: float = 10.0) -> None:
        """The models serving are `models`, or become so soon: a worker fetches requests a
        moment before its node agent records it ready, so a request may be answered first."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (found := await self.serving()) != models:
            assert asyncio.get_running_loop().time() < deadline, f"serving {found}, not {models}. {why}"
            await asyncio.sleep(0.05)

    async def wait_for(self, predicate: Any, what: str, timeout_s: float = 120.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await predicate():
            assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.1)

    async def watch_memory(self) -> None:
        """Records the most memory the GPU record ever showed held (its total must bound it)."""
        while True:
            gpu = await self.gpu()
            self.max_reserved_seen[0] = max(self.max_reserved_seen[0], gpu.reserved_bytes)
            assert gpu.reserved_bytes <= gpu.total_bytes, f"over-committed: {gpu}"
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def sleep_wake_cluster(nats_url: str, models_root: Path, log_dir: Path, models: Sequence[ModelSpec], *,
                             num_schedulers: int = 1, reconcile_interval_s: float = 3600.0,
                             gpus: str = GPU_SPEC, capacity_wait_s: float = 0.0) -> AsyncIterator[SleepWakeCluster]:
    buses = [await connect(nats_url, name) for name in ("node", "test", *(f"s{i}" for i in range(num_schedulers)))]
    agent = NodeAgent(buses[0], discover_gpus(gpus), NodeConfig(node_id="n", models_root=str(models_root)),
                      WorkerConfig(torch_threads=1), LoggingConfig(), nats_url=nats_url, log_dir=log_dir)
    await agent.start()
    schedulers = [SchedulerService(bus, SchedulerConfig(scheduler_id=f"s{i}", reconcile_interval_s=reconcile_interval_s))
                  for i, bus in enumerate(buses[2:])]
    for i, scheduler in enumerate(schedulers):
        await scheduler.start(models if i == 0 else ())
    watcher: asyncio.Task[None] | None = None
    try:
        async with gateway_running(nats_url, request_timeout_s=240.0, capacity_wait_s=capacity_wait_s) as url:
            cluster = SleepWakeCluster(buses[1], url, schedulers, subjects.gpu_kv_key("n", 0))
            watcher = asyncio.create_task(cluster.watch_memory())
            yield cluster
            assert not watcher.done(), watcher.exception() if watcher.done() else ""
    finally:
        if watcher is not None:
            watcher.cancel()
        for scheduler in schedulers:
            await scheduler.stop()
        await agent.stop()
        for bus in buses:
            await bus.close()
