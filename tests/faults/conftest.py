"""Fault tests: what a hung test leaves in its report."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import pytest

DUMP_BEFORE_TIMEOUT_S = 20.0
"""How long before pytest-timeout ends a test its asyncio tasks' stacks are printed."""


@pytest.fixture(autouse=True)
async def print_tasks_before_timeout(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """pytest-timeout ends a hung test with its threads' stacks only, and every thread of a hung
    asyncio test waits in the event loop. Shortly before that, print every task's stack, so
    that the await that never returned is in the report (a chaos run hung once in CI)."""
    marker = request.node.get_closest_marker("timeout")
    timeout_s = float(marker.args[0]) if marker is not None and marker.args else float(
        request.config.getini("timeout") or 0)
    if timeout_s <= DUMP_BEFORE_TIMEOUT_S:
        yield
        return

    async def watch() -> None:
        await asyncio.sleep(timeout_s - DUMP_BEFORE_TIMEOUT_S)
        tasks = asyncio.all_tasks()
        print(f"\n{len(tasks)} asyncio tasks {DUMP_BEFORE_TIMEOUT_S:.0f} s before the test's timeout:", file=sys.stderr)
        for task in tasks:
            print(f"--- {task.get_name()}: {task.get_coro()!r}", file=sys.stderr)
            task.print_stack(limit=20, file=sys.stderr)

    watcher = asyncio.create_task(watch(), name="print-tasks-before-timeout")
    try:
        yield
    finally:
        watcher.cancel()
