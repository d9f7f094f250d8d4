"""What the paged engine's step thread hands to the event loops: per request, text outputs
or token ids for the consumer to detokenize, grouped by loop so that one thread-safe call
per loop and step delivers them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from shoal.services.worker.engine.sampler import SamplingState
from shoal.services.worker.engine.sequence import Sequence
from shoal.services.worker.engine.thinking import ThinkingBudget
from shoal.services.worker.generation import GenerationOutput, GenerationRequest, TextStream, TokenLogprobs


@dataclass(frozen=True, eq=False)
class Tokens:
    """New tokens of one request, for its consumer to turn into text (requests without stop
    strings: their detokenization runs on the event loop, off the step thread); with `final`,
    the request's last output, whose text and token count the consumer fills in."""

    token_ids: tuple[int, ...]
    final: GenerationOutput | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    """Of `token_ids`, when the request asked for them."""


@dataclass(eq=False)
class RequestState:
    """What the step thread needs to answer one request."""

    request: GenerationRequest
    seq: Sequence
    sampling: SamplingState
    text: TextStream
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[GenerationOutput | Tokens]
    num_unsent_tokens: int = 0
    """Tokens whose text is held back (half a character, a possible stop string)."""
    unsent_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Those tokens' log probabilities (requests that ask for them)."""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """The prompt's scores so far (requests that ask: `Sequence.prompt_logprobs`); the
    consumer reads them with the request's first output, after the last was added."""
    finished: bool = False
    marker_search_from: int = 0
    """Where in the text a reasoning end marker may still begin (`SamplingParams.grammar_after`)."""
    thinking: ThinkingBudget | None = None
    """The request's thinking budget while its think block may still be cut (engine/thinking.py)."""
    detokenize_in_step: bool = False
    """With stop strings the step thread detokenizes (a stop string ends the sequence in the
    step that completes it); without, the consumer does (`Tokens`)."""


@dataclass
class Outbox:
    """Outputs of one step, grouped by event loop: one thread-safe call per loop per step."""

    by_loop: dict[
        asyncio.AbstractEventLoop,
        list[tuple[asyncio.Queue[GenerationOutput | Tokens], GenerationOutput | Tokens]],
    ] = field(default_factory=dict)

    def put(self, state: RequestState, output: GenerationOutput | Tokens) -> None:
        self.by_loop.setdefault(state.loop, []).append((state.queue, output))

    def send(self) -> None:
        for loop, items in self.by_loop.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(deliver, items)


def deliver(
    items: list[tuple[asyncio.Queue[GenerationOutput | Tokens], GenerationOutput | Tokens]],
) -> None:
    for queue, output in items:
        queue.put_nowait(output)
