"""Seed 001's fair preemption, case by case, with an injected clock."""

from __future__ import annotations

import pytest

from shoal.shared.model_settings import FairnessSettings
from shoal.shared.placement.fairness import (
    NOT_SERVING_RECHECK_S,
    IntentView,
    NoVictim,
    OccupantView,
    Victims,
    behind_older_wakers,
    get_older_intents,
    get_pinned_intent_bytes,
    get_skip_reason,
    get_voluntary_release_at,
    is_idle,
    is_protected,
    keeps_place,
    next_held_step,
    next_wake_step,
    select_victims,
)

GiB = 1 << 30
NOW = 1000.0
DEFAULT = FairnessSettings()  # min runtime 10 s, max wait 5 s, not popular


def occupant(replica_id: str, model: str, gib: int = 8, *, gpu: str = "n.0", serving: bool = True,
             since: float = NOW - 60, accessed: float = NOW - 30, fairness: FairnessSettings = DEFAULT
             ) -> OccupantView:
    return OccupantView(replica_id, model, gpu, gib * GiB, serving, since, accessed, fairness)


def test_the_least_recently_accessed_eligible_replica_is_the_victim() -> None:
    occupants = [occupant("a", "m1", accessed=NOW - 5), occupant("b", "m2", accessed=NOW - 50),
                 occupant("c", "m3", accessed=NOW - 20)]
    assert select_victims(occupants, {"n.0": 4 * GiB}, "waker", NOW) == Victims(("b",), {"n.0": 8 * GiB})


def test_as_many_victims_as_the_memory_needs_in_lru_order() -> None:
    occupants = [occupant("a", "m1", 4, accessed=NOW - 5), occupant("b", "m2", 4, accessed=NOW - 50),
                 occupant("c", "m3", 4, accessed=NOW - 20)]
    choice = select_victims(occupants, {"n.0": 6 * GiB}, "waker", NOW)
    assert choice == Victims(("b", "c"), {"n.0": 8 * GiB})


def test_popular_models_are_skipped() -> None:
    occupants = [occupant("p", "pop", accessed=NOW - 99, fairness=FairnessSettings(popular=True)),
                 occupant("b", "m2", accessed=NOW - 10)]
    assert select_victims(occupants, {"n.0": GiB}, "waker", NOW) == Victims(("b",), {"n.0": 8 * GiB})


def test_a_replica_inside_its_min_runtime_is_skipped_until_it_has_served_long_enough() -> None:
    young = occupant("y", "m1", since=NOW - 3, accessed=NOW - 3, fairness=FairnessSettings(min_runtime_s=10))
    assert get_skip_reason(young, "waker", NOW) == "min_runtime"
    assert get_skip_reason(young, "waker", NOW + 7) is None
    choice = select_victims([young], {"n.0": GiB}, "waker", NOW)
    assert isinstance(choice, NoVictim)
    assert choice.retry_after_s == pytest.approx(7.0)
    assert "1 inside their minimum runtime (the first is eligible in 7.0 s)" in choice.reason


def test_non_serving_occupants_are_skipped() -> None:
    occupants = [occupant("l", "loading", serving=False, accessed=NOW - 99), occupant("b", "m2", accessed=NOW - 1)]
    assert select_victims(occupants, {"n.0": GiB}, "waker", NOW) == Victims(("b",), {"n.0": 8 * GiB})


def test_only_occupants_of_the_gpus_the_waker_needs_are_considered() -> None:
    occupants = [occupant("other", "m1", gpu="n.1", accessed=NOW - 99), occupant("here", "m2", accessed=NOW - 1)]
    assert select_victims(occupants, {"n.0": GiB}, "waker", NOW) == Victims(("here",), {"n.0": 8 * GiB})


