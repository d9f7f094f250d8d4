"""A detokenizer for exactness tests: the engine's text output is then its token ids."""

from __future__ import annotations

from collections.abc import Sequence


class TokenEcho:
    """A detokenizer whose text is the token ids themselves: ``<17><4093>...``."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{token_id}>" for token_id in token_ids)


def echo(token_ids: Sequence[int]) -> str:
    """The text `TokenEcho` makes of `token_ids`."""
    return TokenEcho().decode(token_ids)
