"""Fuzzing `shoal up`: Schemathesis from the gateway's own /openapi.json, then property tests
(hypothesis) for the edges a reviewer found. One `shoal up` serves the whole module.

Schemathesis: every operation of the document gets generated requests, valid and invalid (bounded: a few
dozen each, so CI spends seconds here). What must hold for each: never a 5xx (a 503 or 504
would be the cluster's state, not a bug, and none may happen with a model that loads), every
4xx an OpenAI error body, statuses and content types the document declares, bodies that
match its schemas. A third of the generated inference requests name a served model (with few
tokens to generate), so generation itself is fuzzed, not only the validation in front of it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from shoal.services.gateway.openai_api import UNSUPPORTED_FIELDS
from shoal.services.gateway.openapi import get_document
from shoal.services.gateway.responses_api import UNSERVED_FIELDS
from tests.e2e.conftest import ShoalUp

MODEL = "demo/llama-5m"
MAX_TOKENS = 4
MAX_EXAMPLES = 30
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions")
RESPONSES_PATH = "/v1/responses"
TOKENIZE_PATHS = ("/tokenize", "/detokenize")
EMBEDDINGS_PATHS = ("/v1/embeddings", "/v1/rerank", "/v2/rerank", "/v1/score")
OLLAMA_PREFIX = "/api/"
OLLAMA_GENERATING_PATHS = ("/api/chat", "/api/generate")
ANTHROPIC_PREFIX = "/v1/messages"

schema = schemathesis.openapi.from_dict(json.loads(get_document()))


def openai_error_body(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:
    """Every 4xx is ``{"error": {"message", "type", ...}}`` (what OpenAI clients parse); under
    Ollama's ``/api/``, ``{"error": "<message>"}`` (what Ollama's clients parse); under
    Anthropic's ``/v1/messages``, ``{"type": "error", "error": {"type", "message"}, "request_id"}``."""
    if 400 <= response.status_code < 500:
        body = response.json()
        if case.path.startswith(ANTHROPIC_PREFIX):
            assert isinstance(body, dict) and body.get("type") == "error", body
            assert {"type", "error"} <= set(body) <= {"type", "error", "request_id"}, body  # as Anthropic's API
            assert body["error"]["type"] and body["error"]["message"], body
            return None
        assert isinstance(body, dict) and set(body) == {"error"}, body
        error = body["error"]
        if case.path.startswith(OLLAMA_PREFIX):
            assert isinstance(error, str) and error, body
            return None
        assert isinstance(error.get("message"), str) and error["message"], body
        assert isinstance(error.get("type"), str) and error["type"], body
    return None


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          openai_error_body]


def _aim_at_a_served_model(case: schemathesis.Case) -> None:
    """A deterministic third of the inference bodies name a served model and ask for few tokens."""
    if not (case.path in (*INFERENCE_PATHS, RESPONSES_PATH, *TOKENIZE_PATHS, *EMBEDDINGS_PATHS)
            or case.path.startswith((OLLAMA_PREFIX, ANTHROPIC_PREFIX))) or not isinstance(case.body, dict):
        return
    digest = hashlib.sha256(json.dumps(case.body, sort_keys=True, default=str).encode()).digest()
    if digest[0] % 3 == 0:
        case.body["model"] = MODEL
        if case.path.startswith(OLLAMA_PREFIX):
            case.body.pop("keep_alive", None)  # 0 would put the module's model to sleep between cases
            if case.path in OLLAMA_GENERATING_PATHS:
                options = case.body.get("options")
                case.body["options"] = {**(options if isinstance(options, dict) else {}), "num_predict": MAX_TOKENS}
            return
        if case.path.startswith(ANTHROPIC_PREFIX):
            if "max_tokens" in case.body:
                case.body["max_tokens"] = MAX_TOKENS
            return
        for field in (*UNSUPPORTED_FIELDS, *UNSERVED_FIELDS):  # accepted at their defaults only: a 400 says so
            case.body.pop(field, None)
        if case.path == RESPONSES_PATH:
            case.body["max_output_tokens"] = MAX_TOKENS
            return
        for field in ("max_tokens", "max_completion_tokens"):
            if field in case.body or field == "max_tokens":
                case.body[field] = MAX_TOKENS


@pytest.fixture(scope="module")
def http() -> requests.Session:
    return requests.Session()


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_the_gateway_survives_fuzzing(case: schemathesis.Case, shoal: ShoalUp, http: requests.Session) -> None:
    _aim_at_a_served_model(case)
    response = case.call(base_url=shoal.base_url, session=http, timeout=180)
    case.validate_response(response, checks=CHECKS)


def test_the_document_is_served_and_describes_the_request_types(shoal: ShoalUp) -> None:
    document = requests.get(shoal.base_url + "/openapi.json", timeout=10).json()
    assert document["openapi"] == "3.1.0"
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat["required"])
    temperature = chat["properties"]["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0.0, 2.0)
    assert "413" in document["paths"]["/v1/completions"]["post"]["responses"]


# --------------------------------------------------------------------------- property tests

VOCAB_SIZE = 4096
"""The demo models' vocabulary and embedding rows."""
PROPERTY_SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                             suppress_health_check=list(HealthCheck))


