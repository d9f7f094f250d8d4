"""The engine's batch scheduler: continuous batching with chunked prefill and preemption.

Pure and synchronous (no torch, no threads): each `schedule()` call decides which tokens
of which sequences the next forward pass computes and returns it as a `StepPlan`; after the
pass, `update()` takes the sampled tokens. One step:

1. Running sequences, oldest first, each get their next chunk: one token when decoding,
   the rest of the prompt (up to the token budget) while prefilling. Growing past a block
   boundary takes a block; when the pool is exhausted the NEWEST running sequence not yet
   scheduled in this step is preempted (its blocks freed, it waits at the front of the
   queue and is recomputed later: its freed full blocks stay in the prefix cache, so a
   resume usually recomputes only what was evicted meanwhile).
2. If nothing was preempted, waiting sequences are admitted in order while the token
   budget, `max_num_seqs` and the pool allow, each with as much of its prompt as the
   budget leaves (chunked prefill), after reusing its cached prefix (looked up first and
   taken only when the chunk fits, so a sequence left waiting counts nothing).

The oldest running sequence can always proceed: every other sequence can be preempted,
waiting sequences hold no blocks, and the engine caps a sequence's length at the pool's
capacity, so the engine never fails a request for lack of blocks.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from shoal.services.worker.engine.sequence import Sequence, SequenceStatus
from shoal.services.worker.generation import FinishReason
from shoal.shared.kv_cache.manager import KVCacheManager


@dataclass(frozen=True)
class BatchSchedulerConfig:
    max_num_seqs: int = 64
    """Most sequences running at once."""
    max_num_batched_tokens: int = 2048
    """Most tokens one forward pass computes (decodes count one each)."""

    def __post_init__(self) -> None:
        assert self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs}"
        # Every running sequence must be able to decode in every step, or the newest starve.
        assert self.max_num_batched_tokens >= self.max_num_seqs, (
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
            f"max_num_seqs ({self.max_num_seqs})"
        )


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens `[num_computed_tokens, num_computed_tokens + num_new_tokens)` of one sequence."""

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    samples: bool
    """The chunk ends at the sequence's last known token: its output is sampled."""


@dataclass(frozen=True)
class StepPlan:
    """What the next forward pass computes."""

    chunks: list[ScheduledChunk]
    """In batch order; `update` expects one sampled token per chunk with `samples`."""
    copy_pairs: list[tuple[int, int]]
    """(src, dst) blocks to copy (copy-on-write) before the forward pass."""
    preempted_seq_ids: list[str]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class SequenceUpdate:
    """A token a sequence gained in a step, and whether that ended it."""

    seq: Sequence
    token_id: int
    finish_reason: FinishReason | None


