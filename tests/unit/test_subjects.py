from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.shared import subjects
from shoal.shared.subjects import InvalidModelKey, InvalidModelToken, model_key_from_token, model_token

KV_KEY_CHARS = set("-/_=.abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")

model_keys = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zs", "Zl", "Zp"), blacklist_characters="\x85\xa0"),
    min_size=1,
    max_size=80,
).filter(lambda k: all(c.isprintable() and not c.isspace() for c in k))


@settings(max_examples=300, deadline=None)
@given(model_keys)
def test_model_token_round_trips_any_model_key(key: str) -> None:
    token = model_token(key)
    assert model_key_from_token(token) == key
    assert set(token) <= KV_KEY_CHARS - {".", "/"}, "a token must be one subject token and a KV key part"


def test_readable_tokens_for_typical_keys() -> None:
    assert model_token("meta-llama/Llama-3.1-8B") == "meta-llama=2FLlama-3=2E1-8B"
    assert model_token("demo/llama-5m") == "demo=2Fllama-5m"
    assert subjects.infer_subject("demo/llama-5m") == "shoal.infer.demo=2Fllama-5m"


@pytest.mark.parametrize("bad", ["", "a b", "tab\there", "x" * 300, "nl\n"])
def test_invalid_model_keys_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidModelKey):
        model_token(bad)


@pytest.mark.parametrize("bad", ["", "a.b", "=2", "=zz", "a=2f", "a*b", "=FF"])
def test_strings_no_key_maps_to_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidModelToken):
        model_key_from_token(bad)


def test_replica_naming_contract() -> None:
    assert subjects.replica_name("org/m", "ab12") == "ModelActor:org/m:ab12"
    assert subjects.replica_kv_key("org/m", "ab12") == "org=2Fm.ab12"


def test_keys_whose_token_overflows_a_consumer_name_are_rejected() -> None:
    # 60 CJK characters are 180 UTF-8 bytes: a 544-character token, a 550-character consumer name.
    with pytest.raises(InvalidModelKey, match="consumer name"):
        model_token("org/" + "日" * 60)
    with pytest.raises(InvalidModelKey, match="consumer name"):
        subjects.validate_model_key("a" * (subjects.MAX_MODEL_TOKEN_CHARS + 1))
    fits = "a" * subjects.MAX_MODEL_TOKEN_CHARS
    assert len(subjects.consumer_name(fits)) == subjects.MAX_CONSUMER_NAME_CHARS
    assert len(subjects.consumer_name("日" * (subjects.MAX_MODEL_TOKEN_CHARS // 9))) <= subjects.MAX_CONSUMER_NAME_CHARS


def test_an_overlong_token_is_not_a_model_token() -> None:
    with pytest.raises(InvalidModelToken):
        model_key_from_token("a" * (subjects.MAX_MODEL_TOKEN_CHARS + 1))
