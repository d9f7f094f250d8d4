"""One request's sequence inside the engine: its tokens, progress and limits."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shoal.services.worker.generation import FinishReason
from shoal.shared.kv_cache.block_pool import BlockHash


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    """Not admitted yet, or preempted (its K/V dropped, to be recomputed)."""
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens of one request (prompt, then generated) and how far their K/V is computed.

    `num_computed_tokens` counts leading tokens whose K/V is in the sequence's blocks; the
    tokens after it are fed to the model next. Once all known tokens are computed the
    model's output at the last one is sampled into a new token.
    """

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_num_tokens: int
    """Prompt plus completion never exceed this (max_tokens and max_model_len, combined)."""
    arrival_index: int
    """Order of arrival: the highest is the newest, preempted first."""
    eos_token_ids: frozenset[int] = frozenset()
    """Tokens that end generation with "stop" (empty when the request ignores EOS)."""
    num_computed_tokens: int = 0
    hole_start: int = 0
    hole_end: int = 0
    """Tokens [hole_start, hole_end) lie before `num_computed_tokens` but have no K/V yet: a
    returning chat session's dropped prefix, recomputed in the prefill of its new tokens
    (empty when equal). Only ever set at admission, and only with the tokens before
    `hole_start` and from `hole_end` on computed."""
    session_id: str | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None
    """Prompt tokens whose K/V it found when it first started (prefix cache, session; a
    session's dropped prefix, recomputed, not counted); None until it starts."""
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Prefix-cache hashes of its full blocks, as far as known: filled by the KV cache
    manager and kept across admission attempts and preemptions, so a prompt is hashed once."""
    extra: dict[str, object] = field(default_factory=dict)
    """Per-sequence state of the layers above the scheduler (sampler, text stream)."""
    prompt_logprobs: int | None = None
    """Score the prompt: each prompt token's log probability and this many alternatives
    (``echo`` with ``logprobs``); None: not asked."""
    num_scored_prompt_rows: int = 0
    """Prompt positions whose row was scored: row p gives token p + 1's log probability."""

    @property
    def wants_prompt_rows(self) -> bool:
        """Prompt rows are still to be scored: its KV must be computed, not reused from a cache."""
        return self.prompt_logprobs is not None and self.num_scored_prompt_rows < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_hole_tokens(self) -> int:
        return self.hole_end - self.hole_start

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> FinishReason | None:
        """Add a generated token; returns why the sequence ends now, if it does."""
        self.token_ids.append(token_id)
        if token_id in self.eos_token_ids:
            return "stop"
        if len(self.token_ids) >= self.max_num_tokens:
            return "length"
        return None
