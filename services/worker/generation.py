"""What a worker's engine takes and gives, independent of how it generates.

`GenerationRequest` goes in (token ids + sampling parameters), a stream of
`GenerationOutput` comes out (text deltas, then one finished output with exact
usage). `TextStream` turns generated token ids into text deltas: incremental
detokenization that never emits half a UTF-8 character, plus OpenAI stop
strings (the stop string itself is not returned, and text that could still
become a stop string is held back until it cannot).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from shoal.shared.errors import ShoalError
from shoal.shared.messages import CONTEXT_LENGTH_EXCEEDED, SamplingParams

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "cancelled", "error"]


def prompt_too_long(num_prompt_tokens: int, max_prompt_tokens: int, what_bounds: str) -> RequestRejected:
    """A 400 (``context_length_exceeded``, as OpenAI and vLLM answer) for a prompt longer than
    `what_bounds` takes, worded as Anthropic's (clients such as Claude Code compact a
    conversation on "prompt is too long")."""
    return RequestRejected(f"prompt is too long: {num_prompt_tokens} tokens > {max_prompt_tokens} maximum "
                           f"({what_bounds})", 400, code=CONTEXT_LENGTH_EXCEEDED)


def check_fits_context(num_prompt_tokens: int, max_model_len: int, params: SamplingParams, what_bounds: str) -> None:
    """Raise RequestRejected unless the prompt fits a context of `max_model_len` tokens (what
    `what_bounds` names): with room for one token to answer (an embedding needs none), and for
    all of ``max_tokens`` when the client asked for exactly that (`max_tokens_must_fit`)."""
    if params.embed:
        if num_prompt_tokens > max_model_len:
            raise prompt_too_long(num_prompt_tokens, max_model_len, what_bounds)
        return
    if num_prompt_tokens >= max_model_len:
        raise prompt_too_long(num_prompt_tokens, max_model_len - 1, f"{what_bounds}, less one token to answer")
    if params.max_tokens_must_fit and num_prompt_tokens + params.max_tokens > max_model_len:
        raise RequestRejected(
            f"this model's maximum context length is {max_model_len} tokens; the request needs "
            f"{num_prompt_tokens + params.max_tokens} ({num_prompt_tokens} in the prompt, {params.max_tokens} "
            "to answer): shorten the prompt or lower max_tokens", 400, param="max_tokens",
            code=CONTEXT_LENGTH_EXCEEDED)


class RequestRejected(ShoalError, ValueError):
    """The engine cannot run this request at all (raised by `Engine.generate` before any output).

    `status` is the HTTP status the gateway answers with (400: invalid for this model, a
    prompt too long for it or its KV pool among them).
    """

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        """The error's ``code`` (``context_length_exceeded``: the prompt is longer than the model takes)."""
        self.param = param
        """The request field at fault; None: the prompt (or messages), which is what the
        engine validates unless it says otherwise."""


