"""`get_all` on a real nats-server: complete reads, current values only, no consumers left
behind; the longest model key names a consumer JetStream accepts."""

from __future__ import annotations

import asyncio

import pytest

from shoal.shared import subjects
from shoal.shared.bus import GET_ALL_BATCH, Bus, ensure_model_consumer
from shoal.shared.messages import GpuRecord, ModelSpec
from shoal.shared.subjects import InvalidModelKey


async def _num_consumers(bus: Bus, stream: str) -> int:
    return (await bus.js.stream_info(stream)).state.consumer_count


async def test_repeated_get_all_leaves_no_consumers_behind(bus: Bus) -> None:
    for name in ("a", "b", "c"):
        await bus.models.put(name, ModelSpec(key=f"org/{name}", path=name))
    stream = f"KV_{subjects.MODELS_BUCKET}"
    assert await _num_consumers(bus, stream) == 0
    for i in range(10):  # a reconcile loop reads every few seconds
        assert set(await bus.models.get_all()) == {"a", "b", "c"}, f"read {i}"
        assert set(await bus.models.get_all("a")) == {"a"}, f"read {i}"
        assert await _num_consumers(bus, stream) == 0, f"consumers left after read {i}"
    assert set(await bus.replicas.get_all()) == set()  # an empty bucket too
    assert await _num_consumers(bus, f"KV_{subjects.REPLICAS_BUCKET}") == 0


async def test_every_read_of_a_filled_bucket_is_complete(bus: Bus) -> None:
    # nats-py's watcher could report "no more entries" before the first one arrived: an
    # empty read of a bucket with keys. Many back-to-back reads catch that if it is back.
    for index in range(3):
        await bus.gpus.put(f"n.{index}", GpuRecord(node_id="n", index=index, total_bytes=1))
    for i in range(200):
        assert set(await bus.gpus.get_all("n.1")) == {"n.1"}, f"read {i}"
        assert len(await bus.gpus.get_all()) == 3, f"read {i}"


async def test_reads_see_the_latest_value_and_no_deleted_or_purged_key(bus: Bus) -> None:
    await bus.gpus.put("n.0", GpuRecord(node_id="n", index=0, total_bytes=1))
    revision = await bus.gpus.put("n.0", GpuRecord(node_id="n", index=0, total_bytes=2))
    for index in (1, 2):
        await bus.gpus.put(f"n.{index}", GpuRecord(node_id="n", index=index, total_bytes=1))
    await bus.gpus.kv.delete("n.1")
    await bus.gpus.kv.purge("n.2")
    everything = await bus.gpus.get_all()
    assert set(everything) == {"n.0"}
    assert everything["n.0"].value.total_bytes == 2 and everything["n.0"].revision == revision
    assert await bus.gpus.get_all("m.*") == {}
    assert await _num_consumers(bus, f"KV_{subjects.GPUS_BUCKET}") == 0


async def test_a_read_spanning_several_fetches_gets_every_key(bus: Bus) -> None:
    num_keys = 2 * GET_ALL_BATCH + 7
    await asyncio.gather(*(bus.gpus.put(f"n.{index}", GpuRecord(node_id="n", index=index, total_bytes=index))
                           for index in range(num_keys)))
    everything = await bus.gpus.get_all()
    assert {key: versioned.value.total_bytes for key, versioned in everything.items()} == {
        f"n.{index}": index for index in range(num_keys)}


async def test_the_longest_model_token_names_a_consumer_jetstream_accepts(bus: Bus) -> None:
    longest = "org/" + "a" * (subjects.MAX_MODEL_TOKEN_CHARS - len(subjects.model_token("org/")))
    assert len(subjects.consumer_name(longest)) == subjects.MAX_CONSUMER_NAME_CHARS
    durable = await ensure_model_consumer(bus.js, longest)
    info = await bus.js.consumer_info(subjects.REQUESTS_STREAM, durable)
    assert info.name == durable
    with pytest.raises(InvalidModelKey, match="consumer name"):
        subjects.consumer_name(longest + "a")
