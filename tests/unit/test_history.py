"""The dashboard's history: rates from the workers' totals, TTFT means, the window."""

from __future__ import annotations

import pytest

from shoal.services.gateway.history import (
    History,
    HistoryPoint,
    ModelPoint,
    RateTracker,
    TtftWindow,
    make_point,
)
from shoal.shared.messages import WorkerStats


def stats(replica_id: str, model: str, num_ok: int, num_tokens: int) -> WorkerStats:
    return WorkerStats(replica_id=replica_id, model=model, node_id="n", at=0.0, interval_s=1.0,
                       num_requests_by_outcome={"ok": num_ok}, num_generated_tokens=num_tokens)


def test_rates_are_increases_per_second_summed_per_model() -> None:
    tracker = RateTracker()
    assert tracker.take_rates(10.0, [stats("r1", "a", 5, 100)]) == {"a": (0.0, 0.0)}, "nothing to compare yet"
    rates = tracker.take_rates(12.0, [stats("r1", "a", 9, 300), stats("r2", "a", 1, 10), stats("r3", "b", 0, 0)])
    assert rates == {"a": (2.0, 100.0), "b": (0.0, 0.0)}, "r2 and r3 are new: they add nothing yet"
    rates = tracker.take_rates(14.0, [stats("r1", "a", 3, 40), stats("r2", "a", 3, 30)])
    assert rates["a"] == pytest.approx((3 / 2 + 2 / 2, 40 / 2 + 20 / 2)), "r1 restarted: counted from zero"


def test_ttft_means_per_interval() -> None:
    window = TtftWindow()
    window.observe("a", 1.0)
    window.observe("a", 3.0)
    window.observe("b", 0.5)
    assert window.take_means() == {"a": 2.0, "b": 0.5}
    assert window.take_means() == {}


def test_history_keeps_its_window_and_answers_since() -> None:
    history = History(window_s=10.0)
    for at in (0.0, 4.0, 8.0, 12.0):
        history.add(HistoryPoint(at, {}))
    assert [p.at for p in history.get_since(None)] == [4.0, 8.0, 12.0]
    assert [p.at for p in history.get_since(4.0)] == [8.0, 12.0]
    assert history.latest is not None and history.latest.at == 12.0


def test_a_point_holds_the_registered_models_that_did_something() -> None:
    point = make_point(5.0, ["a", "b", "idle"], {"a": (1.0, 20.0), "gone": (9.0, 9.0)}, {"b": 0.25}, {"a": 3})
    assert point.models == {"a": ModelPoint(1.0, 20.0, None, 3), "b": ModelPoint(0.0, 0.0, 0.25, 0)}
