"""Next-token sampling for a batch: greedy, or temperature + top-k / top-p / min-p with a
generator per request; presence, frequency and repetition penalties and a logit bias on either.

Each request that samples owns a `torch.Generator` (seeded from `params.seed`, or from
the OS when it has none) and draws exactly one uniform number per generated token from it,
so a seeded request yields the same tokens whatever else shares its batches, and after a
preemption (its K/V recomputed, its generator untouched).

Penalties follow the OpenAI API (presence and frequency, over the tokens generated so
far: ``logit - presence * [count > 0] - frequency * count``) and vLLM / Hugging Face
(repetition, over prompt and generated tokens: a positive logit is divided by it, a
negative one multiplied), applied before the temperature; then the request's ``logit_bias``
is added (OpenAI's: -100 bans a token, 100 makes it all but certain). Until a request with
``min_tokens`` has that many tokens, the tokens that would end it are masked out (vLLM's).
A row with `SamplingState.forced` tokens takes the next of them instead (a thinking budget's
close: engine/thinking.py); its generator still draws, so a seeded request stays reproducible.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shoal.services.worker.engine.structured import TokenMatcher, mask_rows
from shoal.services.worker.generation import TokenLogprobs
from shoal.shared.messages import SamplingParams

MIN_LOGPROB = -9999.0
"""A log probability of minus infinity as reported (JSON has no infinity; vLLM's value)."""


@dataclass
class SamplingState:
    """One request's sampling parameters and random stream."""

    temperature: float
    top_p: float
    generator: torch.Generator | None
    """None for greedy requests."""
    top_k: int = 0
    """Keep the k most likely tokens; 0: all."""
    min_p: float = 0.0
    """Drop tokens less likely than this fraction of the most likely one; 0: none."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None
    """(token ids, biases) added to the row's logits; None: no bias."""
    num_logprobs: int | None = None
    """Report the chosen token's log probability and this many alternatives; None: don't."""
    matcher: TokenMatcher | None = None
    """Structured output: the grammar the tokens must follow (the engine sets it)."""
    grammar_waits: bool = False
    """The grammar applies once the reasoning before it has ended (`SamplingParams.grammar_after`;
    the engine clears it when the text shows that end)."""
    min_tokens: int = 0
    ending_ids: torch.Tensor | None = None
    """The tokens that end the request, masked out until `min_tokens` are chosen; None: none."""
    num_chosen: int = 0
    """Tokens chosen for the request so far (counted while the mask holds, all it needs)."""
    forced: deque[int] = field(default_factory=deque)
    """Tokens the next steps write instead of sampling, one each (the engine sets them)."""

    @classmethod
    def from_params(cls, params: SamplingParams, ending_ids: frozenset[int] = frozenset()) -> SamplingState:
        """`ending_ids`: the tokens that end the request (end-of-sequence and ``stop_token_ids``)."""
        generator = None
        if params.temperature > 0.0:
            generator = torch.Generator()
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed)
        sampling = generator is not None  # top-k and min-p mean nothing to a greedy row
        return cls(
            temperature=params.temperature if sampling else 0.0,
            top_p=params.top_p if sampling else 1.0,
            generator=generator,
            top_k=params.top_k if sampling else 0,
            min_p=params.min_p if sampling else 0.0,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias=_bias_tensors(params.logit_bias),
            num_logprobs=params.logprobs,
            min_tokens=params.min_tokens,
            ending_ids=torch.tensor(sorted(ending_ids), dtype=torch.int64) if params.min_tokens and ending_ids else None,
        )

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def active_matcher(self) -> TokenMatcher | None:
        """The grammar that still decides which tokens may come next, if any."""
        if self.matcher is None or self.grammar_waits or self.matcher.failed:
            return None
        return self.matcher

    @property
    def holds_ending(self) -> bool:
        """The request may not end yet (``min_tokens``): its ending tokens are masked out."""
        return self.ending_ids is not None and self.num_chosen < self.min_tokens

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, a bias, a grammar or a minimum length: the row's logits change before its
        token is chosen."""
        return (self.has_penalties or self.logit_bias is not None or self.active_matcher is not None
                or self.holds_ending)


def _bias_tensors(logit_bias: dict[int, float]) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not logit_bias:
        return None
    return (torch.tensor(list(logit_bias), dtype=torch.int64),
            torch.tensor(list(logit_bias.values()), dtype=torch.float32))


@dataclass(frozen=True)
class TokenHistory:
    """The tokens a row's penalties look at: `token_ids` = prompt, then generated tokens."""

    token_ids: Sequence[int]
    num_prompt_tokens: int


