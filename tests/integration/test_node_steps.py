"""The scheduler's node steps against a real nats-server: ordering, failures, over-committed GPUs.

The scheduler is the real one (in this process). The node is a stand-in for a node
agent, as in test_concurrent_schedulers: it registers its GPUs, logs every command and
answers it as told (carry it out, fail it, or hold it until the test lets it go), which is
what these tests are about; real agents and workers are in test_warm_restore.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.micro import add_service

from shoal.services.node_agent.release import record_parked, record_stopped
from shoal.services.scheduler.service import SchedulerService
from shoal.services.scheduler.store import StoredCluster
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.config import SchedulerConfig
from shoal.shared.messages import (
    CacheReplica,
    CreateReplica,
    GpuInfo,
    GpuRecord,
    ModelSpec,
    NodeCommand,
    NodeRecord,
    NodeReply,
    Occupant,
    ReplicaRecord,
    RestoreReplica,
    StopReplica,
    node_command_decoders,
    now,
)
from shoal.shared.micro import RequestError, add_json_endpoint
from shoal.shared.model_settings import FairnessSettings, SleepSettings

GIB = 1 << 30
NODE = "n0"


class StandInNode:
    """One node: GPUs of the given sizes, 64 GiB of RAM; commands logged and answered as told."""

    def __init__(self, bus: Bus, gpu_gib: tuple[int, ...]) -> None:
        self._bus = bus
        self._gpus = [GpuInfo(index=i, total_bytes=g * GIB, virtual=True) for i, g in enumerate(gpu_gib)]
        self.log: list[tuple[str, str]] = []
        """(verb, replica id) when a command arrives; ("to_cache_done", id) when a to_cache ends."""
        self.failing: set[tuple[str, str]] = set()
        """(verb, replica id) to answer with an error; replica id "*": every replica."""
        self.gate: asyncio.Event | None = None
        """When set, to_cache waits for it."""
        self.arrived: dict[str, asyncio.Event] = {}
        self._heartbeat: asyncio.Task[None] | None = None

    async def start(self) -> None:
        service = await add_service(self._bus.nc, name="stand-in-node", version="0.0.1")
        for verb in ("create", "stop", "to_cache", "from_cache"):
            await add_json_endpoint(service, verb, subjects.node_subject(NODE, verb), node_command_decoders[verb].decode,
                                    self._answer)
        for gpu in self._gpus:
            await self._bus.gpus.put(subjects.gpu_kv_key(NODE, gpu.index),
                                     GpuRecord(node_id=NODE, index=gpu.index, total_bytes=gpu.total_bytes, virtual=True))
        await self._beat()
        self._heartbeat = asyncio.create_task(self._beat_forever())

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()

    def arrival(self, verb: str, replica_id: str) -> asyncio.Event:
        return self.arrived.setdefault(f"{verb}:{replica_id}", asyncio.Event())

    async def _answer(self, command: NodeCommand) -> NodeReply:
        match command:
            case CreateReplica(replica=record) | RestoreReplica(replica=record):
                verb, replica_id = command.__struct_config__.tag, record.replica_id
            case StopReplica(replica_id=replica_id):
                verb = "stop"
            case CacheReplica(replica_id=replica_id):
                verb = "to_cache"
            case _:
                raise RequestError(400, "not a replica command")
        assert isinstance(verb, str)
        self.log.append((verb, replica_id))
        self.arrival(verb, replica_id).set()
        if verb == "to_cache" and self.gate is not None:
            await self.gate.wait()
        if (verb, replica_id) in self.failing or (verb, "*") in self.failing:
            raise RequestError(502, f"stand-in refuses {verb} of {replica_id}")
        if verb in ("to_cache", "stop"):  # what the node agent writes once the worker parked or stopped
            await self._release(verb, replica_id)
        if verb == "to_cache":
            self.log.append(("to_cache_done", replica_id))
        return NodeReply(ok=True)

    async def _release(self, verb: str, replica_id: str) -> None:
        entries = await self._bus.replicas.get_all(f"*.{replica_id}")
        for entry in entries.values():
            if verb == "to_cache":
                await record_parked(self._bus, entry.value, {i: 0 for i in entry.value.gpu_bytes},
                                    weights_dropped=entry.value.weights_dropped)
            else:
                await record_stopped(self._bus, entry.value)

    async def _beat(self) -> None:
        await self._bus.nodes.put(NODE, NodeRecord(node_id=NODE, hostname="test", gpus=self._gpus,
                                                   cpu_ram_bytes=64 * GIB, virtual=True, heartbeat_at=now()))

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(3.0)
            await self._beat()


@pytest.fixture
async def node(bus: Bus) -> AsyncIterator[StandInNode]:
    yield StandInNode(bus, (10, 5))


@pytest.fixture
async def scheduler(bus: Bus) -> AsyncIterator[SchedulerService]:
    instance = SchedulerService(bus, SchedulerConfig(scheduler_id="s1", reconcile_interval_s=3600))
    await instance.start()
    yield instance
    await instance.stop()


async def _serving(bus: Bus, model: str, replica_id: str, gpu_bytes: dict[int, int]) -> None:
    """A HOT, ready replica with its occupants, as a node agent leaves it."""
    for index, num_bytes in gpu_bytes.items():
        key = subjects.gpu_kv_key(NODE, index)
        entry = await bus.gpus.get(key)
        assert entry is not None
        occupant = Occupant(replica_id=replica_id, model=model, num_bytes=num_bytes, state="serving", since=now(),
                            last_accessed=now())
        entry.value.occupants.append(occupant)
        await bus.gpus.put(key, entry.value)
    await bus.replicas.put(subjects.replica_kv_key(model, replica_id), ReplicaRecord(
        replica_id=replica_id, model=model, node_id=NODE, gpu_bytes=gpu_bytes, state="ready", cpu_bytes=GIB,
        ready_at=now(), created_at=now()))


IMPATIENT = FairnessSettings(min_runtime_s=0.0, max_wait_s=0.0)
"""Preempted at once, and preempting at once: the node-step tests are not about fairness."""


async def _model(bus: Bus, key: str, gib: int, desired: int = 0) -> None:
    await bus.models.put(subjects.model_token(key), ModelSpec(
        key=key, path=key, weight_bytes=GIB, measured_serving_bytes=gib * GIB, desired_replicas=desired,
        fairness=IMPATIENT))


async def _gpu(bus: Bus, index: int) -> GpuRecord:
    entry = await bus.gpus.get(subjects.gpu_kv_key(NODE, index))
    assert entry is not None
    return entry.value


async def _replicas(bus: Bus, model: str) -> dict[str, ReplicaRecord]:
    entries = await bus.replicas.get_all(subjects.model_token(model) + ".*")
    return {e.value.replica_id: e.value for e in entries.values()}


async def _spec(bus: Bus, model: str) -> ModelSpec:
    entry = await bus.models.get(subjects.model_token(model))
    assert entry is not None
    return entry.value


async def _until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    """Wait for background work (no time limit of its own: the test's timeout applies)."""
    while not await predicate():
        await asyncio.sleep(0.05)


async def test_an_eviction_on_an_over_committed_gpu_commits(bus: Bus, scheduler: SchedulerService) -> None:
    node = StandInNode(bus, (40,))
    await node.start()
    try:
        await _model(bus, "org/x", 30, desired=3)
        for replica_id in ("a", "b", "c"):  # 90 GiB on a 40 GiB GPU: the node re-registered smaller
            await _serving(bus, "org/x", replica_id, {0: 30 * GIB})
        reply = await scheduler.evict("org/x", "b")
        assert reply.ok and reply.status != "contended", reply.message
        gpu = await _gpu(bus, 0)
        assert gpu.reserved_bytes == 60 * GIB
        assert {o.replica_id: o.state for o in gpu.occupants} == {"a": "serving", "c": "serving", "b": "sleeping"}
        assert ("to_cache", "b") in node.log
    finally:
        await node.stop()


async def test_a_failed_to_cache_keeps_the_memory_until_the_worker_is_stopped(
        bus: Bus, node: StandInNode, scheduler: SchedulerService) -> None:
    await node.start()
    await _model(bus, "org/x", 11, desired=1)  # measured since x1 was placed: x fits no GPU now
    await _model(bus, "org/m", 6)  # more than GPU 1 (5 GiB): m must preempt x1 on GPU 0
    await _serving(bus, "org/x", "x1", {0: 8 * GIB})
    node.failing.add(("to_cache", "x1"))

    reply = await scheduler.ensure("org/m")
    assert reply.status == "waking", reply

    async def held() -> bool:
        return any(r.state == "stopping" for r in (await _replicas(bus, "org/x")).values())

    await _until(held, "x1 held after its failed park")
    # x1's worker may still hold its memory: it stays accounted, and m is not placed on it.
    (x1,) = (await _replicas(bus, "org/x")).values()
    assert (x1.replica_id, x1.level, x1.state, x1.gpu_bytes) == ("x1", "HOT", "stopping", {0: 8 * GIB})
    gpu = await _gpu(bus, 0)
    assert [(o.replica_id, o.num_bytes, o.state) for o in gpu.occupants] == [("x1", 8 * GIB, "draining")]
    assert await _replicas(bus, "org/m") == {}
    assert [verb for verb, _ in node.log] == ["to_cache"]
    assert (await _spec(bus, "org/x")).desired_replicas == 1, "a preemption keeps the desired count"

    # The reconciler frees x1 once the node confirms its worker stopped; the wake, still
    # waiting for the memory (a request keeps asking), places m on it.
    await scheduler.reconcile()
    assert ("stop", "x1") in node.log
    assert await _replicas(bus, "org/x") == {}
    await scheduler.ensure("org/m")  # the waiting request's heartbeat

    async def m_placed() -> bool:
        return bool(await _replicas(bus, "org/m"))

    await _until(m_placed, "m placed on the freed memory")
    (placed,) = (await _replicas(bus, "org/m")).values()
    assert placed.gpu_bytes == {0: 6 * GIB}
    assert node.log[-1] == ("create", placed.replica_id)
    assert (await _spec(bus, "org/x")).desired_replicas == 1


async def test_a_failed_create_is_freed_and_counted_once(bus: Bus, node: StandInNode, scheduler: SchedulerService) -> None:
    await node.start()
    await _model(bus, "org/f", 4)
    node.failing.add(("create", "*"))
    reply = await scheduler.ensure("org/f")
    assert "failed" in reply.message, reply.message
    (replica_id,) = [rid for verb, rid in node.log if verb == "create"]

    async def freed() -> bool:
        spec = await _spec(bus, "org/f")
        return spec.num_failures == 1 and await _replicas(bus, "org/f") == {}

    await _until(freed, "the failed replica to be freed")
    assert all(not g.occupants for g in [await _gpu(bus, 0), await _gpu(bus, 1)])
    assert (await _spec(bus, "org/f")).desired_replicas == 0, "it never served: seed 002 lowers the count"
    # The node agent (or a reconciler) reporting the same failure again changes nothing.
    await scheduler.on_replica_failed("org/f", replica_id, "reported again")
    assert (await _spec(bus, "org/f")).num_failures == 1


async def test_node_steps_run_outside_the_pass_lock_and_in_order_per_gpu(
        bus: Bus, node: StandInNode, scheduler: SchedulerService) -> None:
    await node.start()
    await _model(bus, "org/x", 8)
    await _model(bus, "org/y", 3)
    await _model(bus, "org/z", 6)
    await _serving(bus, "org/x", "x1", {0: 8 * GIB})
    node.gate = asyncio.Event()

    evicting = asyncio.create_task(scheduler.evict("org/x", "x1"))
    await node.arrival("to_cache", "x1").wait()

    # x1 is still parking: a pass for another GPU commits and its node steps run.
    reply = await scheduler.ensure("org/y")
    assert reply.ok, reply.message
    (y,) = (await _replicas(bus, "org/y")).values()
    assert y.gpu_bytes == {1: 3 * GIB} and ("create", y.replica_id) in node.log
    assert not evicting.done()

    # z only fits on GPU 0, whose memory x1 is still giving back: z waits for it (no one else
    # is preempted for memory already on its way back) and is placed once x1 has parked.
    reply = await scheduler.ensure("org/z")
    assert reply.status == "waking", reply
    assert await _replicas(bus, "org/z") == {}
    node.gate.set()
    assert (await evicting).ok

    async def z_placed() -> bool:
        await scheduler.ensure("org/z")  # the waiting request's heartbeat
        return bool(await _replicas(bus, "org/z"))

    await _until(z_placed, "z placed once x1 parked")
    (z,) = (await _replicas(bus, "org/z")).values()
    assert z.gpu_bytes == {0: 6 * GIB}
    assert node.log.index(("to_cache_done", "x1")) < node.log.index(("create", z.replica_id))
    assert [verb for verb, rid in node.log if rid == "x1"] == ["to_cache", "to_cache_done"], "only x1 was evicted"


class KvWrites:
    """Every write to ``shoal_replicas`` and ``shoal_gpus``, in the order the server routed
    them: one core subscription on their subjects sees one publisher's messages in order."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str, str, bytes]] = []
        """(bucket, key, operation, value)."""

    async def start(self, bus: Bus) -> None:
        await bus.nc.subscribe("$KV.>", cb=self._on_message)

    async def _on_message(self, msg) -> None:  # type: ignore[no-untyped-def]
        _, bucket, key = msg.subject.split(".", 2)
        if bucket in ("shoal_replicas", "shoal_gpus"):
            self.writes.append((bucket, key, (msg.headers or {}).get("KV-Operation", "PUT"), msg.data))

    def index(self, predicate) -> int:  # type: ignore[no-untyped-def]
        """Position of the first write that `predicate(bucket, key, operation, value)` accepts."""
        found = [i for i, write in enumerate(self.writes) if predicate(*write)]
        assert found, f"no such write among {self.writes}"
        return found[0]

    def seen(self, predicate) -> bool:  # type: ignore[no-untyped-def]
        return any(predicate(*write) for write in self.writes)


def _record_deleted(model: str, replica_id: str):  # type: ignore[no-untyped-def]
    key = subjects.replica_kv_key(model, replica_id)
    return lambda bucket, k, op, _: bucket == "shoal_replicas" and k == key and op == "DEL"


def _occupant_gone(gpu_key: str, replica_id: str):  # type: ignore[no-untyped-def]
    def accept(bucket: str, key: str, op: str, value: bytes) -> bool:
        if bucket != "shoal_gpus" or key != gpu_key or op != "PUT":
            return False
        return all(o.replica_id != replica_id for o in msgspec.json.decode(value, type=GpuRecord).occupants)
    return accept


async def test_a_failed_replicas_memory_is_given_back_before_its_record_goes(
        bus: Bus, node: StandInNode, scheduler: SchedulerService) -> None:
    await node.start()
    await _model(bus, "org/f", 4, desired=1)
    await _serving(bus, "org/f", "f1", {0: 4 * GIB})
    kv = KvWrites()
    await kv.start(bus)

    await scheduler.on_replica_failed("org/f", "f1", "worker exited with 1")

    deleted = _record_deleted("org/f", "f1")

    async def delete_seen() -> bool:
        return kv.seen(deleted)

    await _until(delete_seen, "the record's delete to be routed")
    key = subjects.replica_kv_key("org/f", "f1")
    claimed = kv.index(lambda bucket, k, op, value: bucket == "shoal_replicas" and k == key and op == "PUT"
                       and msgspec.json.decode(value, type=ReplicaRecord).state == "failed")
    freed = kv.index(_occupant_gone(subjects.gpu_kv_key(NODE, 0), "f1"))
    # Claimed (no pass plans with a failed record), then the memory given back, then the
    # record deleted: at no moment is memory reserved for a replica with no record.
    assert claimed < freed < kv.index(deleted), kv.writes
    assert (await _spec(bus, "org/f")).num_failures == 1


async def test_a_failure_reported_at_once_by_two_schedulers_is_counted_once(
        bus: Bus, node: StandInNode, scheduler: SchedulerService) -> None:
    await node.start()
    await _model(bus, "org/f", 4, desired=2)
    await _serving(bus, "org/f", "f1", {0: 4 * GIB})
    other = SchedulerService(bus, SchedulerConfig(scheduler_id="s2", reconcile_interval_s=3600))
    try:
        await asyncio.gather(scheduler.on_replica_failed("org/f", "f1", "reported by the node agent"),
                             other.on_replica_failed("org/f", "f1", "reported by a reconciler"),
                             scheduler.on_replica_failed("org/f", "f1", "reported by a node step"))
        spec = await _spec(bus, "org/f")
        assert (spec.num_failures, spec.desired_replicas) == (1, 2)
        assert all(o.replica_id != "f1" for o in (await _gpu(bus, 0)).occupants)
        assert "f1" not in await _replicas(bus, "org/f")
    finally:
        await other.stop()


async def test_a_held_replicas_memory_is_given_back_before_its_record_goes(
        bus: Bus, node: StandInNode, scheduler: SchedulerService) -> None:
    await node.start()
    await _model(bus, "org/x", 11, desired=1)
    await _model(bus, "org/m", 6)
    await _serving(bus, "org/x", "x1", {0: 8 * GIB})
    node.failing.add(("to_cache", "x1"))
    await scheduler.ensure("org/m")  # m's wake preempts x1, whose to_cache fails: x1 is held ("stopping")

    async def held() -> bool:
        return any(r.state == "stopping" for r in (await _replicas(bus, "org/x")).values())

    await _until(held, "x1 held after its failed park")
    kv = KvWrites()
    await kv.start(bus)

    await scheduler.reconcile()

    deleted = _record_deleted("org/x", "x1")

    async def delete_seen() -> bool:
        return kv.seen(deleted)

    await _until(delete_seen, "the record's delete to be routed")
    assert kv.index(_occupant_gone(subjects.gpu_kv_key(NODE, 0), "x1")) < kv.index(deleted), kv.writes


async def test_a_wake_nobody_waits_for_is_cancelled_and_leaves_no_intent(
        bus: Bus, node: StandInNode, scheduler: SchedulerService) -> None:
    await node.start()
    # x1 will sleep by itself (idle) within m's long fairness wait, so m's wake waits...
    await bus.models.put(subjects.model_token("org/x"), ModelSpec(
        key="org/x", path="org/x", weight_bytes=GIB, measured_serving_bytes=8 * GIB, desired_replicas=1,
        fairness=IMPATIENT, sleep=SleepSettings(idle_timeout_s=60.0)))
    await bus.models.put(subjects.model_token("org/m"), ModelSpec(
        key="org/m", path="org/m", weight_bytes=GIB, measured_serving_bytes=6 * GIB,
        fairness=FairnessSettings(max_wait_s=120.0)))
    await _serving(bus, "org/x", "x1", {0: 8 * GIB})
    reply = await scheduler.ensure("org/m")
    assert reply.status == "waking", reply

    async def intent_written() -> bool:
        return any(i.model == "org/m" for i in (await _gpu(bus, 0)).intents)

    await _until(intent_written, "m's intent")
    # ...and nobody asks again (every waiting request went away): the wake is cancelled.

    async def cancelled() -> bool:
        return scheduler.wakes.phase_of("org/m") is None

    await _until(cancelled, "the wake to be cancelled")
    assert (await _gpu(bus, 0)).intents == []
    assert await _replicas(bus, "org/m") == {} and [verb for verb, _ in node.log] == [], "nothing was preempted"
    assert 'outcome="cancelled"' in scheduler.metrics.render()


async def test_only_a_replica_whose_model_is_really_gone_is_stopped_by_the_reconciler(
        bus: Bus, node: StandInNode, scheduler: SchedulerService, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot reads the specs first (store.py), so a model registered and placed while it
    read the records has records and no spec there: the reconciler looks the spec up before it
    stops such a replica. A model that was removed loses its replica."""
    await node.start()
    await _model(bus, "org/new", 4, desired=1)
    await _serving(bus, "org/new", "n1", {0: 4 * GIB})
    await _serving(bus, "org/old", "o1", {1: 2 * GIB})  # never registered (removed)
    snapshot = await scheduler.store.snapshot()
    specs_read_before_it_registered = {k: v for k, v in snapshot.models.items() if v.value.key != "org/new"}

    async def racing_snapshot() -> StoredCluster:
        return dataclasses.replace(snapshot, models=specs_read_before_it_registered)

    monkeypatch.setattr(scheduler.store, "snapshot", racing_snapshot)
    await scheduler.reconcile()

    async def old_stopped() -> bool:
        return ("stop", "o1") in node.log

    await _until(old_stopped, "the removed model's replica stopped")
    assert ("stop", "n1") not in node.log and "n1" in await _replicas(bus, "org/new")