class EngineFailed(ShoalError, RuntimeError):
    """The engine can run nothing more: a CUDA error poisoned its process's context
    (`device_errors`). Raised by `Engine.generate` for every request it held and every
    later one; the worker hands them back to the queue for their next attempt and exits,
    and its node agent starts a new worker."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    """Prompt + completion may not exceed this; generation stops with "length" there."""
    session_id: str | None = None
    """A chat session the request is a turn of: an engine with a session cache keeps the
    turn's KV when it ends and reuses the part of it that the next turn's prompt starts with
    (docs/sessions.md). Without a session cache, or with None, it changes nothing."""

    @property
    def ending_token_ids(self) -> frozenset[int]:
        """The tokens that end it: end-of-sequence (unless it ignores EOS) and its ``stop_token_ids``."""
        return (frozenset() if self.params.ignore_eos else self.eos_token_ids) | frozenset(self.params.stop_token_ids)


def embedding_bytes(hidden: torch.Tensor, normalize: bool = True) -> bytes:
    """An embedding request's answer from its last token's final hidden state [H]: the vector
    L2-normalized (vLLM's default pooling for a decoder model) unless `normalize` is off, as
    float32 little-endian bytes."""
    vector = hidden.float()
    if normalize:
        vector = vector / vector.norm().clamp_min(1e-12)
    return bytes(vector.cpu().numpy().astype("<f4").tobytes())


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log probability and the `top` most likely (token id, log
    probability) pairs at its place, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationOutput:
    request_id: str
    text: str
    """New text since the previous output (may be empty)."""
    num_new_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose K/V the request found (prefix cache, its session), not computed."""
    embedding: bytes | None = None
    """An embedding request's vector (`SamplingParams.embed`), float32 little-endian."""
    stop_reason: str | None = None
    """The stop string that ended the text (finish reason ``stop``), if one did."""
    error: str | None = None
    token_hash: int = 0
    """`next_token_hash` over every token generated so far (`TextStream.token_hash`)."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """Of this output's new tokens, in order, when the request asked for them."""
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    """On a request's first output, when it asked (``params.prompt_logprobs``): each prompt
    token's but the first (nothing comes before it), in order."""


class Engine(Protocol):
    """A worker's generation engine (plain HF `generate`, or Shoal's paged engine)."""

    @property
    def max_model_len(self) -> int:
        """The longest context it serves: prompt and completion together."""
        ...

    def num_free_slots(self) -> int:
        """How many more requests the engine can admit now (the worker fetches this many)."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Start `request`; yields outputs until one with ``finished=True``.

        Raises:
            RequestRejected: the request cannot run here at all.
            EngineFailed: the engine died (of a CUDA error) before the request finished.
        """
        ...

    def cancel(self, request_id: str) -> bool:
        """Stop a running request and free its resources now; False if unknown."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class SuspendableEngine(Engine, Protocol):
    """An engine that can stay across a sleep (Shoal's paged engine): `suspend` frees what
    it holds on the device, `resume` takes it back, so a wake builds nothing."""

    @property
    def held_bytes(self) -> int:
        """What it holds on the device besides the weights (KV pool, activation reserve)."""
        ...

    async def suspend(self) -> None: ...

    def resume(self) -> None: ...


TOKEN_HASH_MODULUS = (1 << 61) - 1
TOKEN_HASH_BASE = 1_000_003


def next_token_hash(token_hash: int, token_id: int) -> int:
    """The running hash of a token sequence after one more token (polynomial, mod 2**61 - 1).

    Chunks carry it so the gateway can check that a resumed attempt generated exactly the
    tokens the client already holds before it splices the rest on (docs/reliability.md)."""
    return (token_hash * TOKEN_HASH_BASE + token_id + 1) % TOKEN_HASH_MODULUS


class Detokenizer(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class TextStream:
    """Incremental detokenization with stop strings for one sequence.

    Call `push(token_id)` for each generated token; it returns the text that
    may be sent now. `stopped` turns True when a stop string appeared; then
    `finish()` returns the rest (text before the stop string).
    """

    tokenizer: Detokenizer
    stop: Sequence[str] = ()
    min_tokens: int = 0
    """A stop string ends the text only where it ends in the text of this token or a later one
    (vLLM's ``min_tokens``)."""
    _token_ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _text: str = ""
    _num_emitted_chars: int = 0
    _stop_floor: int = 0
    """Characters of text before the `min_tokens`-th token: no stop string may end in them."""
    stopped: bool = False
    stopped_by: str | None = None
    """The stop string that ended the text, once one has."""
    token_hash: int = 0
    """`next_token_hash` over every token pushed so far."""

    def __post_init__(self) -> None:
        # An empty stop string would match at once and end every completion with no text.
        self.stop = tuple(stop for stop in self.stop if stop)

    def push(self, token_id: int) -> str:
        assert not self.stopped, "TextStream.push after a stop string ended the text"
        self._token_ids.append(token_id)
        self.token_hash = next_token_hash(self.token_hash, token_id)
        self._text += self._decode_new_text()
        if len(self._token_ids) < self.min_tokens:
            self._stop_floor = len(self._text)
            return self._take_sendable(hold_back=self._max_stop_prefix())
        if self.stop and (found := self._find_stop()) is not None:
            self._cut_at(*found)
            return ""
        return self._take_sendable(hold_back=self._max_stop_prefix())

    def finish(self) -> str:
        """All text not yet returned (call once, when the sequence ends)."""
        if not self.stopped:
            # Flush bytes the incremental decoder held back (e.g. an unfinished character).
            tail = self.tokenizer.decode(self._token_ids[self._prefix_offset :], skip_special_tokens=True)
            prefix = self.tokenizer.decode(
                self._token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
            )
            if len(tail) > len(prefix):
                self._text += tail[len(prefix) :]
                self._read_offset = len(self._token_ids)
                self._prefix_offset = self._read_offset
            if self.stop and (found := self._find_stop()) is not None:
                self._cut_at(*found)
        return self._take_sendable(hold_back=0)

    @property
    def text(self) -> str:
        return self._text

    def _decode_new_text(self) -> str:
        prefix = self.tokenizer.decode(
            self._token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = self.tokenizer.decode(self._token_ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            return full[len(prefix) :]
        return ""

    def _max_stop_prefix(self) -> int:
        return max((len(s) for s in self.stop), default=1) - 1

    def _find_stop(self) -> tuple[int, str] | None:
        """Where the first stop string in the text starts, and which it is."""
        # Only the unsent tail plus one stop length can hold a new match.
        window_start = max(0, self._num_emitted_chars - self._max_stop_prefix())
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self._text.find(stop, max(window_start, self._stop_floor - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _cut_at(self, index: int, stop: str) -> None:
        self._text = self._text[:index]
        self.stopped = True
        self.stopped_by = stop

    def _take_sendable(self, hold_back: int) -> str:
        end = max(self._num_emitted_chars, len(self._text) - hold_back)
        chunk = self._text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return chunk
