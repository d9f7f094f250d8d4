"""A loop that pauses with `sleep_or_stop` ends when its task is cancelled, even when something
it awaited swallowed the cancellation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from shoal.shared.periodic import sleep_or_stop


async def cancel_loop(pause: Callable[[float], Awaitable[None]], body: Callable[[], Awaitable[None]],
                      ready: Callable[[], Awaitable[None]], just_before_cancel: Callable[[], None] = lambda: None,
                      ) -> tuple[bool, int]:
    """Runs ``while True: await pause(0); await body()`` in a task and cancels it once `ready`
    returns (`just_before_cancel` runs in the same loop iteration). Returns whether the task
    ended cancelled within 0.5 s, and how many rounds it began."""
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            await pause(0)
            rounds += 1
            await body()

    task = asyncio.create_task(loop())
    await ready()
    just_before_cancel()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.5)
    if not done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return bool(done) and task.cancelled(), rounds


async def test_a_cancellation_a_call_swallowed_ends_the_loop_at_its_next_pause() -> None:
    entered = asyncio.Event()
    num_swallowed = 0

    async def swallowing_call() -> None:  # a library call that loses the first cancellation
        nonlocal num_swallowed
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if num_swallowed:
                raise
            num_swallowed += 1

    assert await cancel_loop(sleep_or_stop, swallowing_call, entered.wait) == (True, 1)
    entered.clear()
    num_swallowed = 0
    assert await cancel_loop(asyncio.sleep, swallowing_call, entered.wait) == (False, 2)  # what loops did before


async def test_the_cancellation_asyncio_wait_for_can_lose_ends_the_loop_too() -> None:
    # Python 3.11's wait_for returns the result of a future that completes in the loop
    # iteration of the cancellation (gh-86296); 3.12 raises. Either way the loop ends.
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Future[int]] = []

    async def wait_for_a_future() -> None:
        pending.append(loop.create_future())
        await asyncio.wait_for(pending[-1], timeout=60)

    async def waiting_inside_wait_for() -> None:
        while not pending:
            await asyncio.sleep(0)
        await asyncio.sleep(0)

    assert await cancel_loop(sleep_or_stop, wait_for_a_future, waiting_inside_wait_for,
                             lambda: pending[-1].set_result(1)) == (True, 1)
