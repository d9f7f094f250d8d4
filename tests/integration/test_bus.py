from __future__ import annotations

import asyncio

from nats.js.api import RetentionPolicy

from shoal.shared import subjects
from shoal.shared.bus import Bus, cas_update, connect
from shoal.shared.messages import GpuRecord, Occupant
from shoal.shared.nats_server import EmbeddedNatsServer


async def test_streams_and_buckets_are_created_idempotently(nats_server: EmbeddedNatsServer) -> None:
    first = await connect(nats_server.url, "first")
    second = await connect(nats_server.url, "second")  # same resources again: no error
    try:
        names = {s.config.name for s in await first.js.streams_info()}
        assert {subjects.REQUESTS_STREAM, subjects.EVENTS_STREAM} <= names
        for bucket in (subjects.MODELS_BUCKET, subjects.GPUS_BUCKET, subjects.REPLICAS_BUCKET, subjects.NODES_BUCKET):
            status = await second.js.key_value(bucket)
            assert (await status.status()).bucket == bucket
        info = await first.js.stream_info(subjects.REQUESTS_STREAM)
        assert info.config.retention == RetentionPolicy.WORK_QUEUE
        assert info.config.description
    finally:
        await first.close()
        await second.close()


async def test_cas_update_detects_a_conflicting_writer(bus: Bus) -> None:
    gpu = GpuRecord(node_id="n", index=0, total_bytes=100)
    rev = await bus.gpus.create("n.0", gpu)
    assert rev is not None
    assert await bus.gpus.create("n.0", gpu) is None, "create must refuse an existing key"

    stale = await bus.gpus.get("n.0")
    assert stale is not None
    occupied = GpuRecord(node_id="n", index=0, total_bytes=100, occupants=[Occupant("r1", "m", 60, "serving", 0.0)])
    assert await bus.gpus.update("n.0", occupied, stale.revision) is not None
    # A second writer holding the old revision must lose.
    assert await bus.gpus.update("n.0", gpu, stale.revision) is None


async def test_concurrent_cas_updates_never_lose_a_write(bus: Bus) -> None:
    await bus.gpus.create("n.0", GpuRecord(node_id="n", index=0, total_bytes=10_000))
    conflicts = 0

    def count_conflict() -> None:
        nonlocal conflicts
        conflicts += 1

    async def add(replica: str) -> None:
        def mutate(current: GpuRecord | None) -> GpuRecord | None:
            assert current is not None
            occupants = [*current.occupants, Occupant(replica, "m", 10, "serving", 0.0)]
            return GpuRecord(node_id="n", index=0, total_bytes=current.total_bytes, occupants=occupants)

        await cas_update(bus.gpus, "n.0", mutate, max_attempts=100, on_conflict=count_conflict)

    await asyncio.gather(*(add(f"r{i}") for i in range(30)))
    final = await bus.gpus.get("n.0")
    assert final is not None
    assert sorted(o.replica_id for o in final.value.occupants) == sorted(f"r{i}" for i in range(30))
    assert conflicts > 0, "30 concurrent writers should have raced at least once"


async def test_malformed_kv_value_reads_as_absent(bus: Bus) -> None:
    await bus.gpus.kv.put("n.9", b"{not json")
    assert await bus.gpus.get("n.9") is None
    await bus.gpus.put("n.1", GpuRecord(node_id="n", index=1, total_bytes=1))
    everything = await bus.gpus.get_all()
    assert set(everything) == {"n.1"}
