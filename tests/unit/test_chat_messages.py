"""A chat request's messages as the worker templates them (services/gateway/openai_api.py
`chat_messages`): content parts read as text, or refused naming the message."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import ChatCompletionRequest, chat_messages, decode_body


def _messages(*messages: dict[str, Any]) -> list[tuple[str, str]]:
    body = {"model": "m", "messages": list(messages)}
    request = decode_body(msgspec.json.encode(body), ChatCompletionRequest)
    assert isinstance(request, ChatCompletionRequest)
    return [(message.role, message.content) for message in chat_messages(request, 10_000)]


def test_text_parts_and_an_assistants_refusal_parts_are_its_text() -> None:
    """OpenAI's answers carry a refusal as a part of their own; a client replays it as it came."""
    assert _messages(
        {"role": "user", "content": [{"type": "text", "text": "Open "}, {"type": "text", "text": "the door."}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Sorry: "}, {"type": "refusal", "refusal": "no."}]},
    ) == [("user", "Open the door."), ("assistant", "I can't."), ("assistant", "Sorry: no.")]


@pytest.mark.parametrize(("message", "said"), [
    ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}, "refusal parts belong to assistant"),
    ({"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "no"}]},
     "not to the system's"),
    ({"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "only text parts are supported"),
])
def test_other_parts_and_a_refusal_outside_an_assistants_message_are_400(message: dict[str, Any], said: str) -> None:
    with pytest.raises(BadRequest) as raised:
        _messages({"role": "user", "content": "hi"}, message)
    assert raised.value.param == "messages" and said in raised.value.message
    assert raised.value.message.startswith("messages[1].content")