class BatchScheduler:
    """Waiting and running queues over one `KVCacheManager` (see module doc)."""

    def __init__(self, config: BatchSchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # ordered by arrival_index, oldest first
        self._sequences: dict[str, Sequence] = {}
        self._num_preemptions = 0

    # ------------------------------------------------------------------ queries

    def get_num_preemptions(self) -> int:
        """Preemptions since the scheduler was made."""
        return self._num_preemptions

    def get_num_waiting(self) -> int:
        return len(self._waiting)

    def get_num_running(self) -> int:
        return len(self._running)

    def get_num_unfinished(self) -> int:
        return len(self._sequences)

    def get_sequence(self, seq_id: str) -> Sequence | None:
        return self._sequences.get(seq_id)

    def get_num_waiting_blocks(self) -> int:
        """Blocks the waiting sequences' known tokens need (before any prefix-cache reuse)."""
        return sum(self.kv_cache.get_num_blocks_for(seq.num_tokens) for seq in self._waiting)

    # ------------------------------------------------------------------ changes

    def add(self, seq: Sequence) -> None:
        assert seq.seq_id not in self._sequences, f"sequence {seq.seq_id!r} is already scheduled"
        assert seq.status is SequenceStatus.WAITING, f"sequence {seq.seq_id!r} must arrive waiting"
        self._sequences[seq.seq_id] = seq
        self._waiting.append(seq)

    def finish(self, seq_id: str, finish_reason: FinishReason) -> Sequence | None:
        """End a sequence now (cancel, stop string): free its blocks. None if unknown."""
        seq = self._sequences.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._release(seq, finish_reason)
        return seq

    def schedule(self) -> StepPlan:
        """Plan the next forward pass (see module doc)."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted_seq_ids: list[str] = []
        running = self._running
        index = 0
        while index < len(running) and budget > 0:
            seq = running[index]
            num_new_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new_tokens > 0, f"running sequence {seq.seq_id!r} has no token to compute"
            while not self.kv_cache.try_allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new_tokens):
                victim = running.pop()  # the newest not yet scheduled this step
                self._preempt(victim)
                preempted_seq_ids.append(victim.seq_id)
                if victim is seq:
                    break
            else:
                chunks.append(self._make_chunk(seq, num_new_tokens))
                budget -= num_new_tokens
                index += 1
        if not preempted_seq_ids:
            budget = self._admit_waiting(budget, chunks)
        return StepPlan(
            chunks=chunks,
            copy_pairs=self.kv_cache.take_copy_pairs(),
            preempted_seq_ids=preempted_seq_ids,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
        )

    def update(self, plan: StepPlan, sampled_token_ids: list[int]) -> list[SequenceUpdate]:
        """Record a finished forward pass of `plan`.

        Args:
            plan: the plan the pass ran.
            sampled_token_ids: one token per chunk with `samples`, in chunk order.

        Returns:
            The sequences that gained a token; finished ones are already released.
            Sequences finished while the pass ran (cancelled) are skipped.
        """
        updates: list[SequenceUpdate] = []
        sampled = iter(sampled_token_ids)
        for chunk in plan.chunks:
            token_id = next(sampled) if chunk.samples else -1
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = chunk.num_computed_tokens + chunk.num_new_tokens
            self.kv_cache.register_computed_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if chunk.samples:
                finish_reason = seq.append_token(token_id)
                updates.append(SequenceUpdate(seq, token_id, finish_reason))
                if finish_reason is not None:
                    self._running.remove(seq)
                    self._release(seq, finish_reason)
        assert next(sampled, None) is None, "more sampled tokens than sampling chunks"
        return updates

    # ------------------------------------------------------------------ internals

    def _admit_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        waiting = self._waiting
        while waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            # A new chunk starts at a block boundary after any reused prefix, so it always
            # needs a free block: without one, don't even look the prompt up.
            if not self.kv_cache.get_num_free_blocks():
                break
            seq = waiting[0]
            # Looks the prompt up first and takes its cached prefix only if the chunk fits:
            # a sequence left waiting counts no cache hits and frees nothing, step after step.
            num_computed_tokens = self.kv_cache.try_start_sequence(
                seq.seq_id, seq.token_ids, budget, seq.block_hashes
            )
            if num_computed_tokens is None:
                break
            seq.num_computed_tokens = num_computed_tokens
            num_new_tokens = min(seq.num_tokens - num_computed_tokens, budget)
            waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self._running, seq, key=_arrival)
            chunks.append(self._make_chunk(seq, num_new_tokens))
            budget -= num_new_tokens
        return budget

    def _make_chunk(self, seq: Sequence, num_new_tokens: int) -> ScheduledChunk:
        end = seq.num_computed_tokens + num_new_tokens
        return ScheduledChunk(seq, seq.num_computed_tokens, num_new_tokens, samples=end == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self._num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._waiting.appendleft(seq)

    def _release(self, seq: Sequence, finish_reason: FinishReason) -> None:
        if self.kv_cache.has_sequence(seq.seq_id):
            self.kv_cache.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason
        del self._sequences[seq.seq_id]


def _arrival(seq: Sequence) -> int:
    return seq.arrival_index
