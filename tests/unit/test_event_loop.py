"""The services' event loop: uvloop by default, asyncio's on request, a clear error otherwise."""

from __future__ import annotations

import asyncio

import pytest

from shoal.shared import event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_services_run_on_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.EVENT_LOOP_ENV, raising=False)
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_the_standard_loop_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.EVENT_LOOP_ENV, "asyncio")
    assert event_loop.run(_loop_module()).startswith("asyncio")


def test_an_unknown_loop_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.EVENT_LOOP_ENV, "trio")
    coroutine = _loop_module()
    with pytest.raises(ValueError, match="SHOAL_EVENT_LOOP must be 'uvloop' or 'asyncio', not 'trio'"):
        event_loop.run(coroutine)
    coroutine.close()
