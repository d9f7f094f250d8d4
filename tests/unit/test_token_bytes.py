"""How log probabilities name tokens (services/worker/token_bytes.py): a byte-level token by
its own bytes (part of a character, maybe), any other by its text's UTF-8."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from shoal.services.worker.generation import TokenLogprobs
from shoal.services.worker.token_bytes import TokenBytes
from shoal.shared.messages import TokenLogprob
from tests.token_echo import TokenEcho


def test_byte_level_tokens_are_their_own_bytes(demo_models_root: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / "demo" / "llama-5m")
    token_bytes = TokenBytes(tokenizer)
    text = " hello café ☃"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [token_bytes.get(token_id) for token_id in ids]
    assert b"".join(pieces) == text.encode()
    assert pieces[0] == b" hello"
    assert any(len(piece) == 1 and piece[0] >= 0x80 for piece in pieces), "a token holding part of a character"
    eos = tokenizer.eos_token_id
    assert token_bytes.get(eos) == tokenizer.decode([eos]).encode()  # an added token: its text


def test_other_tokenizers_give_their_texts_utf8() -> None:
    token_bytes = TokenBytes(TokenEcho())
    assert token_bytes.get(17) == b"<17>"
    wire = token_bytes.to_wire((TokenLogprobs(17, -0.5, ((3, -0.25), (17, -0.5))),))
    assert wire == [TokenLogprob(b"<17>", -0.5, [(b"<3>", -0.25), (b"<17>", -0.5)])]
    assert token_bytes.to_wire(()) is None
