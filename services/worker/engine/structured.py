"""Structured output: a request's JSON schema (``response_format``) or regular expression
(vLLM's ``guided_regex`` and ``guided_choice``) as a token mask per step.

llguidance (the grammar engine vLLM and llama.cpp use) compiles the schema into a matcher
over the model's tokenizer; before each of the request's tokens the matcher says which tokens
may come next, the sampler masks the others out, and the chosen token moves the matcher on.
When the JSON is complete only end-of-sequence remains allowed, so the request stops there.

JSON is written compactly, with at most `MAX_WHITESPACE` whitespace characters between its
items: a grammar that allowed any amount would let a model pad without end (a known failure of
unbounded JSON grammars with small models). An object schema that lists its properties takes
no others unless it says so (json_schemas.py).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from shoal.services.worker.engine.json_schemas import closed_objects
from shoal.services.worker.generation import RequestRejected
from shoal.shared.messages import SamplingParams

MAX_WHITESPACE = 4
_JSON_OPTIONS: Any = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}"}
"""llguidance's JsonCompileOptions (a TypedDict of its stubs)."""


class Grammars:
    """Compiles requests' JSON schemas into matchers over one tokenizer (built on first use)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._llg_tokenizer: Any = None

    def _ll_tokenizer(self, param: str) -> Any:
        if self._llg_tokenizer is None:
            try:
                import llguidance.hf
            except ImportError as exc:  # an install without it: structured output is refused, not broken
                raise RequestRejected(f"structured output ({param}) needs the llguidance package",
                                      param=param) from exc
            try:
                self._llg_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer)
            except Exception as exc:  # a tokenizer llguidance cannot read
                raise RequestRejected(f"this model's tokenizer does not support structured output ({param}): "
                                      f"{exc}", param=param) from exc
        return self._llg_tokenizer

    def matcher(self, params: SamplingParams) -> TokenMatcher:
        """A fresh matcher for one request's grammar (its JSON schema or regular expression);
        a 400 naming the request field it came from when it cannot be compiled."""
        import llguidance

        param = params.grammar_param
        what = "the JSON schema" if params.json_schema is not None else "the regular expression"
        ll_tokenizer = self._ll_tokenizer(param)
        try:
            if params.json_schema is not None:
                schema = closed_objects(json.loads(params.json_schema))
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
            else:
                assert params.regex is not None, "a grammar is a schema or a regex"
                grammar = llguidance.LLMatcher.grammar_from_regex(params.regex)
        except Exception as exc:  # the grammar is the client's: any failure to compile it is its fault
            raise RequestRejected(f"{param}: {what} is not usable: {exc}", param=param) from exc
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        if matcher.is_error():
            raise RequestRejected(f"{param}: {what} is not usable: {matcher.get_error()}", param=param)
        return TokenMatcher(matcher, ll_tokenizer.vocab_size)


class TokenMatcher:
    """One request's grammar state: the tokens allowed next, and the move on a chosen token."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    @property
    def failed(self) -> bool:
        """A token the grammar did not allow was forced on it: nothing is constrained any more.
        (A complete grammar allows only end-of-sequence from then on.)"""
        return bool(self._matcher.is_error())

    def fill_bitmask(self, bitmask: np.ndarray) -> None:
        """Writes the tokens allowed next into `bitmask` (int32 words, bit i of word w: token
        32 w + i; C-contiguous)."""
        self._matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def advance(self, token_id: int) -> None:
        self._matcher.consume_token(token_id)


def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list[TokenMatcher]) -> None:
    """Sets, in place, row ``rows[i]`` of `logits` [num_rows, vocab] to -inf wherever
    ``matchers[i]`` does not allow the token next, columns past the tokenizer's vocabulary
    (padded embeddings) included. One unpack and one fill for all the rows: per row, only
    the matcher's own mask (~1 us)."""
    vocab_size = matchers[0].vocab_size
    bitmasks = np.empty((len(rows), (vocab_size + 31) // 32), dtype=np.int32)
    for i, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmasks[i])
    allowed = np.unpackbits(bitmasks.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    width = min(logits.shape[-1], vocab_size)
    blocked = torch.from_numpy(allowed[:, :width]).to(logits.device) == 0
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index)
    masked[:, :width].masked_fill_(blocked, float("-inf"))
    masked[:, width:] = float("-inf")
    logits.index_copy_(0, index, masked)
