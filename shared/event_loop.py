"""The event loop Shoal's processes run on: uvloop where it is installed, asyncio's otherwise.

Every request crosses several processes (client, gateway, nats-server, worker), each hop an
event loop waking up. Measured side by side, uvloop is level with asyncio's loop at one
request at a time and ~3% ahead at 32 concurrent (docs/engine.md, "Time to first token through
the gateway"). ``SHOAL_EVENT_LOOP=asyncio`` keeps the standard loop (a comparison, or a
debugger that needs it).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from shoal.shared.config import ConfigError

T = TypeVar("T")

EVENT_LOOP_ENV = "SHOAL_EVENT_LOOP"


def get_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None for asyncio's default loop."""
    choice = os.environ.get(EVENT_LOOP_ENV, "uvloop")
    if choice == "asyncio":
        return None
    if choice != "uvloop":
        raise ConfigError(f"{EVENT_LOOP_ENV} must be 'uvloop' or 'asyncio', not {choice!r}")
    try:
        import uvloop
    except ImportError:  # a platform without it (Windows): the standard loop serves
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the chosen loop."""
    try:
        factory = get_loop_factory()
    except ConfigError:
        main.close()  # never to be awaited: no "coroutine was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
