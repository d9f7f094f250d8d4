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

With a session cache (`SessionHooks`, the engine's `SessionKV`), blocks held by cached chat
sessions give way first: when the pool cannot supply a step, sessions' blocks are reclaimed
(demoted to the CPU tier or dropped) before any running sequence is preempted. A waiting
turn of a cached session starts from its cached KV (`SessionHooks.try_start`); its dropped
prefix, if any, is a "hole" recomputed by an extra chunk of the same sequence in the same
forward pass as (or passes before) its new tokens: chunk [hole_start, hole_end) with the
context up to hole_end, then the new tokens with the whole context. Each layer writes every
row's K/V before any row attends, so the new tokens see the hole's K/V of the same pass. A
finished session turn hands its blocks back to the session cache (`SessionHooks.release`).

The oldest running sequence can always proceed: every other sequence can be preempted,
waiting sequences hold no blocks, cached sessions' blocks can always be reclaimed, and the
engine caps a sequence's length at the pool's capacity, so the engine never fails a
request for lack of blocks.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

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
    recomputes: bool = False
    """The chunk fills (part of) the sequence's hole: a returning session's dropped prefix."""


@dataclass(frozen=True)
class StepPlan:
    """What the next forward pass computes."""

    chunks: list[ScheduledChunk]
    """In batch order; `update` expects one sampled token per chunk with `samples`."""
    copy_pairs: list[tuple[int, int]]
    """(src, dst) blocks to copy (copy-on-write) before the forward pass."""
    preempted_seq_ids: list[str]
    num_batched_tokens: int
    swap_out_pairs: list[tuple[int, int]] = field(default_factory=list)
    """(KV pool block, host block) pairs to copy GPU -> CPU first, before anything writes."""
    swap_in_pairs: list[tuple[int, int]] = field(default_factory=list)
    """(host block, KV pool block) pairs to copy CPU -> GPU next, before the forward pass."""

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class SessionHooks(Protocol):
    """What the scheduler asks of a session cache (the engine's `SessionKV`)."""

    def get_num_gpu_blocks(self) -> int:
        """KV pool blocks held by cached sessions (all reclaimable)."""
        ...

    def reclaim(self, num_blocks: int, keep_session_id: str | None = None) -> int:
        """Free at least `num_blocks` pool blocks held by cached sessions; returns how many."""
        ...

    def try_start(self, seq: Sequence, max_num_new_tokens: int) -> bool | None:
        """Start a waiting turn from its session's cached KV, all or nothing.

        Returns:
            True when started (block table open, `num_computed_tokens` and the hole set,
            room made for the step's chunks: the hole up to the budget, then new tokens up
            to what the budget leaves, as `schedule` plans them); False when the pool cannot
            supply the blocks now (nothing changed); None when the session has nothing to
            reuse (start it as any other sequence).
        """
        ...

    def release(self, seq: Sequence, finish_reason: FinishReason) -> None:
        """A session's turn ended: keep its KV (or free it)."""
        ...

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap-out pairs, swap-in pairs) the next forward pass must copy first; drains."""
        ...


@dataclass(frozen=True)
class SequenceUpdate:
    """A token a sequence gained in a step, and whether that ended it."""

    seq: Sequence
    token_id: int
    finish_reason: FinishReason | None


class BatchScheduler:
    """Waiting and running queues over one `KVCacheManager` (see module doc)."""

    def __init__(
        self, config: BatchSchedulerConfig, kv_cache: KVCacheManager, sessions: SessionHooks | None = None
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.sessions = sessions
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
            num_recompute, num_new_tokens = _split_budget(seq, budget)
            assert num_recompute + num_new_tokens > 0, f"running sequence {seq.seq_id!r} has no token to compute"
            if num_new_tokens and not self._allocate_or_preempt(seq, num_new_tokens, preempted_seq_ids):
                continue  # seq itself was preempted: it was the last running one
            self._add_chunks(seq, num_recompute, num_new_tokens, chunks)
            budget -= num_recompute + num_new_tokens
            index += 1
        if not preempted_seq_ids:
            budget = self._admit_waiting(budget, chunks)
        swap_out_pairs: list[tuple[int, int]] = []
        swap_in_pairs: list[tuple[int, int]] = []
        if self.sessions is not None and chunks:  # copies run with a forward pass, never alone
            swap_out_pairs, swap_in_pairs = self.sessions.take_swaps()
        return StepPlan(
            chunks=chunks,
            copy_pairs=self.kv_cache.take_copy_pairs(),
            preempted_seq_ids=preempted_seq_ids,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            swap_out_pairs=swap_out_pairs,
            swap_in_pairs=swap_in_pairs,
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
            if chunk.recomputes:
                seq.hole_start = chunk.num_computed_tokens + chunk.num_new_tokens
                if seq.hole_start == seq.hole_end:  # filled: the blocks up to the new tokens
                    # join the prefix cache (those after the hole waited for it: a prefix hit
                    # needs the whole chain before a block)
                    self.kv_cache.register_blocks(seq.seq_id, 0, seq.num_computed_tokens // self.kv_cache.block_size)
                    seq.hole_start = seq.hole_end = 0
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
        sessions = self.sessions
        while waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            # A new chunk starts at a block boundary after any reused prefix, so it always
            # needs a free block: without one (or one to reclaim), don't even look it up.
            if not self.kv_cache.get_num_free_blocks() and not (sessions and sessions.get_num_gpu_blocks()):
                break
            seq = waiting[0]
            started = None
            if sessions is not None and seq.session_id is not None and not seq.wants_prompt_rows:
                started = sessions.try_start(seq, budget)
                if started is False:
                    break
            if not started and not self._try_start(seq, budget):
                break
            if seq.num_cached_tokens is None:  # a preempted sequence's restart keeps its first figure
                seq.num_cached_tokens = seq.num_computed_tokens - seq.num_hole_tokens
            num_recompute, num_new_tokens = _split_budget(seq, budget)
            waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self._running, seq, key=_arrival)
            self._add_chunks(seq, num_recompute, num_new_tokens, chunks)
            budget -= num_recompute + num_new_tokens
        return budget

    def _try_start(self, seq: Sequence, budget: int) -> bool:
        """Open the sequence's block table after its cached prefix, with room for its first
        chunk, reclaiming session blocks when the pool is short."""
        # Looks the prompt up first and takes its cached prefix only if the chunk fits:
        # a sequence left waiting counts no cache hits and frees nothing, step after step.
        kv_cache = self.kv_cache
        reuse = not seq.wants_prompt_rows
        num_computed_tokens = kv_cache.try_start_sequence(seq.seq_id, seq.token_ids, budget, seq.block_hashes,
                                                          reuse_prefix=reuse)
        if num_computed_tokens is None and self.sessions is not None:
            num_needed = kv_cache.get_num_blocks_to_start(seq.token_ids, budget, seq.block_hashes, reuse_prefix=reuse)
            if self.sessions.reclaim(num_needed - kv_cache.get_num_free_blocks()):
                num_computed_tokens = kv_cache.try_start_sequence(
                    seq.seq_id, seq.token_ids, budget, seq.block_hashes, reuse_prefix=reuse
                )
        if num_computed_tokens is None:
            return False
        seq.num_computed_tokens = num_computed_tokens
        return True

    def _allocate_or_preempt(self, seq: Sequence, num_new_tokens: int, preempted_seq_ids: list[str]) -> bool:
        """Room for a running sequence's next tokens: from free blocks, then from cached
        sessions, then by preempting the newest running sequences. False when `seq` itself
        was preempted."""
        kv_cache = self.kv_cache
        while not kv_cache.try_allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new_tokens):
            if self.sessions is not None:
                num_needed = kv_cache.get_num_new_blocks(seq.seq_id, seq.num_computed_tokens, num_new_tokens)
                if self.sessions.reclaim(num_needed - kv_cache.get_num_free_blocks()):
                    continue
            victim = self._running.pop()  # the newest not yet scheduled this step
            self._preempt(victim)
            preempted_seq_ids.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _add_chunks(
        self, seq: Sequence, num_recompute: int, num_new_tokens: int, chunks: list[ScheduledChunk]
    ) -> None:
        if num_recompute:
            chunks.append(ScheduledChunk(seq, seq.hole_start, num_recompute, samples=False, recomputes=True))
        if num_new_tokens:
            end = seq.num_computed_tokens + num_new_tokens
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new_tokens, samples=end == seq.num_tokens))

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.hole_start = seq.hole_end = 0
        seq.num_preemptions += 1
        self._num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._waiting.appendleft(seq)

    def _release(self, seq: Sequence, finish_reason: FinishReason) -> None:
        if self.sessions is not None and seq.session_id is not None:
            self.sessions.release(seq, finish_reason)
        elif self.kv_cache.has_sequence(seq.seq_id):
            self.kv_cache.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason
        del self._sequences[seq.seq_id]


def _arrival(seq: Sequence) -> int:
    return seq.arrival_index


def _split_budget(seq: Sequence, budget: int) -> tuple[int, int]:
    """(hole tokens, new tokens) a sequence computes in a step with `budget` tokens left: the
    hole first; new tokens only once the hole is filled in this step (they attend to it)."""
    num_recompute = min(seq.num_hole_tokens, budget)
    if num_recompute < seq.num_hole_tokens:
        return num_recompute, 0
    return num_recompute, min(seq.num_tokens - seq.num_computed_tokens, budget - num_recompute)
