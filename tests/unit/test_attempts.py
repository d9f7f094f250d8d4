"""The gateway's attempt state machine: older attempts dropped, a newer one after text was
sent resumed (reproducible), restarted (caller can restart) or broken (a stream on the wire)."""

from __future__ import annotations

from shoal.services.gateway.attempts import AttemptTracker
from shoal.shared.messages import ErrorReply, FinalReply, TokenChunk


def chunk(attempt: int, seq: int) -> TokenChunk:
    return TokenChunk(request_id="r", attempt=attempt, seq=seq, text=f"{attempt}:{seq}")


def final(attempt: int, seq: int) -> FinalReply:
    return FinalReply(request_id="r", attempt=attempt, seq=seq, finish_reason="stop", prompt_tokens=3,
                      completion_tokens=seq)


def error(attempt: int) -> ErrorReply:
    return ErrorReply(request_id="r", attempt=attempt, status=400, message="bad prompt")


def test_one_attempt_delivers_its_chunks_then_finishes() -> None:
    tracker = AttemptTracker(reproducible=False, restartable=False)
    assert [tracker.on_reply(r) for r in (chunk(1, 0), chunk(1, 1), final(1, 2))] == [
        ("deliver",), ("deliver",), ("finish",)]
    assert (tracker.attempt, tracker.num_sent) == (1, 2)


def test_an_error_reply_fails_the_request() -> None:
    tracker = AttemptTracker(reproducible=True, restartable=True)
    assert tracker.on_reply(error(1)) == ("error",)


def test_replies_of_an_older_attempt_are_skipped() -> None:
    tracker = AttemptTracker(reproducible=False, restartable=False)
    assert tracker.on_reply(chunk(2, 0)) == ("deliver",)
    assert tracker.on_reply(chunk(1, 5)) == ("skip",)
    assert tracker.on_reply(final(1, 6)) == ("skip",)
    assert tracker.on_reply(error(1)) == ("skip",)
    assert tracker.on_reply(final(2, 1)) == ("finish",)


def test_a_newer_attempt_before_any_text_simply_takes_over() -> None:
    for reproducible, restartable in [(False, False), (False, True), (True, False)]:
        tracker = AttemptTracker(reproducible=reproducible, restartable=restartable)
        assert tracker.on_reply(chunk(2, 0)) == ("deliver",), "the first attempt seen may be a redelivery"
        tracker = AttemptTracker(reproducible=reproducible, restartable=restartable)
        assert tracker.on_reply(final(1, 0)) == ("finish",)


def test_a_reproducible_request_resumes_after_the_chunks_already_sent() -> None:
    tracker = AttemptTracker(reproducible=True, restartable=False)
    assert [tracker.on_reply(chunk(1, s)) for s in range(3)] == [("deliver",)] * 3
    assert tracker.on_reply(chunk(2, 0)) == ("resume", "skip")
    assert tracker.on_reply(chunk(2, 1)) == ("skip",)
    assert tracker.on_reply(chunk(2, 2)) == ("skip",)
    assert tracker.on_reply(chunk(1, 3)) == ("skip",), "the dead attempt's late chunk"
    assert tracker.on_reply(chunk(2, 3)) == ("deliver",)
    assert tracker.on_reply(final(2, 4)) == ("finish",)
    assert tracker.num_sent == 4


def test_a_resumed_attempt_that_finishes_before_catching_up_finishes() -> None:
    tracker = AttemptTracker(reproducible=True, restartable=True)
    tracker.on_reply(chunk(1, 0))
    tracker.on_reply(chunk(1, 1))
    assert tracker.on_reply(final(2, 1)) == ("resume", "finish")


def test_a_second_resume_skips_what_the_first_two_attempts_sent() -> None:
    tracker = AttemptTracker(reproducible=True, restartable=False)
    tracker.on_reply(chunk(1, 0))
    assert tracker.on_reply(chunk(2, 0)) == ("resume", "skip")
    assert tracker.on_reply(chunk(2, 1)) == ("deliver",)
    assert tracker.on_reply(chunk(3, 0)) == ("resume", "skip")
    assert tracker.on_reply(chunk(3, 1)) == ("skip",)
    assert tracker.on_reply(chunk(3, 2)) == ("deliver",)


def test_a_request_the_caller_can_restart_starts_over_with_the_new_attempt() -> None:
    tracker = AttemptTracker(reproducible=False, restartable=True)
    tracker.on_reply(chunk(1, 0))
    tracker.on_reply(chunk(1, 1))
    assert tracker.on_reply(chunk(2, 0)) == ("restart", "deliver")
    assert tracker.num_sent == 1
    assert tracker.on_reply(chunk(1, 2)) == ("skip",)
    assert tracker.on_reply(chunk(2, 1)) == ("deliver",)
    assert tracker.on_reply(error(3)) == ("restart", "error")


def test_a_stream_already_on_the_wire_that_cannot_resume_is_broken() -> None:
    tracker = AttemptTracker(reproducible=False, restartable=False)
    tracker.on_reply(chunk(1, 0))
    assert tracker.on_reply(chunk(2, 0)) == ("broken",)
    tracker = AttemptTracker(reproducible=False, restartable=False)
    tracker.on_reply(chunk(1, 0))
    assert tracker.on_reply(final(2, 1)) == ("broken",)

