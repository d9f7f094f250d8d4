"""Workers forked by the node agent's fork server (services/worker/forkserver.py): a real node
agent, scheduler, nats-server and fork server. A forked worker serves like a spawned one, its
exit status reaches the agent through the server, and a server that dies takes its workers
with it and is started again."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import torch
from nats.aio.msg import Msg

from shoal.services.node_agent.agent import NodeAgent
from shoal.services.node_agent.forkserver import ForkServerClient, ForkServerUnavailable
from shoal.services.node_agent.gpus import discover_gpus
from shoal.services.node_agent.processes import worker_env
from shoal.services.worker.forkserver import reseed_after_fork
from shoal.shared import subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.child_process import is_running
from shoal.shared.config import LoggingConfig, NodeConfig, WorkerConfig
from shoal.shared.messages import (
    CacheReplica,
    CreateReplica,
    Event,
    ModelSpec,
    ReplicaRecord,
    StopReplica,
    node_reply_decoder,
)
from shoal.shared.metrics import Registry
from shoal.shared.micro import ServiceCallError, request_json
from shoal.shared.nats_server import EmbeddedNatsServer
from tests.integration.test_warm_restore import MODEL, _complete, _ready, _replicas, one_node_cluster


async def _fork_servers_ready(log_dir: Path, count: int = 1) -> None:
    """Until the agent's fork server has said it is ready `count` times (each start says it once in
    its log): a replica placed before may be spawned directly, by design."""
    log = log_dir / "forkserver.log"
    while not log.exists() or log.read_text().count("forkserver: ready") < count:
        await asyncio.sleep(0.1)


def _parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def _command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


@asynccontextmanager
async def _failures(bus: Bus) -> AsyncIterator[dict[str, asyncio.Future[str]]]:
    """Each failed replica's error, from its ``replica_failed`` event (the scheduler replaces
    a failed replica, and its record with it, at once)."""
    errors: dict[str, asyncio.Future[str]] = collections.defaultdict(asyncio.get_running_loop().create_future)

    async def on_event(msg: Msg) -> None:
        event = msgspec.json.decode(msg.data, type=Event)
        if event.replica_id is not None and not errors[event.replica_id].done():
            errors[event.replica_id].set_result(event.message)

    subscription = await bus.nc.subscribe(subjects.event_subject("replica_failed"), cb=on_event)
    try:
        yield errors
    finally:
        await subscription.unsubscribe()


async def _serving(bus: Bus, other_than: str, count: int) -> list[ReplicaRecord]:
    while len(serving := [r for rid, r in (await _replicas(bus)).items() if r.serving and rid != other_than]) < count:
        await asyncio.sleep(0.1)
    return serving


@pytest.mark.parametrize("fork_server", [True, False], ids=["forked", "spawned"])
async def test_a_worker_serves_and_its_exit_status_reaches_the_agent(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path, fork_server: bool) -> None:
    metrics = Registry()
    async with one_node_cluster(nats_server.url, demo_models_root, tmp_path / "logs", fork_server=fork_server,
                        metrics=metrics) as (bus, scheduler):
        if fork_server:
            await asyncio.wait_for(_fork_servers_ready(tmp_path / "logs"), 120)
        assert (await scheduler.scale(MODEL, 1)).ok
        (worker,) = (await _ready(bus, 1)).values()
        assert worker.pid is not None
        assert (await _complete(bus, "served")).completion_tokens == 6

        parent = _parent_of(worker.pid)
        if fork_server:
            assert parent != os.getpid(), "the fork server is the worker's parent"
            assert "shoal.services.worker.forkserver" in _command_line(parent)
            assert _command_line(worker.pid) == f"shoal worker {MODEL} {worker.replica_id}", "ps names its model"
        else:
            assert parent == os.getpid(), "the agent (this process) spawned it"
        how = "forked" if fork_server else "spawned"
        assert f'shoal_node_worker_starts_total{{how="{how}",node="node-a"}} 1.0' in metrics.render()
        assert "worker_ready" in (tmp_path / "logs" / f"{worker.replica_id}.log").read_text(), "its log is its own"

        async with _failures(bus) as errors:
            os.killpg(worker.pid, signal.SIGKILL)
            assert "worker killed by SIGKILL" in await asyncio.wait_for(errors[worker.replica_id], 30)


async def test_a_fork_server_that_dies_takes_its_workers_and_is_started_again(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    async with one_node_cluster(nats_server.url, demo_models_root, log_dir, fork_server=True) as (bus, scheduler):
        await asyncio.wait_for(_fork_servers_ready(log_dir), 120)
        assert (await scheduler.scale(MODEL, 1)).ok
        (worker,) = (await _ready(bus, 1)).values()
        assert worker.pid is not None
        server = _parent_of(worker.pid)
        async with _failures(bus) as errors:
            os.kill(server, signal.SIGKILL)
            assert "worker killed by SIGKILL" in await asyncio.wait_for(errors[worker.replica_id], 30)
        assert not is_running(worker.pid)

        # The scheduler replaces the failed replica at once (a fork of the new server once it is
        # ready, spawned directly if it is not ready in time); a replica placed after it is ready
        # is its fork.
        await asyncio.wait_for(_fork_servers_ready(log_dir, count=2), 120)
        assert (await scheduler.scale(MODEL, 2)).ok
        serving = await asyncio.wait_for(_serving(bus, other_than=worker.replica_id, count=2), 120)
        parents = {_parent_of(r.pid) for r in serving if r.pid is not None}
        new_servers = [pid for pid in parents if "shoal.services.worker.forkserver" in _command_line(pid)]
        assert new_servers and server not in new_servers, (parents, server)


async def _pending_record(bus: Bus) -> ReplicaRecord:
    """A replica placed on node-a's GPU 0, as a scheduler records it before its create."""
    record = ReplicaRecord(replica_id=uuid.uuid4().hex, model=MODEL, node_id="node-a", gpu_bytes={0: 1 << 28})
    await bus.replicas.create(subjects.replica_kv_key(MODEL, record.replica_id), record)
    return record


