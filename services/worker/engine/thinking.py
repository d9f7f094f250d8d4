"""A thinking budget: a reasoning model's think block cut at a number of tokens (vLLM's
``thinking_token_budget``, Anthropic's ``thinking.budget_tokens``, llama.cpp's
``--reasoning-budget``).

A model that loops inside its think block ("Wait, let me check again...") spends the whole
``max_tokens`` there and never answers. With a budget the engine counts the tokens generated
inside the block; when the budget is spent before the model closes the block, it writes the
close itself (`FORCED_END`, its tokens chosen one per step instead of sampled) and the
answer starts after it, as if the model had stopped thinking.

Where the block starts: at the answer's first token when the prompt opened it (DeepSeek-R1's
template, or any prompt that ends with the opening marker; an opening marker the answer writes
anyway, as older R1 templates let it, is not counted), else once the answer opens it (Qwen3
writes ``<think>`` itself); an answer that starts with anything else does not think and is
left alone. A prompt that ends with the closing marker (thinking turned off) is never
touched. Pure: text in, token ids out; the engine feeds it each token's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["opening", "thinking", "done"]


def opening_of(end_marker: str) -> str:
    """The marker that opens the block `end_marker` closes (``</think>``: ``<think>``)."""
    return end_marker.replace("</", "<", 1)


def forced_end(end_marker: str) -> str:
    """The text written when the budget is spent: the block closed on a line of its own, and
    the blank line reasoning models put before their answer."""
    return f"\n{end_marker}\n\n"


@dataclass
class ThinkingBudget:
    """One request's budget, fed the answer's text after each token."""

    budget: int
    """Tokens the block may hold (0: closed at once)."""
    open_marker: str | None
    """The marker the answer opens its block with; None: the prompt opened it."""
    end_marker: str
    forced_ids: tuple[int, ...]
    """`forced_end`'s tokens."""
    phase: Phase = "thinking"
    num_thinking_tokens: int = 0
    _answer_may_open: bool = False
    """The prompt opened the block, and the answer has written nothing yet but (the start of)
    an opening marker of its own: such tokens are not thinking."""
    _search_from: int = 0
    """Where in the text the end marker may still begin."""

    @classmethod
    def start(cls, budget: int, open_marker: str | None, end_marker: str, forced_ids: tuple[int, ...],
              prompt_text_end: str) -> ThinkingBudget | None:
        """The budget of a request whose prompt's text ends with `prompt_text_end` (None: it
        does not think, the prompt closed the block)."""
        tail = prompt_text_end.rstrip()
        if tail.endswith(end_marker):
            return None
        opened = open_marker is None or tail.endswith(open_marker)
        return cls(budget, open_marker, end_marker, forced_ids, phase="thinking" if opened else "opening",
                   _answer_may_open=open_marker is None)

    def at_start(self) -> tuple[int, ...]:
        """The tokens to write before any is sampled: the close, when nothing may be thought."""
        if self.phase == "thinking" and self.budget == 0:
            self.phase = "done"
            return self.forced_ids
        return ()

    def after_token(self, text: str) -> tuple[int, ...]:
        """`text`: the answer so far, one token longer than at the last call. The tokens to write
        next when this token spent the budget (once), else none."""
        if self.phase == "opening":
            return self._opening(text)
        if self.phase != "thinking":
            return ()
        if text.find(self.end_marker, self._search_from) >= 0:
            self.phase = "done"  # the model closed the block itself
            return ()
        self._search_from = max(0, len(text) - len(self.end_marker) + 1)
        if self._answer_may_open and self._only_an_opening(text):
            return ()
        self._answer_may_open = False
        self.num_thinking_tokens += 1
        if self.num_thinking_tokens >= self.budget:
            self.phase = "done"
            return self.forced_ids
        return ()

    def _only_an_opening(self, text: str) -> bool:
        start, opening = text.strip(), opening_of(self.end_marker)
        return opening.startswith(start) or start == opening

    def _opening(self, text: str) -> tuple[int, ...]:
        assert self.open_marker is not None, "a block the prompt opened starts in the thinking phase"
        start = text.lstrip()
        if start.startswith(self.open_marker):
            self.phase = "thinking"
            self._search_from = len(text) - len(start) + len(self.open_marker)
            return self.at_start()
        if not self.open_marker.startswith(start):
            self.phase = "done"  # the answer starts with words: it does not think
        return ()
