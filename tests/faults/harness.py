"""A small real Shoal for the fault tests: nats-server, a node agent with virtual GPUs, one or
more schedulers, a gateway, and real workers serving the llama-5m checkpoint. Every part is the
real service (its own NATS connection); workers are real processes, killed with real signals.

`FaultCluster` adds what the tests observe: every reply on ``shoal.reply.>`` (which replica
started which attempt), HTTP calls that record when they were answered, and the invariants
that must hold whatever was broken (no orphan worker, memory counted as it is held).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from nats.aio.msg import Msg

from shoal.services.node_agent.agent import NodeAgent
from shoal.services.node_agent.gpus import discover_gpus
from shoal.services.scheduler.service import SchedulerService
from shoal.shared import subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.config import LoggingConfig, NodeConfig, SchedulerConfig, WorkerConfig
from shoal.shared.messages import AttemptNotice, ModelSpec, ReplicaRecord, reply_decoder
from shoal.shared.model_settings import FairnessSettings, SleepSettings
from tests.faults.proxy import CuttableProxy, cuttable_proxy
from tests.integration.gateway_harness import gateway_running

MiB = 1 << 20
CHECKPOINT = "demo/llama-5m"
REPLICA_BYTES = 96 * MiB
PROMPT = "Once upon a time"


def model(key: str, *, min_replicas: int = 1, drain_timeout_s: float = 30.0, **extra: Any) -> ModelSpec:
    """A llama-5m model sized by override, so how many fit on a GPU is a matter of arithmetic."""
    return ModelSpec(key=key, path=CHECKPOINT, memory_override_bytes=REPLICA_BYTES, min_replicas=min_replicas,
                     desired_replicas=min_replicas,
                     fairness=FairnessSettings(min_runtime_s=0.5, max_wait_s=0.2),
                     sleep=SleepSettings(drain_timeout_s=drain_timeout_s), **extra)


@dataclass
class Answer:
    """One HTTP completion as a client saw it."""

    status: int
    body: Any
    answered_at: float
    """time.monotonic() when the whole response had arrived."""
    events: list[Any] = field(default_factory=list)
    """A stream's SSE data events, decoded (errors included)."""

    @property
    def text(self) -> str:
        if self.events:
            return "".join(e["choices"][0].get("text") or "" for e in self.events if e.get("choices"))
        return self.body["choices"][0]["text"]


@dataclass
class FaultCluster:
    bus: Bus
    url: str
    agent: NodeAgent
    schedulers: list[SchedulerService]
    notices: list[tuple[float, AttemptNotice]] = field(default_factory=list)
    """Every attempt notice seen on ``shoal.reply.>``, with its arrival time (monotonic)."""

    async def replicas(self, model_key: str | None = None) -> list[ReplicaRecord]:
        prefix = subjects.model_token(model_key) + ".*" if model_key else ">"
        return [e.value for e in (await self.bus.replicas.get_all(prefix)).values()]

    async def serving(self, model_key: str) -> list[ReplicaRecord]:
        return [r for r in await self.replicas(model_key) if r.serving]

    async def wait_for(self, predicate: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not await predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.1)

    async def wait_serving(self, model_key: str, num_replicas: int = 1, timeout_s: float = 120.0) -> list[ReplicaRecord]:
        async def enough() -> bool:
            return len(await self.serving(model_key)) >= num_replicas

        await self.wait_for(enough, f"{num_replicas} serving replicas of {model_key}", timeout_s)
        return await self.serving(model_key)

    def started_on(self, replica_id: str) -> set[str]:
        """Request ids whose attempt started on `replica_id`."""
        return {n.request_id for _, n in self.notices if n.state == "started" and n.replica_id == replica_id}

    async def complete(self, model_key: str, *, max_tokens: int = 48, stream: bool = False,
                       temperature: float = 0.0, **extra: Any) -> Answer:
        """One completion (no retry), answered or failed: the client's view of it."""
        body = {"model": model_key, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": temperature,
                "ignore_eos": True, "stream": stream, **extra}
        if stream:
            body["stream_options"] = {"include_usage": True}
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.post(self.url + "/v1/completions", json=body) as response:
            if not stream or response.status != 200:
                payload = await response.json(content_type=None)
                return Answer(response.status, payload, time.monotonic())
            events = []
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))
            return Answer(response.status, None, time.monotonic(), events)

    async def worker_pids(self) -> dict[str, int]:
        """Replica id -> pid of every worker process the node agent runs now."""
        return {rid: r.process.pid for rid, r in self.agent._replicas.items()
                if r.process is not None and r.process.process.returncode is None}

    async def assert_no_orphans(self) -> None:
        """Every worker process the agent runs has a live replica record, and every live HOT
        record on the node has a worker."""
        records = {r.replica_id: r for r in await self.replicas()}
        for replica_id in await self.worker_pids():
            record = records.get(replica_id)
            assert record is not None and record.state not in ("failed", "lost", "stopping"), \
                f"worker of {replica_id} runs with record {record}"

    async def assert_memory_matches_records(self) -> None:
        """Each GPU holds exactly the bytes of the occupants its replicas' records account for,
        within its total."""
        records = {r.replica_id: r for r in await self.replicas()}
        for entry in (await self.bus.gpus.get_all()).values():
            gpu = entry.value
            assert gpu.reserved_bytes <= gpu.total_bytes, f"over-committed: {gpu}"
            for occupant in gpu.occupants:
                assert occupant.replica_id in records, f"occupant {occupant.replica_id} has no record: {gpu}"


