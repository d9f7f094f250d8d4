"""Redelivery vs streaming: what the gateway does with each reply of one request (pure).

A request may run several times: a replica that dies leaves its delivery un-acked and
JetStream redelivers it (a new *attempt*: replies carry the delivery count), and when
replies of an attempt are lost on the way the gateway publishes the request again (a new
*try*, under a new wire id; its attempts count from 1 again). Fed the replies in arrival
order, `AttemptTracker` says what the caller does with each:

    skip      a reply of an older attempt, a duplicate, an attempt notice, or a chunk a
              resumed attempt already sent
    deliver   a chunk: pass it on
    finish    the final reply: pass it on, the request is done
    error     the worker's error reply: the request fails with it
    resume    (before the reply's own action) a newer attempt after text was sent, on a
              reproducible request (greedy or seeded): its chunks below the number
              already sent are skipped, each checked against the running hash of token
              ids the skipped chunk had the first time, so the stream goes on where it
              stopped
    restart   (before the reply's own action) a newer attempt after text was sent, not
              reproducible, and the caller can still drop what it has (nothing reached
              the client): drop the text so far
    broken    a newer attempt after text was sent that cannot go on (not reproducible and
              not restartable, or a resumed attempt whose tokens differ): the request fails
    lost      a reply of the current attempt never came (a gap in its chunk numbers, or a
              final reply whose chunk count differs): the caller publishes the request
              again (`begin_try`); the next try's first reply then resumes, restarts or
              breaks as above. Never a reply with text missing.

Never a duplicate, never a silent restart of text a client holds. A newer attempt
before any text was sent simply takes over.

The tracker also knows where the current attempt runs (its `AttemptNotice`), so
`on_replica_failed` can say what to do when that replica dies: NAK its delivery (it runs
again at once), end a stream that cannot resume, or give up on a request that has killed
`max_deaths` replicas (a poison request).
"""

from __future__ import annotations

from typing import Literal

from shoal.shared.messages import AttemptNotice, ErrorReply, FinalReply, Reply, TokenChunk

ReplyAction = Literal["skip", "deliver", "finish", "error", "resume", "restart", "broken", "lost"]
FailureAction = Literal["ignore", "nak", "broken", "poison"]
"""What to do when the replica of the current attempt dies: nothing (another replica holds it,
or the attempt is over); NAK its delivery so it runs again now; end the request (a stream that
can neither resume nor restart); give up (it killed `max_deaths` replicas)."""


class AttemptTracker:
    """The attempt, resume and restart state of one request."""

    def __init__(self, *, reproducible: bool, restartable: bool, max_deaths: int = 2) -> None:
        """Args:
        reproducible: a new attempt yields the same tokens (greedy or seeded sampling).
        restartable: the caller has sent nothing yet and can drop text on ``restart``.
        max_deaths: replicas the request may see die while running it before it is given up.
        """
        self._reproducible = reproducible
        self._restartable = restartable
        self._max_deaths = max_deaths
        self.attempt = 0
        """The newest attempt of the current try seen (0 before its first reply)."""
        self.num_sent = 0
        """Chunks delivered to the caller since the last restart."""
        self._sent_hashes: list[int] = []
        """The token hash of each delivered chunk, by position."""
        self._skip_below = 0
        """A resumed attempt skips its chunks numbered below this (already sent)."""
        self._next_seq = 0
        """The chunk number the current attempt sends next."""
        self.replica_id = ""
        """Where the current attempt runs (from its "started" notice)."""
        self.ack_subject = ""
        """The current attempt's JetStream ack subject."""
        self.is_running = False
        """The current attempt started on `replica_id` and has not ended or been handed back."""
        self.num_deaths = 0
        """Replicas that died while running this request."""

    def begin_try(self) -> None:
        """The request is published again (a new try): its attempts count from 1 again."""
        self.attempt = 0
        self._next_seq = 0
        self.is_running = False
        self.replica_id = self.ack_subject = ""

    def on_reply(self, reply: Reply) -> tuple[ReplyAction, ...]:
        """What to do with `reply`, in order (``resume`` / ``restart`` come before the
        reply's own action); see the module doc."""
        if reply.attempt < self.attempt:
            return ("skip",)
        before: tuple[ReplyAction, ...] = ()
        if reply.attempt > self.attempt:
            before = self._take_over()
            if before == ("broken",):
                return before
            self.attempt = reply.attempt
            self._next_seq = 0
            self.is_running = False
        match reply:
            case AttemptNotice(state="started"):
                self.is_running = True
                self.replica_id, self.ack_subject = reply.replica_id, reply.ack_subject
                return (*before, "skip")
            case AttemptNotice():
                self.is_running = False  # handed back: the next attempt comes from the queue
                return (*before, "skip")
            case TokenChunk(seq=seq):
                if seq < self._next_seq:
                    return (*before, "skip")  # a duplicate
                if seq > self._next_seq:
                    return (*before, "lost")
                self._next_seq += 1
                if seq < self._skip_below:
                    return (*before, "skip" if self._same_tokens(seq, reply.token_hash) else "broken")
                self.num_sent += 1
                self._sent_hashes.append(reply.token_hash)
                return (*before, "deliver")
            case FinalReply(seq=seq):
                if seq != self._next_seq:
                    return (*before, "lost")
                if seq < self._skip_below:
                    return (*before, "broken")  # the resumed attempt ended before the text sent
                self.is_running = False
                return (*before, "finish")
            case ErrorReply():
                self.is_running = False
                return (*before, "error")
        raise AssertionError(f"not a reply: {type(reply).__name__}")

    def on_replica_failed(self, replica_id: str) -> FailureAction:
        """`replica_id` died (its record turned ``failed``): see `FailureAction`."""
        if not self.is_running or replica_id != self.replica_id:
            return "ignore"
        self.is_running = False
        self.num_deaths += 1
        if self.num_deaths >= self._max_deaths:
            return "poison"
        if self.num_sent and not self._reproducible and not self._restartable:
            return "broken"
        return "nak"

    def _take_over(self) -> tuple[ReplyAction, ...]:
        """A newer attempt (or try) begins: how it continues what was sent."""
        if not self.num_sent:
            return ()
        if self._reproducible:
            self._skip_below = self.num_sent
            return ("resume",)
        if self._restartable:
            self.num_sent = 0
            self._sent_hashes = []
            return ("restart",)
        return ("broken",)

    def _same_tokens(self, seq: int, token_hash: int) -> bool:
        """Whether a resumed attempt's chunk `seq` ends on the same tokens as the one sent
        (0: a worker that does not hash, unchecked)."""
        sent = self._sent_hashes[seq]
        return not sent or not token_hash or sent == token_hash