def sample(
    logits: torch.Tensor,
    states: list[SamplingState],
    histories: Sequence[TokenHistory] | None = None,
    argmax: torch.Tensor | None = None,
) -> list[int]:
    """One token per row of `logits` [num_rows, vocab_size], row i sampled per `states[i]`.

    Args:
        histories: each row's tokens so far; needed (and read) only for rows with penalties.
        argmax: each row's argmax, already computed (the native forward's); used when every
            row is greedy without penalties or bias.
    """
    adjusted_rows = [row for row, state in enumerate(states) if state.adjusts_logits]
    if argmax is not None and not adjusted_rows and all(state.generator is None for state in states):
        return _with_forced(argmax.tolist(), states)
    constrained: list[tuple[int, TokenMatcher]] = []
    held_rows: list[int] = []
    if adjusted_rows:
        logits = logits.clone()
        for row in adjusted_rows:
            state = states[row]
            if state.has_penalties:
                assert histories is not None and len(histories) == len(states), "penalties need each row's tokens"
                logits[row] = _penalize(logits[row], state, histories[row])
            if state.logit_bias is not None:
                token_ids, biases = state.logit_bias
                logits[row].index_add_(0, token_ids.to(logits.device), biases.to(logits.device, logits.dtype))
            if state.holds_ending:
                assert state.ending_ids is not None, "holds_ending implies ending_ids"
                logits[row, state.ending_ids.to(logits.device)] = float("-inf")
                held_rows.append(row)
        constrained = [(row, matcher) for row in adjusted_rows if (matcher := states[row].active_matcher) is not None]
        if constrained:
            mask_rows(logits, [row for row, _ in constrained], [matcher for _, matcher in constrained])
    token_ids = logits.argmax(dim=-1)
    sampled_rows = [row for row, state in enumerate(states) if state.generator is not None]
    if sampled_rows:
        token_ids[sampled_rows] = _sample_rows(logits[sampled_rows], [states[row] for row in sampled_rows])
    chosen = _with_forced(token_ids.tolist(), states)
    for row, matcher in constrained:
        matcher.advance(chosen[row])
    for row in held_rows:
        states[row].num_chosen += 1
    return chosen


def _with_forced(chosen: list[int], states: list[SamplingState]) -> list[int]:
    """`chosen`, each row with forced tokens taking the next of them instead."""
    for row, state in enumerate(states):
        if state.forced:  # never while a grammar shapes the row: the engine refuses the pair, a waiting one waits on
            chosen[row] = state.forced.popleft()
    return chosen


def _penalize(logits: torch.Tensor, state: SamplingState, history: TokenHistory) -> torch.Tensor:
    """`logits` [vocab_size] of one row with its penalties applied (a new tensor)."""
    vocab_size = logits.shape[-1]
    device = logits.device
    logits = logits.float()
    if state.repetition_penalty != 1.0 and history.token_ids:
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        seen[torch.tensor(list(history.token_ids), dtype=torch.int64, device=device)] = True
        scaled = torch.where(logits > 0, logits / state.repetition_penalty, logits * state.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    generated = list(history.token_ids[history.num_prompt_tokens :])
    if (state.presence_penalty or state.frequency_penalty) and generated:
        counts = torch.bincount(
            torch.tensor(generated, dtype=torch.int64, device=device), minlength=vocab_size
        )[:vocab_size].float()
        logits = logits - state.frequency_penalty * counts - state.presence_penalty * (counts > 0).float()
    return logits


def _sample_rows(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Inverse-CDF sampling over each row's top-k / top-p / min-p set, one uniform draw per row."""
    device = logits.device
    temperatures = torch.tensor([state.temperature for state in states], device=device)
    probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    top_ps = torch.tensor([state.top_p for state in states], device=device)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    outside = (cumulative - sorted_probs) >= top_ps[:, None]
    if any(state.top_k > 0 for state in states):
        top_ks = torch.tensor([state.top_k or logits.shape[-1] for state in states], device=device)
        ranks = torch.arange(logits.shape[-1], device=device)
        outside |= ranks[None, :] >= top_ks[:, None]
    if any(state.min_p > 0.0 for state in states):
        min_ps = torch.tensor([state.min_p for state in states], device=device)
        outside |= sorted_probs < min_ps[:, None] * sorted_probs[:, :1]
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    cumulative = sorted_probs.cumsum(dim=-1)
    uniforms = torch.cat([torch.rand(1, generator=state.generator) for state in states]).to(device)
    targets = uniforms * cumulative[:, -1]
    picks = torch.searchsorted(cumulative, targets[:, None], right=True).clamp_(max=logits.shape[-1] - 1)
    # A pick past the kept set (float rounding at its edge) falls back to its last token.
    num_kept = (~outside).sum(dim=-1, keepdim=True)
    picks = torch.minimum(picks, num_kept - 1)
    return sorted_ids.gather(-1, picks).squeeze(-1)


def token_logprobs(logits: torch.Tensor, states: list[SamplingState], token_ids: list[int]
                   ) -> list[TokenLogprobs | None] | None:
    """Each row's chosen token's log probability and its `num_logprobs` most likely tokens',
    for the rows that ask (None for the others; None for all when none asks). From the raw
    `logits` [num_rows, vocab_size]: the model's distribution, before penalties, bias and
    temperature (as vLLM reports by default)."""
    rows = [row for row, state in enumerate(states) if state.num_logprobs is not None]
    if not rows:
        return None
    num_top = max(states[row].num_logprobs or 0 for row in rows)
    scores = token_scores(logits[rows], [token_ids[row] for row in rows], num_top)
    result: list[TokenLogprobs | None] = [None] * len(states)
    for row, score in zip(rows, scores, strict=True):
        k = states[row].num_logprobs or 0
        result[row] = score if k == num_top else dataclasses.replace(score, top=score.top[:k])
    return result


def token_scores(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Row i's log probability of ``token_ids[i]`` and its `num_top` most likely tokens, from
    the raw `logits` [rows, vocab_size] (a generated token's row, or a prompt row: row p of a
    prompt is token p + 1's distribution)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1).clamp_(min=MIN_LOGPROB)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    top: list[tuple[tuple[int, float], ...]] = [()] * len(token_ids)
    if num_top:
        values, top_ids = logprobs.topk(num_top, dim=-1)
        top = [tuple(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)]
    return [TokenLogprobs(t, c, k) for t, c, k in zip(token_ids, chosen, top, strict=True)]