def test_the_waker_is_never_its_own_victim() -> None:
    occupants = [occupant("self", "waker", accessed=NOW - 99), occupant("b", "m2", accessed=NOW - 1)]
    assert select_victims(occupants, {"n.0": GiB}, "waker", NOW) == Victims(("b",), {"n.0": 8 * GiB})
    alone = select_victims([occupant("self", "waker")], {"n.0": GiB}, "waker", NOW)
    assert isinstance(alone, NoVictim) and "1 of this model" in alone.reason


def test_nobody_eligible_is_an_error_that_says_why() -> None:
    occupants = [occupant("p", "pop", fairness=FairnessSettings(popular=True)),
                 occupant("y", "young", since=NOW - 1), occupant("l", "loading", serving=False)]
    choice = select_victims(occupants, {"n.0": GiB}, "waker", NOW)
    assert isinstance(choice, NoVictim)
    assert choice.reason == ("no replica on GPU n.0 may be preempted: 1 popular (never preempted), 1 inside their "
                             "minimum runtime (the first is eligible in 9.0 s), 1 loading or draining")
    assert choice.num_skipped == {"popular": 1, "min_runtime": 1, "not_serving": 1}
    assert choice.retry_after_s == NOT_SERVING_RECHECK_S, "the loading one is looked at again first"


def test_replicas_loading_or_draining_are_looked_at_again_soon() -> None:
    """Their state changes in seconds at a time nobody knows: not a block without a retry time."""
    loading = select_victims([occupant("l", "loading", serving=False)], {"n.0": GiB}, "waker", NOW)
    assert isinstance(loading, NoVictim) and loading.retry_after_s == NOT_SERVING_RECHECK_S
    young = select_victims([occupant("l", "loading", serving=False), occupant("y", "young", since=NOW - 9.5)],
                           {"n.0": GiB}, "waker", NOW)
    assert isinstance(young, NoVictim) and young.retry_after_s == 0.5, "a sooner eligible one wins"


def test_all_popular_gives_no_retry_time() -> None:
    choice = select_victims([occupant("p", "pop", fairness=FairnessSettings(popular=True))], {"n.0": GiB},
                            "waker", NOW)
    assert isinstance(choice, NoVictim) and choice.retry_after_s is None


def test_too_little_memory_even_with_every_eligible_victim() -> None:
    choice = select_victims([occupant("a", "m1", 2), occupant("b", "m2", 2)], {"n.0": 5 * GiB}, "waker", NOW)
    assert isinstance(choice, NoVictim)
    assert choice.reason.startswith("preempting every eligible replica on GPU n.0 would not free enough memory")


def test_a_multi_gpu_victim_frees_its_bytes_on_every_needed_gpu() -> None:
    occupants = [occupant("wide", "m1", 8, gpu="n.0", accessed=NOW - 50),
                 occupant("wide", "m1", 8, gpu="n.1", accessed=NOW - 50),
                 occupant("narrow", "m2", 8, gpu="n.1", accessed=NOW - 10)]
    choice = select_victims(occupants, {"n.0": GiB, "n.1": GiB}, "waker", NOW)
    assert choice == Victims(("wide",), {"n.0": 8 * GiB, "n.1": 8 * GiB})


def test_equal_last_access_is_broken_by_replica_id() -> None:
    occupants = [occupant("z", "m1", accessed=NOW - 5), occupant("a", "m2", accessed=NOW - 5)]
    assert select_victims(occupants, {"n.0": GiB}, "waker", NOW).replica_ids == ("a",)  # type: ignore[union-attr]


def test_no_deficit_needs_no_victim() -> None:
    assert select_victims([occupant("a", "m1")], {"n.0": 0}, "waker", NOW) == Victims(())


