"""What a client on the bus could forge, refused by the real services: a worker event for a
replica it does not run, a replica id that would become a file name, a replica count that
floods the scheduler, a model path out of the models root, bytes that are not a message.
Each is refused with a 4xx and changes nothing; the services go on serving. (The worker's
side, a forged reply subject and huge prompts: tests/integration/test_worker_serving.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from shoal.services.node_agent.agent import NodeAgent
from shoal.services.node_agent.gpus import discover_gpus
from shoal.services.scheduler.service import SchedulerService
from shoal.shared import subjects
from shoal.shared.bus import Bus, connect
from shoal.shared.config import LoggingConfig, NodeConfig, SchedulerConfig, WorkerConfig
from shoal.shared.messages import (
    EnsureModel,
    ModelSpec,
    NodeReply,
    RegisterModel,
    ReplicaRecord,
    WorkerEvent,
    node_reply_decoder,
    scheduler_reply_decoder,
)
from shoal.shared.micro import ServiceError, request_json
from shoal.shared.nats_server import EmbeddedNatsServer

MODEL = "demo/llama-5m"
NODE = "node-a"


@pytest.fixture
async def serving(nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path
                  ) -> AsyncIterator[tuple[Bus, ReplicaRecord, Path]]:
    """A node agent and a scheduler, one replica of MODEL ready; (test bus, its record, log dir)."""
    buses = [await connect(nats_server.url, name) for name in ("scheduler", "node", "test")]
    log_dir = tmp_path / "logs"
    agent = NodeAgent(buses[1], discover_gpus("virtual:1x4GiB"),
                      NodeConfig(node_id=NODE, models_root=str(demo_models_root)), WorkerConfig(torch_threads=1),
                      LoggingConfig(),
                      nats_url=nats_server.url, log_dir=log_dir)
    await agent.start()
    scheduler = SchedulerService(buses[0], SchedulerConfig(reconcile_interval_s=3600))
    await scheduler.start([ModelSpec(key=MODEL, path=MODEL)])
    try:
        assert (await scheduler.ensure(MODEL)).ok
        for _ in range(480):  # ready, and the model's measured figure written (the agent's next write)
            records = [e.value for e in (await buses[2].replicas.get_all()).values()]
            if any(r.state == "ready" for r in records) and await _measured(buses[2]) is not None:
                break
            await asyncio.sleep(0.25)
        (record,) = records
        assert record.state == "ready", record
        yield buses[2], record, log_dir
    finally:
        await scheduler.stop()
        await agent.stop()
        for bus in buses:
            await bus.close()


async def _event(bus: Bus, event: WorkerEvent) -> NodeReply:
    return await request_json(bus.nc, subjects.node_subject(NODE, "worker_event"), event, node_reply_decoder)


async def _measured(bus: Bus) -> int | None:
    entry = await bus.models.get(subjects.model_token(MODEL))
    assert entry is not None
    return entry.value.measured_serving_bytes


async def test_a_ready_event_not_from_the_replicas_worker_changes_nothing(
    serving: tuple[Bus, ReplicaRecord, Path]
) -> None:
    bus, record, _ = serving
    measured = await _measured(bus)
    assert measured is not None and measured > 1 << 20
    for token in ("", "0" * 32):
        for kind in ("ready", "failed"):
            forged = WorkerEvent(record.replica_id, kind, message="forged", measured_bytes=1, pid=record.pid,
                                 token=token)
            with pytest.raises(ServiceError) as excinfo:
                await _event(bus, forged)
            assert excinfo.value.code == 403
    for raw in (b"\xff\x00", b'{"replica_id": "' + record.replica_id.encode() + b'", "kind": "ready", "pid": "x"}',
                b'{"replica_id": "nobody-runs-this", "kind": "ready", "measured_bytes": 1, "token": "t"}'):
        reply = await bus.nc.request(subjects.node_subject(NODE, "worker_event"), raw, timeout=10)
        assert reply.headers is not None and reply.headers.get("Nats-Service-Error-Code", "")[:1] == "4", reply.data
    assert await _measured(bus) == measured, "the model's measured memory was not lowered"
    after = (await bus.replicas.get(subjects.replica_kv_key(MODEL, record.replica_id)))
    assert after is not None and after.value.state == "ready" and after.value.measured_bytes == record.measured_bytes


async def test_a_replica_id_that_would_leave_the_log_directory_is_refused(
    serving: tuple[Bus, ReplicaRecord, Path], tmp_path: Path
) -> None:
    bus, record, log_dir = serving
    raw = (b'{"type": "create", "replica": {"replica_id": "../../escaped", "model": "' + MODEL.encode()
           + b'", "node_id": "' + NODE.encode() + b'", "gpu_bytes": {"0": 1048576}}, "model": {"key": "'
           + MODEL.encode() + b'", "path": "' + MODEL.encode() + b'"}}')
    reply = await bus.nc.request(subjects.node_subject(NODE, "create"), raw, timeout=10)
    assert reply.headers is not None and reply.headers.get("Nats-Service-Error-Code") == "400"
    assert not list(tmp_path.rglob("escaped*")), "no file was made for it"
    assert sorted(p.name for p in log_dir.iterdir()) == [f"{record.replica_id}.log", "forkserver.log"]


FORGED_COMMANDS = [
    ("scale", {"type": "scale", "model": MODEL, "num_replicas": 10**9}),
    ("ensure", {"type": "ensure", "model": MODEL, "min_replicas": 5000}),
    ("evict", {"type": "evict", "model": MODEL, "replica_id": "a.b"}),
    ("remove", {"type": "remove", "model": "../\u0000"}),
    ("register", {"type": "register", "spec": {"key": MODEL, "path": "../../etc"}}),
    ("ensure", b"\x80\x81 not json"),
    ("scale", b'{"type": "scale", "model": 7}'),
]


async def test_the_scheduler_refuses_forged_counts_ids_names_and_bytes(serving: tuple[Bus, ReplicaRecord, Path]
                                                                       ) -> None:
    bus, record, _ = serving
    for verb, body in FORGED_COMMANDS:
        data = body if isinstance(body, bytes) else msgspec.json.encode(body)
        reply = await bus.nc.request(subjects.scheduler_subject(verb), data, timeout=30)
        assert reply.headers is not None and reply.headers.get("Nats-Service-Error-Code") == "400", (verb, reply.data)
    records = [e.value for e in (await bus.replicas.get_all()).values()]
    assert [r.replica_id for r in records] == [record.replica_id]
    spec = (await bus.models.get(subjects.model_token(MODEL)))
    assert spec is not None and spec.value.desired_replicas == 1 and spec.value.path == MODEL
    status = await request_json(bus.nc, subjects.scheduler_subject("ensure"), EnsureModel(MODEL),
                                scheduler_reply_decoder)
    assert status.ok, "the scheduler goes on serving"


async def test_a_registration_sets_settings_never_what_the_cluster_measured(
    serving: tuple[Bus, ReplicaRecord, Path]
) -> None:
    """A register command over the bus carries a whole ModelSpec: its learned fields (measured
    memory, sizes, a lease, a failure hold) would let a client shrink a model's footprint or
    block its placement. The scheduler keeps only the operator's settings."""
    bus, _, _ = serving
    learned = {"measured_serving_bytes": 1, "estimated_bytes": 1, "weight_bytes": 1, "num_parameters": 1,
               "lease_owner": "forger", "lease_until": 4e9, "hold_until": 4e9, "num_failures": 99,
               "wake_blocked_until": 4e9, "wake_blocked_reason": "forged"}
    measured = await _measured(bus)
    for key in (MODEL, "forged/new-model"):  # over a registration, and a new one
        spec = {"key": key, "path": MODEL, "kv_cache_tokens": 4096, **learned}
        reply = await request_json(bus.nc, subjects.scheduler_subject("register"),
                                   msgspec.json.decode(msgspec.json.encode({"type": "register", "spec": spec}),
                                                       type=RegisterModel), scheduler_reply_decoder)
        assert reply.ok and reply.model is not None, reply
        stored = (await bus.models.get(subjects.model_token(key)))
        assert stored is not None
        taken = {name for name, value in learned.items() if getattr(stored.value, name) == value}
        assert not taken, f"{key}: the scheduler stored {taken} from the message"
        assert stored.value.kv_cache_tokens == 4096, "the settings are taken"
    assert await _measured(bus) in (measured, None), "a new footprint is unmeasured, never the forged figure"
