"""Next-token sampling for a batch: greedy, or temperature + top-p with a generator per request.

Each request that samples owns a `torch.Generator` (seeded from `params.seed`, or from
the OS when it has none) and draws exactly one uniform number per generated token from it,
so a seeded request yields the same tokens whatever else shares its batches, and after a
preemption (its K/V recomputed, its generator untouched).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.shared.messages import SamplingParams


@dataclass
class SamplingState:
    """One request's sampling parameters and random stream."""

    temperature: float
    top_p: float
    generator: torch.Generator | None
    """None for greedy requests."""

    @classmethod
    def from_params(cls, params: SamplingParams) -> SamplingState:
        if params.temperature <= 0.0:
            return cls(0.0, 1.0, None)
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        return cls(params.temperature, params.top_p, generator)


def sample(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    """One token per row of `logits` [num_rows, vocab_size], row i sampled per `states[i]`."""
    token_ids = logits.argmax(dim=-1)
    sampled_rows = [row for row, state in enumerate(states) if state.generator is not None]
    if sampled_rows:
        token_ids[sampled_rows] = _sample_rows(logits[sampled_rows], [states[row] for row in sampled_rows])
    return token_ids.tolist()


def _sample_rows(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Inverse-CDF sampling over each row's top-p nucleus, one uniform draw per row."""
    device = logits.device
    temperatures = torch.tensor([state.temperature for state in states], device=device)
    probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    top_ps = torch.tensor([state.top_p for state in states], device=device)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    outside = (cumulative - sorted_probs) >= top_ps[:, None]
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    cumulative = sorted_probs.cumsum(dim=-1)
    uniforms = torch.cat([torch.rand(1, generator=state.generator) for state in states]).to(device)
    targets = uniforms * cumulative[:, -1]
    picks = torch.searchsorted(cumulative, targets[:, None], right=True).clamp_(max=logits.shape[-1] - 1)
    # A pick past the nucleus (float rounding at its edge) falls back to its last token.
    num_kept = (~outside).sum(dim=-1, keepdim=True)
    picks = torch.minimum(picks, num_kept - 1)
    return sorted_ids.gather(-1, picks).squeeze(-1)