def test_the_fairness_wait_rechecks_every_second_then_preempts() -> None:
    soon = NOW + 3  # an occupant sleeps by itself then: worth waiting for
    assert next_wake_step(fits=True, intent_since=NOW, max_wait_s=5, now=NOW, voluntary_release_at=soon) == (
        "claim", 0.0)
    assert next_wake_step(fits=False, intent_since=NOW, max_wait_s=5, now=NOW, voluntary_release_at=soon) == (
        "wait", 1.0)
    assert next_wake_step(fits=False, intent_since=NOW, max_wait_s=5, now=NOW + 4.5, voluntary_release_at=soon) == (
        "wait", 0.5)
    assert next_wake_step(fits=False, intent_since=NOW, max_wait_s=5, now=NOW + 5, voluntary_release_at=soon) == (
        "preempt", 0.0)
    assert next_wake_step(fits=True, intent_since=NOW, max_wait_s=5, now=NOW + 9, voluntary_release_at=soon) == (
        "claim", 0.0)
    assert next_wake_step(fits=False, intent_since=NOW, max_wait_s=0, now=NOW, voluntary_release_at=soon) == (
        "preempt", 0.0)


def test_no_wait_when_nothing_can_free_memory_by_itself_within_it() -> None:
    assert next_wake_step(fits=False, intent_since=NOW, max_wait_s=5, now=NOW, voluntary_release_at=None) == (
        "preempt", 0.0)
    assert next_wake_step(fits=False, intent_since=NOW, max_wait_s=5, now=NOW, voluntary_release_at=NOW + 6) == (
        "preempt", 0.0), "it would sleep only after the wait"


def test_the_voluntary_release_is_the_first_idle_deadline_on_the_target_gpus() -> None:
    occupants = [
        OccupantView("a", "m1", "n.0", GiB, True, NOW - 60, NOW - 10, DEFAULT, idle_timeout_s=30),
        OccupantView("b", "m2", "n.0", GiB, True, NOW - 60, NOW - 5, DEFAULT, idle_timeout_s=12),
        OccupantView("c", "m3", "n.0", GiB, True, NOW - 60, NOW - 50, DEFAULT),  # never sleeps by itself
        OccupantView("d", "m4", "n.1", GiB, True, NOW - 60, NOW - 50, DEFAULT, idle_timeout_s=1),  # other GPU
        OccupantView("e", "m5", "n.0", GiB, False, NOW - 60, NOW - 50, DEFAULT, idle_timeout_s=1),  # not serving
    ]
    assert get_voluntary_release_at(occupants, ["n.0"]) == NOW + 7
    assert get_voluntary_release_at(occupants[2:3], ["n.0"]) is None


def test_idle_means_no_request_for_the_timeout_and_none_in_flight() -> None:
    assert is_idle(last_accessed=NOW - 60, num_in_flight=0, idle_timeout_s=60, now=NOW)
    assert not is_idle(last_accessed=NOW - 59, num_in_flight=0, idle_timeout_s=60, now=NOW)
    assert not is_idle(last_accessed=NOW - 600, num_in_flight=1, idle_timeout_s=60, now=NOW), "a stream in flight"
    assert not is_idle(last_accessed=0.0, num_in_flight=0, idle_timeout_s=0, now=NOW), "0: never sleeps"


def test_pressure_may_evict_only_serving_unpopular_replicas_past_their_min_runtime() -> None:
    assert not is_protected(DEFAULT, serving=True, serving_since=NOW - 10, now=NOW)
    assert is_protected(DEFAULT, serving=True, serving_since=NOW - 9, now=NOW)
    assert is_protected(FairnessSettings(popular=True), serving=True, serving_since=0.0, now=NOW)
    assert is_protected(DEFAULT, serving=False, serving_since=0.0, now=NOW)


def test_intents_are_served_first_come_first_served() -> None:
    older = IntentView("a", 6 * GiB, since=NOW - 10, expires_at=NOW + 60)
    newer = IntentView("b", 6 * GiB, since=NOW - 5, expires_at=NOW + 60)
    lapsed = IntentView("c", 6 * GiB, since=NOW - 20, expires_at=NOW - 1)
    intents = [older, newer, lapsed]
    assert get_pinned_intent_bytes(intents, "a", NOW) == 0, "the oldest waker sees nothing kept from it"
    assert get_pinned_intent_bytes(intents, "b", NOW) == 6 * GiB, "b waits behind a"
    assert get_pinned_intent_bytes(intents, None, NOW) == 12 * GiB, "a model not waking sees both kept"
    assert get_pinned_intent_bytes(intents, "x", NOW) == 12 * GiB
    assert get_older_intents(intents, "b", NOW) == [older], "a lapsed intent is nobody's place in line"
    assert get_older_intents(intents, "a", NOW) == [] and get_older_intents(intents, "x", NOW) == []