async def test_a_replica_stopped_while_its_worker_waits_for_the_fork_server_leaves_no_worker(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    """A create waits for the fork server's imports (seconds); a stop that comes meanwhile finds
    no process and answers so: the worker forked after it must be stopped at once, not left to
    serve a replica nobody knows of."""
    agent_bus, bus = await connect(nats_server.url, "node-a"), await connect(nats_server.url, "test")
    agent = NodeAgent(agent_bus, discover_gpus("virtual:1x2GiB"),
                      NodeConfig(node_id="node-a", models_root=str(demo_models_root)),
                      WorkerConfig(torch_threads=1), LoggingConfig(), nats_url=nats_server.url, log_dir=tmp_path)
    await agent.start()  # its fork server starts importing now
    try:
        record = await _pending_record(bus)
        create = asyncio.create_task(request_json(
            bus.nc, subjects.node_subject("node-a", "create"), CreateReplica(record, ModelSpec(key=MODEL, path=MODEL)),
            node_reply_decoder, timeout_s=60))
        await asyncio.sleep(0.5)
        assert not create.done(), "the create waits for the fork server"
        stopped = await request_json(bus.nc, subjects.node_subject("node-a", "stop"),
                                     StopReplica(record.replica_id, "test"), node_reply_decoder)
        assert stopped.message == "not running"
        created = await create
        assert created.ok and created.pid is not None
        async with asyncio.timeout(30):
            while is_running(created.pid):
                await asyncio.sleep(0.1)
        assert (await _replicas(bus))[record.replica_id] == record, "the stopped worker never claimed its record"
    finally:
        await agent.stop()
        for each in (agent_bus, bus):
            await each.close()


async def test_a_create_that_arrives_after_its_replicas_stop_starts_no_worker(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    """The other order: a model scaled down while its replica's create was in flight, the stop
    overtakes the create. The stop finds nothing to stop and the scheduler frees the memory, so
    a worker the late create started would hold bytes nobody counts."""
    agent_bus, bus = await connect(nats_server.url, "node-a"), await connect(nats_server.url, "test")
    registry = Registry()
    agent = NodeAgent(agent_bus, discover_gpus("virtual:1x2GiB"),
                      NodeConfig(node_id="node-a", models_root=str(demo_models_root), worker_fork_server=False),
                      WorkerConfig(torch_threads=1), LoggingConfig(), nats_url=nats_server.url, log_dir=tmp_path,
                      metrics=registry)
    await agent.start()
    try:
        record = await _pending_record(bus)  # still there: the stop alone refuses the create
        stopped = await request_json(bus.nc, subjects.node_subject("node-a", "stop"),
                                     StopReplica(record.replica_id, "scaled down"), node_reply_decoder)
        assert stopped.message == "not running"
        created = await request_json(
            bus.nc, subjects.node_subject("node-a", "create"), CreateReplica(record, ModelSpec(key=MODEL, path=MODEL)),
            node_reply_decoder, timeout_s=60)
        assert created.ok and created.pid is None, created
        assert created.message == "stopped before its create arrived"
        assert not (tmp_path / f"{record.replica_id}.log").exists(), "no worker was started"
        # Before any failure, the failure counter has its sample (so the first one is a rise).
        assert 'shoal_node_worker_failures_total{node="node-a"} 0.0' in registry.render()

        # A create whose record is gone (a rolled-back placement; a stalled step sent again from
        # a read made before the record went) starts nothing either.
        unrecorded = ReplicaRecord(replica_id=uuid.uuid4().hex, model=MODEL, node_id="node-a", gpu_bytes={0: 1 << 28})
        created = await request_json(
            bus.nc, subjects.node_subject("node-a", "create"),
            CreateReplica(unrecorded, ModelSpec(key=MODEL, path=MODEL)), node_reply_decoder, timeout_s=60)
        assert created.ok and created.pid is None, created
        assert created.message == "no record to start it for: freed before its create arrived"
        assert not (tmp_path / f"{unrecorded.replica_id}.log").exists(), "no worker was started"
    finally:
        await agent.stop()
        for each in (agent_bus, bus):
            await each.close()


async def test_a_launch_the_server_cannot_read_is_refused_and_the_server_forks_on(tmp_path: Path) -> None:
    client = ForkServerClient(tmp_path, worker_env())
    await client.start()
    try:
        with pytest.raises(ForkServerUnavailable, match="not a valid WorkerLaunch"):
            await client.fork(b'{"nats_url": 42}', tmp_path / "w.log", title="shoal worker x y")
        with pytest.raises(ForkServerUnavailable, match="not a valid WorkerLaunch"):
            await client.fork(b"not json", tmp_path / "w.log", title="shoal worker x y")
    finally:
        await client.close()
    assert not (tmp_path / "w.log").exists(), "nothing was forked"


def test_each_forked_child_draws_its_own_random_numbers() -> None:
    """Without a reseed every fork would continue its parent's torch generator: the same samples."""
    torch.manual_seed(0)

    def draws(reseed: bool) -> list[float]:
        results = []
        for _ in range(2):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    if reseed:
                        reseed_after_fork()
                    os.write(write, str(torch.rand(1).item()).encode())
                finally:
                    os._exit(0)  # never back into pytest
            os.close(write)
            with os.fdopen(read) as pipe:
                results.append(float(pipe.read()))
            os.waitpid(pid, 0)
        return results

    same = draws(reseed=False)
    assert same[0] == same[1], "forks continue the parent's generator"
    first, second = draws(reseed=True)
    assert first != second


async def test_a_park_whose_worker_dies_meanwhile_fails_at_once(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    """The agent asks a worker to park and the worker dies (or is stopped: its model removed
    meanwhile) before answering: the park fails when the worker exits, not 2 minutes later
    (`WORKER_CONTROL_TIMEOUT_S`) with its memory and every step waiting on it held all along."""
    async with one_node_cluster(nats_server.url, demo_models_root, tmp_path / "logs", fork_server=False) as (
            bus, scheduler):
        assert (await scheduler.scale(MODEL, 1)).ok
        (worker,) = (await _ready(bus, 1)).values()
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGSTOP)  # it answers nothing from now on
        parking = asyncio.create_task(request_json(
            bus.nc, subjects.node_subject("node-a", "to_cache"), CacheReplica(worker.replica_id), node_reply_decoder,
            timeout_s=150))
        await asyncio.sleep(1.0)
        assert not parking.done()
        os.kill(worker.pid, signal.SIGKILL)
        async with asyncio.timeout(20):
            with pytest.raises(ServiceCallError, match="the worker exited before it answered to_cache"):
                await parking
