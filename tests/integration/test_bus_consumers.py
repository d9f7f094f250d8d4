"""Consumers Shoal leaves on a real nats-server: `get_all` leaves none; the longest model key fits."""

from __future__ import annotations

import pytest

from shoal.shared import subjects
from shoal.shared.bus import Bus, ensure_model_consumer
from shoal.shared.messages import ModelSpec
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


async def test_the_longest_model_token_names_a_consumer_jetstream_accepts(bus: Bus) -> None:
    longest = "org/" + "a" * (subjects.MAX_MODEL_TOKEN_CHARS - len(subjects.model_token("org/")))
    assert len(subjects.consumer_name(longest)) == subjects.MAX_CONSUMER_NAME_CHARS
    durable = await ensure_model_consumer(bus.js, longest)
    info = await bus.js.consumer_info(subjects.REQUESTS_STREAM, durable)
    assert info.name == durable
    with pytest.raises(InvalidModelKey, match="consumer name"):
        subjects.consumer_name(longest + "a")
