"""Fair preemption (seed 001): who may be preempted, how long a waking model waits, who sleeps.

Pure: no I/O, the clock is a parameter. The scheduler's wake coordinator
(`services/scheduler/wakes.py`) and the simulator drive the same functions.

A model that is asleep (or has no replica) and does not fit anywhere wakes like this::

    fits now? ──yes──▶ claim
       │ no
    write a preemption intent on the GPUs it needs
    wait up to fairness.max_wait_s, re-checking fit every second      `next_wake_step`
       │ (an idle model may sleep meanwhile: no forced preemption)
    choose victims on those GPUs                                      `select_victims`
       │ none eligible ─▶ fail, saying why (all popular, inside their min runtime...);
       │                  keep the intents until a victim is eligible      `next_held_step`
    the victims drain and sleep; the waker claims their memory under a wake lock

Victims, in seed 001's order: serving occupants only, not popular, serving for at least
their model's ``min_runtime_s``, not the waking model's own replicas, on the GPUs the
waker needs; least recently accessed first, as many as the memory needs (a replica on
several of those GPUs frees its bytes on each). Ties in last access are broken by
replica id, so a choice never depends on read order.

Intents are served first come, first served: a claim sees the memory other, older
intents wait for as taken (`get_pinned_intent_bytes`), so two wakers that freed one GPU
between them do not each wait for the other. A waker blocked until a victim becomes
eligible keeps its intents, and so its place in line, through the block
(`next_held_step`): under more demand than memory, the model that has waited longest gets
the memory freed first, not whichever model asks first once the block is over.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from shoal.shared.model_settings import FairnessSettings

SkipReason = Literal["not_serving", "popular", "min_runtime", "waker"]
"""Why an occupant of a needed GPU is not a victim, in the order the filters apply."""
WakeStep = Literal["claim", "wait", "preempt"]
HeldStep = Literal["hold", "resume", "give_up"]

RECHECK_INTERVAL_S = 1.0
"""How often a waiting waker re-checks whether it fits (seed 001: every second)."""
PLACE_KEPT_S = 2.0
"""How long after its block a blocked waker keeps its place for a request to ask again (a
client retrying on Retry-After, which is rounded up to whole seconds, comes within it)."""
BEHIND_RETRY_S = 5.0
"""The longest block of a waker that older wakers' intents on its GPUs helped block: they claim
or give up within seconds, and what it needs changes then."""
NOT_SERVING_RECHECK_S = 2.0
"""A waker blocked by replicas loading or draining asks again this soon: a load ends in seconds
(then its minimum runtime says exactly when it is eligible), a drain gives memory back.
Measured: blocked for 30 s (the block without a retry time), a third model's wake behind two
that loaded in 10 s waited 20 s longer than it needed."""
MAX_HELD_BLOCK_S = 60.0
"""Blocks longer than this keep no place: the intent would keep its GPU's free memory from
every other model all that time, for requests that may never come back."""


@dataclass(frozen=True, slots=True)
class OccupantView:
    """One replica's hold on one GPU, as fairness sees it."""

    replica_id: str
    model: str
    gpu_key: str
    num_bytes: int
    serving: bool
    """HOT and ready: only serving replicas may be preempted (sleeping ones hold nothing,
    loading and draining ones are on their way in or out)."""
    serving_since: float
    """When it last started serving (after a create or a wake)."""
    last_accessed: float
    """When a request last started or finished on it (now, while one is in flight)."""
    fairness: FairnessSettings
    idle_timeout_s: float = 0.0
    """Its model's ``sleep.idle_timeout_s``: it sleeps by itself that long after its last access."""


@dataclass(frozen=True, slots=True)
class Victims:
    """The replicas to preempt, least recently accessed first."""

    replica_ids: tuple[str, ...]
    freed_bytes_by_gpu: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NoVictim:
    """No choice of eligible victims frees the memory the waker needs."""

    reason: str
    """For the waiting requests' 503 (names why: popular, inside min runtime, ...)."""
    retry_after_s: float | None
    """When to ask again: when a replica inside its minimum runtime becomes eligible, or
    `NOT_SERVING_RECHECK_S` when one is loading or draining (its state changes soon, at a time
    nobody knows); None when waiting would not help (all popular, or too little memory even then)."""
    num_skipped: Mapping[SkipReason, int] = field(default_factory=dict)


def get_skip_reason(occupant: OccupantView, waker_model: str, now: float) -> SkipReason | None:
    """Why `occupant` may not be preempted for `waker_model` at `now`; None if it may."""
    if not occupant.serving:
        return "not_serving"
    if occupant.fairness.popular:
        return "popular"
    if now - occupant.serving_since < occupant.fairness.min_runtime_s:
        return "min_runtime"
    if occupant.model == waker_model:
        return "waker"
    return None