def test_a_waker_blocked_until_a_victim_is_eligible_soon_keeps_its_place() -> None:
    young = select_victims([occupant("r1", "a", since=NOW - 4)], {"n.0": 8 * GiB}, "w", NOW)
    popular = select_victims([occupant("r1", "a", fairness=FairnessSettings(popular=True))], {"n.0": 8 * GiB}, "w", NOW)
    long_block = select_victims([occupant("r1", "a", since=NOW - 4, fairness=FairnessSettings(min_runtime_s=600))],
                                {"n.0": 8 * GiB}, "w", NOW)
    assert isinstance(young, NoVictim) and isinstance(popular, NoVictim) and isinstance(long_block, NoVictim)
    assert keeps_place(young), "a's min runtime ends in 6 s: the waker stays first in line"
    assert not keeps_place(popular), "waiting would not help: the place is not kept"
    assert not keeps_place(long_block), "596 s of other models kept from the GPU's free memory: not kept"


@pytest.mark.parametrize(("now", "asked_at", "step"), [
    (NOW + 3, NOW + 1, "hold"),       # inside the block: an ask there got its 503
    (NOW + 6, NOW + 4, "hold"),       # the block is over; the last ask came before its end
    (NOW + 6, NOW + 5.5, "resume"),   # a request asked again after the block: first in line
    (NOW + 7, NOW + 5, "resume"),     # asked right at the block's end
    (NOW + 7, NOW + 4, "give_up"),    # nobody came back within 2 s of the block's end
    (NOW + 7, float("-inf"), "give_up"),
])
def test_a_kept_place_resumes_on_an_ask_after_the_block_and_is_given_up_without_one(
        now: float, asked_at: float, step: str) -> None:
    assert next_held_step(blocked_until=NOW + 5, last_asked_at=asked_at, now=now, grace_s=2.0) == step


def test_a_shortened_block_keeps_the_place_until_the_refused_requests_were_told_to_come_back() -> None:
    """The block was to end at +10 (the 503s said so) and ends at +5 (the waker ahead went):
    a new request may resume it from +5; the refused ones come back at +10, so the place is
    kept until then."""
    def step(now: float, asked_at: float) -> str:
        return next_held_step(blocked_until=NOW + 5, told_until=NOW + 10, last_asked_at=asked_at, now=now, grace_s=2.0)

    assert step(NOW + 6, NOW + 5.5) == "resume"
    assert step(NOW + 9, NOW + 1) == "hold"
    assert step(NOW + 12, NOW + 1) == "give_up"


def test_a_waker_behind_older_ones_is_blocked_for_seconds_not_for_a_long_min_runtime() -> None:
    """Older wakers' intents made the deficit (a's 8 GiB would do for w alone): they claim or
    give up within seconds, so w's block is 5 s at most, not b's 596 s."""
    why = select_victims([occupant("r1", "a"), occupant("r2", "b", since=NOW - 4,
                                                        fairness=FairnessSettings(min_runtime_s=600))],
                         {"n.0": 16 * GiB}, "w", NOW)
    assert isinstance(why, NoVictim) and why.retry_after_s == pytest.approx(596)
    behind = behind_older_wakers(why)
    assert behind.retry_after_s == 5.0 and keeps_place(behind)
    assert "older wakers wait ahead of it" in behind.reason
    assert behind_older_wakers(NoVictim("all popular", None)).retry_after_s == 5.0
