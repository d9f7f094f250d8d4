"""A worker takes requests from its pull consumer as they arrive (`services/worker/pulling.py`),
against a real nats-server: in order, none lost, at most as many as asked, and without
sitting out a long wait once messages are there."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from shoal.services.worker.pulling import pull_arrivals
from shoal.shared.nats_server import EmbeddedNatsServer

STREAM = "PULLING"
LONG_WAIT_S = 30.0
"""Each wait for a first message may last this long: a pull that sat out its wait with
messages there would keep the test waiting, and it gives up long before."""


@pytest.fixture
async def pull(nats_server: EmbeddedNatsServer) -> AsyncIterator[tuple[JetStreamContext, JetStreamContext.PullSubscription]]:
    connection = await nats.connect(nats_server.url)
    try:
        js = connection.jetstream()
        await js.add_stream(name=STREAM, subjects=["pulling.>"])
        await js.add_consumer(STREAM, ConsumerConfig(durable_name="worker", ack_policy=AckPolicy.EXPLICIT))
        yield js, await js.pull_subscribe_bind(durable="worker", stream=STREAM)
    finally:
        await connection.close()


async def test_a_burst_in_two_parts_is_taken_in_order_without_a_long_wait(
    pull: tuple[JetStreamContext, JetStreamContext.PullSubscription],
) -> None:
    js, subscription = pull
    taken: list[bytes] = []

    async def take(count: int) -> None:
        while len(taken) < count:
            async for msg in pull_arrivals(subscription, 32, LONG_WAIT_S):
                taken.append(msg.data)
                await msg.ack()

    taking = asyncio.create_task(take(8))
    await asyncio.sleep(0.2)  # its pull request waits on the empty stream
    for number in range(5):
        await js.publish("pulling.x", bytes([number]))
    await asyncio.sleep(0.1)
    for number in range(5, 8):
        await js.publish("pulling.x", bytes([number]))
    await asyncio.wait_for(taking, timeout=10.0)  # each wait may last 30 s: none may be sat out
    assert taken == [bytes([number]) for number in range(8)]


async def test_at_most_max_messages_and_nothing_after_a_quiet_wait(
    pull: tuple[JetStreamContext, JetStreamContext.PullSubscription],
) -> None:
    js, subscription = pull
    for number in range(5):
        await js.publish("pulling.x", bytes([number]))
    # Each call takes the first message and what else comes within FOLLOW_UP_TIMEOUT_S: on an
    # idle machine 3 and then 2; on a loaded one the follow-up may end first, and the rest
    # are the next call's (none lost, none out of order).
    batches: list[list[Msg]] = []
    while sum(len(b) for b in batches) < 5:
        batches.append([msg async for msg in pull_arrivals(subscription, 3, LONG_WAIT_S)])
        assert 1 <= len(batches[-1]) <= 3, [len(b) for b in batches]
    taken = [msg for batch in batches for msg in batch]
    assert [m.data for m in taken] == [bytes([number]) for number in range(5)]
    for msg in taken:
        await msg.ack()
    assert [msg async for msg in pull_arrivals(subscription, 3, 0.3)] == []
    assert [msg async for msg in pull_arrivals(subscription, 0, LONG_WAIT_S)] == []