def is_protected(fairness: FairnessSettings, *, serving: bool, serving_since: float, now: float) -> bool:
    """Whether memory pressure may not evict this replica at `now` (placement's view of the same
    rules, minus the waker: popular, inside its min runtime, or not serving)."""
    return not serving or fairness.popular or now - serving_since < fairness.min_runtime_s


def select_victims(
    occupants: Iterable[OccupantView], deficit_bytes_by_gpu: Mapping[str, int], waker_model: str, now: float
) -> Victims | NoVictim:
    """Seed 001's victim selection for a waker short of `deficit_bytes_by_gpu` on those GPUs.

    Args:
        occupants: every occupant of (at least) the GPUs in `deficit_bytes_by_gpu`; those of
            other GPUs are ignored (the same-GPU constraint).
        deficit_bytes_by_gpu: bytes still missing per GPU key the waker needs.
        waker_model: never its own victim.

    Returns:
        `Victims` covering every deficit, or `NoVictim` saying why none can.
    """
    remaining = {gpu: deficit for gpu, deficit in deficit_bytes_by_gpu.items() if deficit > 0}
    if not remaining:
        return Victims(())
    holdings: dict[str, list[OccupantView]] = {}
    for occupant in occupants:
        if occupant.gpu_key in remaining and occupant.num_bytes > 0:
            holdings.setdefault(occupant.replica_id, []).append(occupant)
    skipped: dict[SkipReason, int] = {}
    eligible: list[list[OccupantView]] = []
    eligible_in_s: float | None = None
    for held in holdings.values():
        reason = get_skip_reason(held[0], waker_model, now)
        if reason is None:
            eligible.append(held)
            continue
        skipped[reason] = skipped.get(reason, 0) + 1
        if reason == "min_runtime":
            wait_s = held[0].serving_since + held[0].fairness.min_runtime_s - now
            eligible_in_s = wait_s if eligible_in_s is None else min(eligible_in_s, wait_s)
    eligible.sort(key=lambda held: (held[0].last_accessed, held[0].replica_id))
    victims: list[str] = []
    freed: dict[str, int] = {}
    for held in eligible:
        if all(deficit <= 0 for deficit in remaining.values()):
            break
        if not any(remaining[o.gpu_key] > 0 for o in held):
            continue
        victims.append(held[0].replica_id)
        for occupant in held:
            remaining[occupant.gpu_key] -= occupant.num_bytes
            freed[occupant.gpu_key] = freed.get(occupant.gpu_key, 0) + occupant.num_bytes
    if all(deficit <= 0 for deficit in remaining.values()):
        return Victims(tuple(victims), freed)
    retry_after_s = eligible_in_s
    if skipped.get("not_serving"):
        retry_after_s = min(retry_after_s if retry_after_s is not None else NOT_SERVING_RECHECK_S,
                            NOT_SERVING_RECHECK_S)
    return NoVictim(_explain(remaining, skipped, eligible_in_s, bool(eligible)), retry_after_s, skipped)


def _explain(remaining: Mapping[str, int], skipped: Mapping[SkipReason, int], eligible_in_s: float | None,
             any_eligible: bool) -> str:
    gpus = ", ".join(sorted(gpu for gpu, deficit in remaining.items() if deficit > 0))
    parts = []
    if skipped.get("popular"):
        parts.append(f"{skipped['popular']} popular (never preempted)")
    if skipped.get("min_runtime"):
        assert eligible_in_s is not None, "a replica inside its min runtime has a time it becomes eligible"
        parts.append(f"{skipped['min_runtime']} inside their minimum runtime (the first is eligible in "
                     f"{eligible_in_s:.1f} s)")
    if skipped.get("not_serving"):
        parts.append(f"{skipped['not_serving']} loading or draining")
    if skipped.get("waker"):
        parts.append(f"{skipped['waker']} of this model")
    held_by = f": {', '.join(parts)}" if parts else ""
    if any_eligible:
        return f"preempting every eligible replica on GPU {gpus} would not free enough memory{held_by}"
    return f"no replica on GPU {gpus} may be preempted{held_by}"


