"""What a request's log probabilities name each token by: its bytes, as OpenAI's ``logprobs``
report them (``bytes``; ``token`` is their UTF-8 text, with U+FFFD for a partial character).

A byte-level BPE token (GPT-2, Llama 3, Qwen: the tokenizer's decoder is ``ByteLevel``) is
its own bytes, which may hold part of a character; any other token, and an added (special)
token, is its decoded text's UTF-8. Cached per token id: a vocabulary is decoded at most once.
"""

from __future__ import annotations

import functools
from typing import Any

from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode

from shoal.services.worker.generation import TokenLogprobs
from shoal.shared.messages import TokenLogprob

_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


class TokenBytes:
    """Token id -> its bytes (see the module doc), and engine log probabilities -> the wire's."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = isinstance(decoder, decoders.ByteLevel)
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.get = functools.lru_cache(maxsize=1 << 17)(self._bytes_of)

    def _bytes_of(self, token_id: int) -> bytes:
        if self._byte_level and token_id not in self._added:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(char in _BYTE_OF_CHAR for char in piece):
                return bytes(_BYTE_OF_CHAR[char] for char in piece)
        return str(self._tokenizer.decode([token_id])).encode()

    def to_wire(self, logprobs: tuple[TokenLogprobs, ...]) -> list[TokenLogprob] | None:
        """An output's log probabilities as a chunk carries them; None when it has none."""
        if not logprobs:
            return None
        return [TokenLogprob(self.get(entry.token_id), entry.logprob,
                             [(self.get(token_id), logprob) for token_id, logprob in entry.top])
                for entry in logprobs]
