"""Redelivery vs streaming: what the gateway does with each reply of one request (pure).

A worker that dies leaves its request un-acked and JetStream redelivers it to another
replica; that attempt's replies carry a higher attempt number (the delivery count). Fed
the replies in arrival order, `AttemptTracker` says what the caller does with each:

    skip      a reply of an older attempt, or a chunk a resumed attempt already sent
    deliver   a chunk: pass it on
    finish    the final reply: pass it on, the request is done
    error     the worker's error reply: the request fails with it
    resume    (before the reply's own action) a newer attempt after text was sent, on a
              reproducible request (greedy or seeded): its chunks below the number
              already sent are skipped, so the stream goes on where it stopped
    restart   (before the reply's own action) a newer attempt after text was sent, not
              reproducible, and the caller can still drop what it has (nothing reached
              the client): drop the text so far
    broken    a newer attempt after text was sent, not reproducible, and the caller
              cannot restart (a stream already on the wire): the request fails

Never a duplicate, never a silent restart of text a client holds. A newer attempt
before any text was sent simply takes over.
"""

from __future__ import annotations

from typing import Literal

from shoal.shared.messages import ErrorReply, FinalReply, Reply, TokenChunk

ReplyAction = Literal["skip", "deliver", "finish", "error", "resume", "restart", "broken"]


class AttemptTracker:
    """The attempt, resume and restart state of one request."""

    def __init__(self, *, reproducible: bool, restartable: bool) -> None:
        """Args:
        reproducible: a new attempt yields the same tokens (greedy or seeded sampling).
        restartable: the caller has sent nothing yet and can drop text on ``restart``.
        """
        self._reproducible = reproducible
        self._restartable = restartable
        self.attempt = 0
        """The newest attempt seen (0 before the first reply)."""
        self.num_sent = 0
        """Chunks delivered to the caller since the last restart."""
        self._skip_below = 0
        """A resumed attempt skips its chunks numbered below this (already sent)."""

    def on_reply(self, reply: Reply) -> tuple[ReplyAction, ...]:
        """What to do with `reply`, in order (``resume`` / ``restart`` come before the
        reply's own action); see the module doc."""
        if reply.attempt < self.attempt:
            return ("skip",)
        before: tuple[ReplyAction, ...] = ()
        if reply.attempt > self.attempt:
            if self.num_sent and self.attempt:
                if self._reproducible:
                    self._skip_below = self.num_sent
                    before = ("resume",)
                elif self._restartable:
                    self.num_sent = 0
                    before = ("restart",)
                else:
                    return ("broken",)
            self.attempt = reply.attempt
        match reply:
            case TokenChunk(seq=seq):
                if seq < self._skip_below:
                    return (*before, "skip")
                self.num_sent += 1
                return (*before, "deliver")
            case FinalReply():
                return (*before, "finish")
            case ErrorReply():
                return (*before, "error")
        raise AssertionError(f"not a reply: {type(reply).__name__}")
