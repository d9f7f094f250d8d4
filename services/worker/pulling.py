"""Taking requests from a JetStream pull consumer as they arrive.

Measured through `shoal up` (llama-5m, 8 requests arriving together, `scripts/bench_peers.py`
at C = 8): in 7 of 24 rounds some requests of a burst sat in the stream for 170-640 ms while
the worker's `fetch(batch=32)` loop ran. Stamps per fetch: one fetch returned 5 of a burst at
once, the next one the other 3 after 636 ms; another, 1 and then 7 after 176 ms. Both times
the rest came exactly 1 s (the fetch timeout) after an earlier fetch had sent its pull
request: a lingering pull request the client had stopped waiting for (a fetch that returned
on a status message leaves its request open on the server) held them until it expired,
the stall nats-py's own comments in `_fetch_n` describe for orphaned pull requests. A bare
client could not reproduce it; the services did, one round in three.

So a worker asks for one message (`fetch(batch=1)`: a pull request that ends with its
message), starts it, and only then asks for whatever else is queued, with a pull request
that expires in milliseconds: no pull request of more than one message outlives its fetch.
Same benchmark, 9 rounds: no stall.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

FOLLOW_UP_TIMEOUT_S = 0.002
"""How long the pull request for the rest of a burst lives: messages already in the stream
come within it; later ones are the next wait's."""
LATE_ARRIVAL_TIMEOUT_S = 0.05
"""How long taking a message already delivered to the subscription may wait (it is there: only
a status message in the way makes the client ask the server again)."""


async def pull_arrivals(pull: JetStreamContext.PullSubscription, max_messages: int,
                        timeout_s: float) -> AsyncGenerator[Msg]:
    """Yields the next message (waiting up to `timeout_s` for one; nothing if none came), then
    up to `max_messages` - 1 more that are queued already. The caller acts on each message as
    it is yielded: the first one's handling starts before the rest are asked for."""
    if max_messages < 1:
        return
    try:
        first = await pull.fetch(batch=1, timeout=timeout_s)
    except (nats.errors.TimeoutError, TimeoutError):
        return
    for msg in first:
        yield msg
    if max_messages == 1:
        return
    try:
        rest = await pull.fetch(batch=max_messages - 1, timeout=FOLLOW_UP_TIMEOUT_S)
    except (nats.errors.TimeoutError, TimeoutError):
        return
    for msg in rest:
        yield msg


async def nak_late_arrivals(pull: JetStreamContext.PullSubscription) -> int:
    """NAKs the messages delivered to this subscription that no fetch took, so that another
    replica takes them now; returns how many.

    A pull request can outlive the fetch that sent it (the server's clock for its expiry
    starts when the request arrives, the client's when it is sent), and one sent as the barrier
    rose asks for up to a whole batch: what the server delivers then waits in the subscription
    for the next fetch. A worker that stops fetching (its barrier up) must hand such messages
    back, or they wait for the consumer's ack wait (30 s).
    """
    num_naked = 0
    while pull.pending_msgs > 0:
        try:
            msgs = await pull.fetch(batch=1, timeout=LATE_ARRIVAL_TIMEOUT_S)
        except (nats.errors.TimeoutError, TimeoutError):
            break
        for msg in msgs:
            await msg.nak()
            num_naked += 1
    return num_naked