def next_wake_step(*, fits: bool, intent_since: float, max_wait_s: float, now: float,
                   voluntary_release_at: float | None) -> tuple[WakeStep, float]:
    """What a waker does now, and how long to wait before asking again.

    The fairness wait exists so that memory an occupant gives up by itself (an idle model going
    to sleep) can serve the waker with no forced preemption. Waiting when no occupant can do
    that within the wait only delays every request behind the wake, so (unlike seed 001,
    which always waits) the wait runs only while `voluntary_release_at` falls inside it.

    Args:
        voluntary_release_at: the earliest time an occupant of the target GPUs sleeps by
            itself (`get_voluntary_release_at`); None when none will.

    Returns:
        ("claim", 0) when it fits; ("wait", s) during its fairness wait (re-check in s,
        at most `RECHECK_INTERVAL_S`); ("preempt", 0) once the wait is over, or at once when
        nothing can free memory by itself before it would be.
    """
    if fits:
        return "claim", 0.0
    deadline = intent_since + max_wait_s
    remaining_s = deadline - now
    if remaining_s > 0 and voluntary_release_at is not None and voluntary_release_at <= deadline:
        return "wait", min(RECHECK_INTERVAL_S, remaining_s)
    return "preempt", 0.0


def behind_older_wakers(why: NoVictim) -> NoVictim:
    """`why` for a waker whose GPUs hold older wakers' intents: those count as taken in its
    deficit (first come, first served) but not for long, so its block is `BEHIND_RETRY_S` at
    most, whatever minimum runtime or size made it look longer."""
    retry_s = BEHIND_RETRY_S if why.retry_after_s is None else min(why.retry_after_s, BEHIND_RETRY_S)
    return NoVictim(f"{why.reason}; older wakers wait ahead of it", retry_s, why.num_skipped)


def keeps_place(why: NoVictim) -> bool:
    """Whether a waker blocked for `why` keeps its place in line: a victim becomes eligible at a
    known time, soon (`MAX_HELD_BLOCK_S`); not when every occupant is popular or the model never
    fits (waiting would not help)."""
    return why.retry_after_s is not None and why.retry_after_s <= MAX_HELD_BLOCK_S


def next_held_step(*, blocked_until: float, last_asked_at: float, now: float, told_until: float | None = None,
                   grace_s: float = PLACE_KEPT_S) -> HeldStep:
    """What a blocked waker keeping its place does now.

    Its requests are refused (503 with Retry-After) until `blocked_until`; a request that
    asks again from then on resumes the wake with its first `since`, so it is still first in
    line. Asks before the block's end do not count: they got their 503. Nobody asking within
    `grace_s` of the block's end, or of `told_until` (the latest end a refused request was
    told, when the block was shortened since: those come back then): the place is given up
    (nobody waits for the model any more).

    Returns:
        "resume" (run the wake again), "hold" (keep the intents, look again within a second)
        or "give_up" (end the wake, drop its intents).
    """
    if now >= blocked_until and last_asked_at >= blocked_until:
        return "resume"
    if now >= max(blocked_until, told_until or blocked_until) + grace_s:
        return "give_up"
    return "hold"


def get_voluntary_release_at(occupants: Iterable[OccupantView], gpu_keys: Iterable[str]) -> float | None:
    """The earliest time a serving occupant of `gpu_keys` goes to sleep by itself (its last access
    plus its model's idle timeout); None when none has an idle timeout."""
    keys = set(gpu_keys)
    times = [o.last_accessed + o.idle_timeout_s for o in occupants
             if o.gpu_key in keys and o.serving and o.idle_timeout_s > 0]
    return min(times, default=None)


def is_idle(*, last_accessed: float, num_in_flight: int, idle_timeout_s: float, now: float) -> bool:
    """Whether a serving replica has had no request for its model's idle timeout (0: never sleeps).
    A request in flight (a stream until its last byte) keeps it awake."""
    return idle_timeout_s > 0 and num_in_flight == 0 and now - last_accessed >= idle_timeout_s


@dataclass(frozen=True, slots=True)
class IntentView:
    """A waker's claim-in-waiting on one GPU."""

    model: str
    num_bytes: int
    since: float
    expires_at: float


def get_pinned_intent_bytes(intents: Iterable[IntentView], claimant: str | None, now: float) -> int:
    """Bytes of one GPU that live intents keep for their wakers, as `claimant` sees them: every
    live intent's for a model that is not waking (None), only the older ones' for a waker
    (first come, first served; ties by model key)."""
    live = [i for i in intents if i.expires_at > now]
    if claimant is None or not any(i.model == claimant for i in live):
        return sum(i.num_bytes for i in live)
    return sum(i.num_bytes for i in get_older_intents(live, claimant, now))


def get_older_intents(intents: Iterable[IntentView], claimant: str, now: float) -> list[IntentView]:
    """The live intents ahead of `claimant`'s own in line (first come, first served; ties by
    model key); none when `claimant` holds no live intent."""
    live = [i for i in intents if i.expires_at > now]
    own = min(((i.since, i.model) for i in live if i.model == claimant), default=None)
    if own is None:
        return []
    return [i for i in live if i.model != claimant and (i.since, i.model) < own]