def _post(shoal: ShoalUp, path: str, body: dict[str, Any], timeout: float = 180) -> requests.Response:
    return requests.post(shoal.base_url + path, json=body, timeout=timeout)


def _assert_openai_error(response: requests.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error


@PROPERTY_SETTINGS
@given(valid=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=8),
       bad=st.integers(VOCAB_SIZE, 2**31 - 1), where=st.integers(0, 8))
def test_token_ids_past_the_embedding_are_a_400_naming_the_prompt(shoal: ShoalUp, valid: list[int], bad: int,
                                                                   where: int) -> None:
    ids = [*valid[:where], bad, *valid[where:]]
    response = _post(shoal, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2})
    _assert_openai_error(response, 400, "prompt")
    assert "vocabulary" in response.json()["error"]["message"]
    ok = _post(shoal, "/v1/completions", {"model": MODEL, "prompt": valid, "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == len(valid)


@PROPERTY_SETTINGS
@given(temperature=st.floats(min_value=0.0, max_value=1e-5, exclude_max=True, allow_subnormal=True),
       path=st.sampled_from(INFERENCE_PATHS))
def test_a_temperature_that_underflows_float32_samples_greedily(shoal: ShoalUp, temperature: float,
                                                                path: str) -> None:
    prompt: dict[str, Any] = ({"prompt": "The quick brown fox"} if path == "/v1/completions"
                              else {"messages": [{"role": "user", "content": "The quick brown fox"}]})
    tiny = _post(shoal, path, {"model": MODEL, **prompt, "max_tokens": 6, "temperature": temperature})
    greedy = _post(shoal, path, {"model": MODEL, **prompt, "max_tokens": 6, "temperature": 0})
    assert tiny.status_code == greedy.status_code == 200, tiny.text[:300]
    texts = [r.json()["choices"][0].get("text", r.json()["choices"][0].get("message", {}).get("content"))
             for r in (tiny, greedy)]
    assert texts[0] == texts[1], "the same text as temperature 0"


MAX_BODY_BYTES = 4 * 2**20
MAX_PROMPT_CHARS = 1_000_000


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(num_bytes=st.integers(int(0.9 * 2**20), 4 * 2**20), wide=st.booleans(), path=st.sampled_from(INFERENCE_PATHS))
def test_prompts_of_megabytes_get_a_clear_4xx_and_the_gateway_keeps_serving(shoal: ShoalUp, num_bytes: int,
                                                                            wide: bool, path: str) -> None:
    """0.9 to 4 MiB of prompt: 413 beyond the body limit, else a 400 naming the prompt (over
    `max_prompt_chars`, or the model's context: ``context_length_exceeded`` either way); while it is handled, a small request is
    answered (tokenising it runs off the worker's event loop)."""
    unit = "é" if wide else "e"  # 2 bytes or 1 per character
    text = (unit + " ") * (num_bytes // (len(unit.encode()) + 1))
    prompt: dict[str, Any] = ({"prompt": text} if path == "/v1/completions"
                              else {"messages": [{"role": "user", "content": text}]})
    small: list[requests.Response] = []
    beside = threading.Thread(target=lambda: small.append(_post(
        shoal, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})))
    beside.start()
    response = _post(shoal, path, {"model": MODEL, **prompt, "max_tokens": 2})
    beside.join()
    body_bytes = len(json.dumps({"model": MODEL, **prompt, "max_tokens": 2}).encode())
    if body_bytes > MAX_BODY_BYTES:
        assert response.status_code == 413, response.text[:300]
    else:
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"]["code"] == "context_length_exceeded"
    _assert_openai_error(response, response.status_code)
    assert response.json()["error"]["param"] in ("prompt", "messages", None)
    assert small[0].status_code == 200


NAME_PARTS = st.sampled_from(["../", "..", "/", "demo/", "llama-5m", "\x00", "\n", "\x1b[31m", "%2e%2e/", "\u202e",
                              " ", "\t"])


@PROPERTY_SETTINGS
@given(name=st.lists(st.one_of(NAME_PARTS, st.text(max_size=4)), min_size=1, max_size=6).map("".join))
def test_model_names_with_dot_dot_and_control_characters_are_refused_cleanly(shoal: ShoalUp, name: str) -> None:
    if name == MODEL:
        return
    response = _post(shoal, "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code in (400, 404), response.text[:300]
    _assert_openai_error(response, response.status_code)
    listed = requests.get(shoal.base_url + "/v1/models/" + requests.utils.quote(name, safe=""), timeout=30)
    assert listed.status_code in (400, 404), listed.text[:300]
    registered = requests.post(shoal.base_url + "/admin/models", json={"key": name, "path": name}, timeout=60)
    _assert_openai_error(registered, 400)
    names = {card["id"] for card in requests.get(shoal.base_url + "/v1/models", timeout=30).json()["data"]}
    assert name not in names