def kill_worker(pid: int) -> None:
    """SIGKILL a worker's process group (what an OOM killer or a segfault does)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def fault_cluster(nats_url: str, models_root: Path, log_dir: Path, models: Sequence[ModelSpec], *,
                        gpus: str = "virtual:1x400MiB", num_schedulers: int = 1,
                        reconcile_interval_s: float = 1.0, node: NodeConfig | None = None,
                        agent_url: str | None = None, worker_url: str | None = None,
                        request_timeout_s: float = 120.0, node_ttl_s: float = 15.0,
                        scheduler: dict[str, Any] | None = None, worker: WorkerConfig | None = None,
                        ) -> AsyncIterator[FaultCluster]:
    """The cluster, with `models` registered by the first scheduler.

    Args:
        agent_url: the NATS URL the node agent uses, e.g. through a proxy the test can cut;
            default `nats_url`.
        worker_url: the NATS URL its workers use; default `agent_url`.
        node_ttl_s: a node whose heartbeats lapse this long is gone (the first connection
            creates the bucket with it).
        scheduler: further `SchedulerConfig` fields (shorter timeouts for a test).
        worker: the workers' settings (default: one torch thread).
    """
    node_config = node or NodeConfig(node_id="n", models_root=str(models_root), heartbeat_interval_s=1.0,
                                     reconcile_interval_s=1.0)
    agent_bus = await connect(agent_url or nats_url, "node", node_ttl_s=node_ttl_s)
    buses = [await connect(nats_url, name) for name in ("test", *(f"s{i}" for i in range(num_schedulers)))]
    agent = NodeAgent(agent_bus, discover_gpus(gpus), node_config, worker or WorkerConfig(torch_threads=1), LoggingConfig(),
                      nats_url=worker_url or agent_url or nats_url, log_dir=log_dir)
    await agent.start()
    schedulers = [SchedulerService(bus, SchedulerConfig(scheduler_id=f"s{i}", reconcile_interval_s=reconcile_interval_s,
                                                        **(scheduler or {})))
                  for i, bus in enumerate(buses[1:])]
    cluster: FaultCluster | None = None

    async def on_reply(msg: Msg) -> None:
        try:
            reply = reply_decoder.decode(msg.data)
        except Exception:
            return
        if isinstance(reply, AttemptNotice) and cluster is not None:
            cluster.notices.append((time.monotonic(), reply))

    observer = await buses[0].nc.subscribe(f"{subjects.REPLY_PREFIX}.>", cb=on_reply)
    try:
        for i, scheduler in enumerate(schedulers):
            await scheduler.start(models if i == 0 else ())
        async with gateway_running(nats_url, request_timeout_s=request_timeout_s) as url:
            cluster = FaultCluster(buses[0], url, agent, schedulers)
            yield cluster
    finally:
        await observer.unsubscribe()
        for scheduler in schedulers:
            await scheduler.stop()
        await agent.stop()
        for bus in (agent_bus, *buses):
            await bus.close()


@contextlib.asynccontextmanager
async def agent_cut_off_cluster(nats_url: str, models_root: Path, log_dir: Path, *, node_ttl_s: float
                                ) -> AsyncIterator[tuple[CuttableProxy, FaultCluster]]:
    """A one-model cluster whose node agent reaches NATS through a proxy the test can cut
    (its workers do not), with a short node TTL and a scheduler that marks a silent node's
    replicas lost after 1 s."""
    async with cuttable_proxy(nats_url) as proxy, \
            fault_cluster(nats_url, models_root, log_dir, [model("m")], agent_url=proxy.url, worker_url=nats_url,
                          node_ttl_s=node_ttl_s, scheduler={"node_lost_after_s": 1.0}) as cluster:
        yield proxy, cluster
