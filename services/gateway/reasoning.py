"""A reasoning model's answer split into its reasoning and its content, as it streams.

A model registered with a ``reasoning_parser`` writes its thinking between ``<think>`` and
``</think>``; chat answers carry it apart, as vLLM does: ``reasoning`` (and the older name
``reasoning_content``) beside ``content``, and function calls are read from the content only.

* ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ; any model whose chat template opens the
  think block in the prompt): everything up to ``</think>`` is reasoning (a ``<think>`` the
  model writes itself is dropped); an answer that never closes the block is all reasoning.
* ``qwen3``: reasoning only in a block the answer opens with ``<think>``; an answer without
  one is all content (Qwen3 with ``chat_template_kwargs: {"enable_thinking": false}``).

Whitespace right after either tag is dropped. Text that may be the start of a tag waits
for the next piece, so a tag split across chunks never leaks into either part.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shoal.services.gateway.errors import BadRequest
from shoal.shared.messages import SamplingParams
from shoal.shared.model_settings import ReasoningParser

THINK_START = "<think>"
THINK_END = "</think>"
_Phase = Literal["opening", "reasoning", "content"]


def with_thinking_budget(params: SamplingParams, budget: int | None, parser: ReasoningParser | None
                         ) -> SamplingParams:
    """`params` with the model's think block bounded to `budget` tokens (None or -1: no
    bound): the worker closes the block where the parser expects it (``deepseek_r1``: the
    prompt opened it; ``qwen3``: the answer opens it with ``<think>``)."""
    if budget is None or budget < 0:
        return params
    if parser is None:
        raise BadRequest("thinking_token_budget needs a reasoning model: this model is not registered with a "
                         "reasoning_parser, so where its thinking ends is unknown", param="thinking_token_budget")
    if params.has_grammar and params.grammar_after is None:
        raise BadRequest(f"thinking_token_budget cannot be combined with {params.grammar_param} on this model: its "
                         "grammar shapes the whole answer (grammar_after_reasoning is off), leaving no think block",
                         param="thinking_token_budget")
    return msgspec.structs.replace(params, thinking_budget=budget, thinking_end=THINK_END,
                                   thinking_start=THINK_START if parser == "qwen3" else None)


class ReasoningReader:
    """One choice's text in, (reasoning, content) out; `finish` when the choice ends."""

    def __init__(self, parser: ReasoningParser, continued: str | None = None) -> None:
        """`continued`: the assistant message the answer goes on with (``continue_final_message``),
        whose think tags say where the answer starts: after a closed block, in content; inside an
        open one, in reasoning; with text and no tag, where the parser puts an answer's start."""
        self._parser = parser
        self._phase: _Phase = _phase_after(parser, continued) if continued else "opening"
        self._held = ""
        """Text not given out yet: a possible tag's start, or whitespace after a tag."""
        self._skip_space = not continued or continued.rstrip().endswith((THINK_START, THINK_END))
        """Drop the blanks that come next (after a tag); not those that go on with words."""
        self.num_reasoning_tokens = 0
        """Tokens of the chunks that came while the model thought (the one closing its block
        included): exact to the chunk, and a chunk is most often one token."""
        self._undecided_tokens = 0
        """Tokens fed while the answer's start could not yet tell whether it thinks."""
        self._thought = self._phase == "reasoning"

    def feed(self, text: str, num_tokens: int = 0) -> tuple[str, str]:
        """The reasoning and content `text` gives out; `num_tokens`: the tokens it came in."""
        before = self._phase
        reasoning: list[str] = []
        content: list[str] = []
        self._held += text
        while self._held:
            if self._phase == "opening":
                if not self._open():
                    break
            elif self._phase == "reasoning":
                piece, closed = self._until_end()
                reasoning.append(piece)
                if not closed:
                    break
            else:
                content.append(self._visible(self._held))
                self._held = ""
        self._count(before, num_tokens)
        return "".join(reasoning), "".join(content)

    def _count(self, before: _Phase, num_tokens: int) -> None:
        if before == "reasoning":
            self.num_reasoning_tokens += num_tokens
        elif before == "opening":
            self._undecided_tokens += num_tokens
            if self._phase != "opening":
                self._decided()

    def _decided(self) -> None:
        """The answer's start told whether it thinks: the tokens fed until then count if it did."""
        if self._thought:
            self.num_reasoning_tokens += self._undecided_tokens
        self._undecided_tokens = 0

    def finish(self) -> tuple[str, str]:
        """What is held when the choice ends: a tag's start that never completed is text."""
        held, self._held = self._held, ""
        if self._phase == "opening":
            self._phase = "reasoning" if self._parser == "deepseek_r1" else "content"
            self._thought = self._phase == "reasoning"
            self._decided()
        visible = self._visible(held)
        return (visible, "") if self._phase == "reasoning" else ("", visible)

    def _open(self) -> bool:
        """Decide how the answer starts; False while the text so far cannot tell."""
        stripped = self._held.lstrip()
        if stripped.startswith(THINK_START):
            self._held = stripped[len(THINK_START):]
            self._phase = "reasoning"
            self._thought = True
            self._skip_space = True
            return True
        if THINK_START.startswith(stripped):
            return False  # "", or a prefix of "<think>": wait
        self._phase = "reasoning" if self._parser == "deepseek_r1" else "content"
        self._thought = self._phase == "reasoning"
        return True

    def _until_end(self) -> tuple[str, bool]:
        """The reasoning in what is held, and whether ``</think>`` closed it."""
        end = self._held.find(THINK_END)
        if end >= 0:
            piece = self._held[:end]
            self._held = self._held[end + len(THINK_END):]
            self._phase = "content"
            visible = self._visible(piece)
            self._skip_space = True
            return visible, True
        keep = _partial_tag_length(self._held, THINK_END)
        piece, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return self._visible(piece), False

    def _visible(self, text: str) -> str:
        if self._skip_space:
            text = text.lstrip()
            self._skip_space = not text
        return text


def _phase_after(parser: ReasoningParser, continued: str) -> _Phase:
    opened, closed = continued.rfind(THINK_START), continued.rfind(THINK_END)
    if closed > opened:
        return "content"
    if opened >= 0:
        return "reasoning"
    if not continued.strip():
        return "opening"
    return "reasoning" if parser == "deepseek_r1" else "content"


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag` (held back: the rest
    of the tag may follow)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
