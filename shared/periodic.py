"""The pause of a loop that runs until its task is cancelled, safe against a lost cancellation.

Python 3.11's `asyncio.wait_for` (which nats-py's requests, flushes and JetStream calls use)
returns its inner future's result instead of raising when a cancellation arrives just as
that future completes (CPython gh-86296; 3.12 rewrote `wait_for`). The task is then marked
as cancelling (`Task.cancelling()` > 0) but runs on, and a ``while True`` loop that
``task.cancel()`` should end never does: a node agent's `stop()` once waited for its
heartbeat loop until the test's timeout. Such loops pause with `sleep_or_stop`, or call
`stop_if_cancelled` after the awaits between their waits.
"""

from __future__ import annotations

import asyncio


def stop_if_cancelled() -> None:
    """CancelledError when this task's cancellation was requested and something it awaited
    since swallowed it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


async def sleep_or_stop(seconds: float) -> None:
    """`asyncio.sleep(seconds)`, after `stop_if_cancelled`."""
    stop_if_cancelled()
    await asyncio.sleep(seconds)
