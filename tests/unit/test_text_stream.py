"""TextStream: incremental detokenization and OpenAI stop strings, on a real byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from shoal.services.worker.generation import TextStream

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, ça va? naïve café",
    "世界你好 こんにちは 안녕하세요",
    "emoji 🙂🚀 and symbols ∑ ≤ ≥ — end",
    "STOP stop ### \n\n newline tokens",
]
ALPHABET = "abc xyz#\né世🙂"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 3, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eos|>")


def _stream(
    tokenizer: PreTrainedTokenizerFast, token_ids: list[int], stop: list[str]
) -> tuple[list[str], str, bool]:
    """(chunks pushed out, full text, stopped) of streaming `token_ids` one at a time."""
    text = TextStream(tokenizer, stop)
    chunks = []
    for token_id in token_ids:
        chunks.append(text.push(token_id))
        if text.stopped:
            break
    chunks.append(text.finish())
    return chunks, "".join(chunks), text.stopped


def _expected(tokenizer: PreTrainedTokenizerFast, token_ids: list[int], stop: list[str]) -> tuple[str, bool]:
    """Reference: decode every prefix in full; stop at the first prefix containing a stop string."""
    for end in range(1, len(token_ids) + 1):
        decoded = str(tokenizer.decode(token_ids[:end], skip_special_tokens=True)).rstrip("\ufffd")
        found = [decoded.find(s) for s in stop if s and s in decoded]
        if found:
            return decoded[: min(found)], True
    return str(tokenizer.decode(token_ids, skip_special_tokens=True)), False


def test_multibyte_characters_are_never_split(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = tokenizer("naïve 世界 🙂🚀 done").input_ids
    chunks, text, stopped = _stream(tokenizer, token_ids, [])
    assert text == "naïve 世界 🙂🚀 done"
    assert not stopped
    assert all("\ufffd" not in chunk for chunk in chunks)


def test_the_stop_string_and_what_follows_are_not_returned(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = tokenizer("the quick brown fox jumps").input_ids
    _, text, stopped = _stream(tokenizer, token_ids, ["fox"])
    assert (text, stopped) == ("the quick brown ", True)


def test_the_stop_string_met_first_in_the_text_is_named(tokenizer: PreTrainedTokenizerFast) -> None:
    """vLLM's ``stop_reason`` (and Anthropic's ``stop_sequence``): the string that ended the
    text, the one that starts first when several are in it; None when none did."""
    token_ids = tokenizer("the quick brown fox jumps over the lazy dog").input_ids
    stream = TextStream(tokenizer, ["lazy", "jumps", "brown fox"])
    for token_id in token_ids:
        stream.push(token_id)
        if stream.stopped:
            break
    assert (stream.text, stream.stopped_by) == ("the quick ", "brown fox")
    unstopped = TextStream(tokenizer, ["zzz"])
    for token_id in token_ids:
        unstopped.push(token_id)
    unstopped.finish()
    assert unstopped.stopped_by is None


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer: PreTrainedTokenizerFast) -> None:
    stream = TextStream(tokenizer, ["brown fox"])
    sent = "".join(stream.push(token_id) for token_id in tokenizer("the quick brown").input_ids)
    assert not stream.stopped
    assert "the quick brown".startswith(sent)
    assert len(sent) <= len("the quick brown") - len("brown")
    assert sent + stream.finish() == "the quick brown"


def test_stop_strings_are_looked_for_from_min_tokens_on(tokenizer: PreTrainedTokenizerFast) -> None:
    """vLLM's min_tokens: a stop string ends the text only once that many tokens are pushed."""
    token_ids = tokenizer("the fox and the fox").input_ids
    first_fox_ends = next(n for n in range(1, len(token_ids) + 1) if "fox" in tokenizer.decode(token_ids[:n]))
    later = TextStream(tokenizer, ["fox"], min_tokens=first_fox_ends + 1)
    text = "".join(later.push(token_id) for token_id in token_ids if not later.stopped)
    assert (text + later.finish(), later.stopped) == ("the fox and the ", True)
    at_once = TextStream(tokenizer, ["fox"], min_tokens=first_fox_ends)
    text = "".join(at_once.push(token_id) for token_id in token_ids if not at_once.stopped)
    assert (text + at_once.finish(), at_once.stopped) == ("the ", True)


def test_special_tokens_are_skipped(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = [*tokenizer("hello").input_ids, tokenizer.eos_token_id]
    assert _stream(tokenizer, token_ids, [])[1] == "hello"


def test_an_empty_stop_string_is_ignored(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = tokenizer("the lazy dog").input_ids
    assert _stream(tokenizer, token_ids, ["", "zzz"])[1:] == ("the lazy dog", False)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
    data=st.data(),
)
def test_streamed_text_equals_the_full_decode_cut_at_the_first_stop(
    tokenizer: PreTrainedTokenizerFast, text: str, stop: list[str], data: st.DataObject
) -> None:
    token_ids = tokenizer(text).input_ids
    # Drop a tail of tokens: with byte-level BPE the rest may end inside a character.
    token_ids = token_ids[: data.draw(st.integers(0, len(token_ids)))]
    chunks, streamed, stopped = _stream(tokenizer, token_ids, stop)
    expected, expected_stopped = _expected(tokenizer, token_ids, stop)
    assert (streamed, stopped) == (expected, expected_stopped)
    if "\ufffd" not in expected:
        assert all("\ufffd" not in chunk for chunk in chunks)
