"""The gateway's attempt state machine: older attempts dropped, a newer one after text was
sent resumed (reproducible, its token hashes checked), restarted (caller can restart) or
broken (a stream on the wire); lost replies detected; what a replica's death means."""

from __future__ import annotations

from shoal.services.gateway.attempts import AttemptTracker
from shoal.shared.messages import AttemptNotice, ErrorReply, FinalReply, TokenChunk


def chunk(attempt: int, seq: int, token_hash: int = 0) -> TokenChunk:
    return TokenChunk(request_id="r", attempt=attempt, seq=seq, text=f"{attempt}:{seq}", token_hash=token_hash)


def started(attempt: int, replica_id: str) -> AttemptNotice:
    return AttemptNotice("r", attempt, "started", replica_id, ack_subject=f"$JS.ACK.{replica_id}.{attempt}")


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


def test_a_resumed_attempt_that_finishes_before_catching_up_is_broken() -> None:
    tracker = AttemptTracker(reproducible=True, restartable=False)
    tracker.on_reply(chunk(1, 0))
    tracker.on_reply(chunk(1, 1))
    assert tracker.on_reply(chunk(2, 0)) == ("resume", "skip")
    assert tracker.on_reply(final(2, 1)) == ("broken",), "the client holds text this attempt did not make"


def test_a_resumed_attempt_whose_tokens_differ_is_broken_before_anything_is_spliced() -> None:
    tracker = AttemptTracker(reproducible=True, restartable=False)
    assert tracker.on_reply(chunk(1, 0, token_hash=11)) == ("deliver",)
    assert tracker.on_reply(chunk(1, 1, token_hash=22)) == ("deliver",)
    assert tracker.on_reply(chunk(2, 0, token_hash=11)) == ("resume", "skip")
    assert tracker.on_reply(chunk(2, 1, token_hash=23)) == ("broken",)


def test_a_resumed_attempt_with_the_same_tokens_goes_on() -> None:
    tracker = AttemptTracker(reproducible=True, restartable=False)
    tracker.on_reply(chunk(1, 0, token_hash=11))
    assert tracker.on_reply(chunk(2, 0, token_hash=11)) == ("resume", "skip")
    assert tracker.on_reply(chunk(2, 1, token_hash=33)) == ("deliver",)
    assert tracker.on_reply(final(2, 2)) == ("finish",)


def test_a_gap_in_chunk_numbers_is_a_lost_reply() -> None:
    tracker = AttemptTracker(reproducible=False, restartable=True)
    assert tracker.on_reply(chunk(1, 0)) == ("deliver",)
    assert tracker.on_reply(chunk(1, 2)) == ("lost",)


def test_a_final_reply_whose_count_differs_is_a_lost_reply() -> None:
    tracker = AttemptTracker(reproducible=False, restartable=True)
    tracker.on_reply(chunk(1, 0))
    assert tracker.on_reply(final(1, 2)) == ("lost",), "chunk 1 never came"
    tracker = AttemptTracker(reproducible=False, restartable=True)
    assert tracker.on_reply(final(1, 1)) == ("lost",), "its only chunk never came"


def test_a_duplicate_chunk_is_skipped() -> None:
    tracker = AttemptTracker(reproducible=False, restartable=False)
    tracker.on_reply(chunk(1, 0))
    assert tracker.on_reply(chunk(1, 0)) == ("skip",)
    assert tracker.on_reply(final(1, 1)) == ("finish",)


def test_a_new_try_after_lost_replies_restarts_or_resumes_what_was_sent() -> None:
    tracker = AttemptTracker(reproducible=False, restartable=True)
    tracker.on_reply(chunk(1, 0))
    assert tracker.on_reply(chunk(1, 2)) == ("lost",)
    tracker.begin_try()
    assert tracker.on_reply(chunk(1, 0)) == ("restart", "deliver"), "the new try's attempts count from 1"
    assert tracker.on_reply(final(1, 1)) == ("finish",)

    tracker = AttemptTracker(reproducible=True, restartable=False)
    tracker.on_reply(chunk(1, 0, token_hash=5))
    assert tracker.on_reply(final(1, 3)) == ("lost",)
    tracker.begin_try()
    assert tracker.on_reply(chunk(1, 0, token_hash=5)) == ("resume", "skip")
    assert tracker.on_reply(chunk(1, 1, token_hash=6)) == ("deliver",)

    tracker = AttemptTracker(reproducible=False, restartable=False)
    tracker.on_reply(chunk(1, 0))
    tracker.begin_try()
    assert tracker.on_reply(chunk(1, 0)) == ("broken",), "a stream on the wire cannot start over"


def test_notices_say_where_the_attempt_runs_and_are_never_delivered() -> None:
    tracker = AttemptTracker(reproducible=False, restartable=True)
    assert tracker.on_reply(started(1, "a")) == ("skip",)
    assert (tracker.is_running, tracker.replica_id, tracker.ack_subject) == (True, "a", "$JS.ACK.a.1")
    assert tracker.on_reply(chunk(1, 0)) == ("deliver",)
    assert tracker.on_reply(AttemptNotice("r", 1, "handed_back", "a")) == ("skip",)
    assert not tracker.is_running
    assert tracker.on_replica_failed("a") == "ignore", "handed back: the queue holds it, not the replica"
    assert tracker.on_reply(started(2, "b")) == ("restart", "skip")
    assert tracker.replica_id == "b"


def test_the_death_of_the_replica_running_the_attempt_naks_it_once() -> None:
    tracker = AttemptTracker(reproducible=True, restartable=False)
    tracker.on_reply(started(1, "a"))
    assert tracker.on_replica_failed("b") == "ignore", "another replica"
    assert tracker.on_replica_failed("a") == "nak"
    assert tracker.on_replica_failed("a") == "ignore", "reported twice"
    assert tracker.num_deaths == 1


def test_a_stream_that_cannot_resume_breaks_when_its_replica_dies() -> None:
    tracker = AttemptTracker(reproducible=False, restartable=False)
    tracker.on_reply(started(1, "a"))
    assert tracker.on_replica_failed("a") == "nak", "nothing sent yet: it runs again"
    tracker.on_reply(started(2, "b"))
    tracker.on_reply(chunk(2, 0))
    assert tracker.on_replica_failed("b") == "poison", "the second death gives up in any case"

    tracker = AttemptTracker(reproducible=False, restartable=False, max_deaths=3)
    tracker.on_reply(started(1, "a"))
    tracker.on_reply(chunk(1, 0))
    assert tracker.on_replica_failed("a") == "broken"


def test_a_request_that_kills_its_replicas_is_given_up_after_max_deaths() -> None:
    tracker = AttemptTracker(reproducible=True, restartable=True, max_deaths=2)
    tracker.on_reply(started(1, "a"))
    assert tracker.on_replica_failed("a") == "nak"
    tracker.on_reply(started(2, "b"))
    assert tracker.on_replica_failed("b") == "poison"


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

