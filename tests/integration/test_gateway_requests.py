"""What the gateway does with a request before any model runs, on a real socket and a real
nats-server: bounds and OpenAI's nullable fields, request ids on every response and log line,
every request counted, auth header spelling, the admin API's checks, the open-admin warning."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
from aiohttp import web
from structlog.testing import capture_logs

from shoal.services.gateway.app import create_app
from shoal.shared import subjects
from shoal.shared.bus import Bus
from shoal.shared.config import ConfigError, GatewayConfig
from shoal.shared.messages import ModelSpec
from shoal.shared.nats_server import EmbeddedNatsServer
from shoal.shared.version import SHOAL_VERSION
from tests.integration.gateway_harness import call, gateway_running, metric_value

MODEL = "org/m"
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "hi"}
RESPONSES: dict[str, Any] = {"model": MODEL, "input": "hi"}
ROUTES = {"chat": (CHAT, "/v1/chat/completions"), "completion": (COMPLETION, "/v1/completions"),
          "responses": (RESPONSES, "/v1/responses")}
REQUEST_ID = re.compile(r"[0-9a-f]{32}")
TOOL: dict[str, Any] = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL: dict[str, Any] = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture
async def gateway(bus: Bus, nats_server: EmbeddedNatsServer) -> AsyncIterator[str]:
    """Open (no keys) and with no scheduler: a valid request gets as far as placement (503)."""
    await bus.models.put(subjects.model_token(MODEL), ModelSpec(key=MODEL, path="m", registered_at=1.0))
    async with gateway_running(nats_server.url, request_timeout_s=5.0) as url:
        yield url


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("chat", {"max_tokens": 100000000000000000000}, "max_tokens"),
        ("chat", {"max_tokens": 2**31}, "max_tokens"),
        ("chat", {"max_tokens": 0}, "max_tokens"),
        ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("chat", {"max_completion_tokens": 10**30}, "max_completion_tokens"),
        ("chat", {"seed": 2**63}, "seed"),
        ("completion", {"seed": -(2**63) - 1}, "seed"),
        ("chat", {"n": 0}, "n"),
        ("chat", {"n": 129}, "n"),
        ("completion", {"prompt": ["a", "b", "c"], "n": 43}, "n"),
        ("completion", {"prompt": ["a"] * 129}, "prompt"),
        ("completion", {"prompt": ["a", ""]}, "prompt"),
        ("completion", {"prompt": [[1, 2], []]}, "prompt"),
        ("completion", {"prompt": [["a"]]}, "prompt"),
        ("completion", {"prompt": ["a", "b"], "session_id": "s1"}, "session_id"),
        ("completion", {"n": 10**20}, "n"),
        ("chat", {"temperature": -0.1}, "temperature"),
        ("chat", {"temperature": 2.5}, "temperature"),
        ("completion", {"top_p": 0}, "top_p"),
        ("completion", {"top_p": 1.01}, "top_p"),
        ("chat", {"frequency_penalty": 3}, "frequency_penalty"),
        ("completion", {"presence_penalty": -2.5}, "presence_penalty"),
        ("chat", {"top_k": -2}, "top_k"),
        ("completion", {"min_p": 1.5}, "min_p"),
        ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
        ("chat", {"logit_bias": {"abc": 10}}, "logit_bias"),
        ("chat", {"logit_bias": {"-1": 10}}, "logit_bias"),
        ("completion", {"logit_bias": {"99999999999": 10}}, "logit_bias"),
        ("completion", {"logit_bias": {"42": 100.5}}, "logit_bias"),
        ("chat", {"logit_bias": {"42": "up"}}, "logit_bias"),
        ("chat", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ("chat", {"logprobs": "yes"}, "logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("completion", {"logprobs": 21}, "logprobs"),
        ("completion", {"logprobs": -1}, "logprobs"),
        ("chat", {"tools": [{"type": "code_interpreter"}]}, "tools"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f" * 129}}]}, "tools"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
        ("chat", {"tools": [TOOL] * 2}, "tools"),
        ("chat", {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(1025)]}, "tools"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ("chat", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ("chat", {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ("chat", {"functions": [{"name": "f"}]}, "functions"),
        ("chat", {"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]}, "messages"),
        ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}]},
         "messages"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, "messages"),
        ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
        ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format"),
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("completion", {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ("completion", {"prompt": [5, 100000000000000000000]}, "prompt"),
        ("completion", {"prompt": [-1]}, "prompt"),
        ("completion", {"best_of": 2}, "best_of"),
        ("completion", {"suffix": "end"}, "suffix"),
        ("completion", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("chat", {"user": 7}, "user"),
        ("chat", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ("chat", {"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
        ("chat", {"chat_template_kwargs": {f"k{i}": 1 for i in range(33)}}, "chat_template_kwargs"),
        ("responses", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ("responses", {"input": ""}, "input"),
        ("responses", {"input": []}, "input"),
        ("responses", {"max_output_tokens": 0}, "max_output_tokens"),
        ("responses", {"temperature": 3}, "temperature"),
        ("responses", {"top_logprobs": 21}, "top_logprobs"),
        ("responses", {"truncation": "auto"}, "truncation"),
        ("responses", {"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ("responses", {"input": [{"type": "item_reference"}]}, "input"),
        ("responses", {"tools": [{"type": "file_search"}]}, "tools"),
        ("responses", {"tool_choice": "required"}, "tool_choice"),
        ("responses", {"text": {"format": {"type": "yaml"}}}, "text"),
    ],
)
async def test_out_of_range_and_unsupported_fields_are_400_naming_the_field(
    gateway: str, route: str, fields: dict[str, Any], param: str
) -> None:
    base, path = ROUTES[route]
    status, body, headers = await call("POST", gateway + path, json=base | fields)
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert REQUEST_ID.fullmatch(headers["X-Request-Id"])


@pytest.mark.parametrize("response_id", ["resp_unknown", "x.y", "resp_" + "a" * 200, "resp_a%2E%3E"])
async def test_a_response_that_is_not_stored_is_404_however_it_is_named(gateway: str, response_id: str) -> None:
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items")):
        status, body, _ = await call(method, f"{gateway}/v1/responses/{response_id}{path}")
        assert status == 404 and body["error"]["type"] == "not_found_error", body
    status, body, _ = await call("POST", gateway + "/v1/responses", json=RESPONSES | {
        "previous_response_id": response_id})
    assert status == 404 and body["error"]["param"] == "previous_response_id", body
    status, body, _ = await call("POST", gateway + "/v1/responses", json=RESPONSES | {
        "input": [{"type": "item_reference", "id": response_id.replace("resp_", "msg_")}]})
    assert status == 404 and body["error"]["param"] == "input", body


async def test_a_number_beyond_float_range_is_400_naming_the_field(gateway: str) -> None:
    raw = b'{"model": "org/m", "messages": [{"role": "user", "content": "hi"}], "top_p": 1e400}'
    status, body, _ = await call("POST", gateway + "/v1/chat/completions", data=raw)
    assert status == 400 and body["error"]["param"] == "top_p", body


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT | {
            "n": None, "stream": None, "stop": None, "seed": None, "temperature": None, "top_p": None,
            "max_tokens": None, "max_completion_tokens": None, "user": None, "stream_options": None,
            "logprobs": None, "top_logprobs": None, "frequency_penalty": None, "presence_penalty": None,
            "logit_bias": None, "tools": None, "tool_choice": None, "response_format": None, "ignore_eos": None,
        }),
        ("/v1/chat/completions", CHAT | {
            "n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False,
            "top_logprobs": 0, "tool_choice": "none", "tools": [], "modalities": ["text"],
            "response_format": {"type": "text"}, "seed": -(2**63), "max_completion_tokens": 2**31 - 1,
        }),
        ("/v1/completions", COMPLETION | {
            "n": None, "stream": None, "stop": None, "seed": None, "best_of": None, "echo": None, "suffix": None,
            "logprobs": None, "max_tokens": None, "stream_options": None, "user": None,
        }),
        ("/v1/completions", COMPLETION | {"best_of": 1, "echo": False, "suffix": "", "seed": 2**63 - 1,
                                          "stream": True, "stream_options": {"include_usage": None}}),
        ("/v1/completions", COMPLETION | {"prompt": ["a", "b"], "n": 64, "seed": 2**63 - 1, "logprobs": 20}),
        ("/v1/completions", COMPLETION | {"echo": True, "logprobs": 1, "max_tokens": 1}),
        ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 20}),
        ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_object"}}),
        ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object"}, "strict": True}}}),
        ("/v1/chat/completions", CHAT | {"n": 128, "stream": True, "logit_bias": {"0": -100, "2147483647": 100}}),
        ("/v1/chat/completions", CHAT | {"tools": [TOOL, {"type": "function", "function": {
            "name": "g.h-1", "description": None, "parameters": None, "strict": True}}], "parallel_tool_calls": False}),
        ("/v1/chat/completions", CHAT | {"tools": [TOOL], "tool_choice": "required"}),
        ("/v1/chat/completions", CHAT | {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}},
                                         "parallel_tool_calls": None}),
        ("/v1/chat/completions", CHAT | {"tools": [TOOL], "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}]}),
        ("/v1/chat/completions", CHAT | {"messages": [  # a refusal replayed as OpenAI answered it
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {"role": "user", "content": "why?"}]}),
        ("/v1/responses", RESPONSES | {
            "instructions": None, "max_output_tokens": None, "temperature": None, "top_p": None, "stream": None,
            "tools": None, "tool_choice": None, "parallel_tool_calls": None, "text": None, "include": None,
            "top_logprobs": None, "store": None, "metadata": None, "user": None, "truncation": None,
            "previous_response_id": None, "conversation": None, "background": None, "reasoning": None}),
        ("/v1/responses", RESPONSES | {
            "input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f",
                                                          "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "42"}],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"}, "store": True, "truncation": "disabled",
            "include": ["message.output_text.logprobs"], "top_logprobs": 20, "metadata": {"k": "v"},
            "background": False, "stream": True}),
    ],
)
async def test_nulls_and_defaults_are_accepted_as_openai_allows(gateway: str, path: str, body: dict) -> None:
    status, payload, _ = await call("POST", gateway + path, json=body)
    assert status == 503, payload  # valid: it got as far as placement, and no scheduler runs here
    assert "scheduler" in payload["error"]["message"]


async def test_every_response_has_a_request_id_and_every_error_log_line_carries_it(gateway: str) -> None:
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        status, body, headers = await call("POST", gateway + "/v1/chat/completions", json=CHAT | {"n": 300})
    assert status == 400 and body["error"]["param"] == "n"
    request_id = headers["X-Request-Id"]
    assert REQUEST_ID.fullmatch(request_id)
    errors = [entry for entry in logs if entry["event"] == "request_error"]
    assert errors and all(entry["request_id"] == request_id for entry in errors)
    assert errors[0]["model"] == MODEL
    (answered,) = [entry for entry in logs if entry["event"] == "request_answered"]  # the access log's line
    assert (answered["request_id"], answered["model"], answered["kind"], answered["outcome"]) == (
        request_id, MODEL, "chat", "400")
    assert answered["seconds"] >= 0
    for method, path in (("GET", "/v1/models"), ("GET", "/healthz"), ("GET", "/v1/nothing"),
                         ("POST", "/v1/completions")):
        _, _, headers = await call(method, gateway + path)
        assert REQUEST_ID.fullmatch(headers["X-Request-Id"]), path
    _, _, first = await call("GET", gateway + "/v1/models")
    _, _, second = await call("GET", gateway + "/v1/models")
    assert first["X-Request-Id"] != second["X-Request-Id"]


async def test_rejected_requests_are_counted(gateway: str) -> None:
    assert (await call("POST", gateway + "/v1/chat/completions", json=CHAT | {"temperature": 9}))[0] == 400
    assert (await call("POST", gateway + "/v1/completions", data=b"{not json"))[0] == 400
    assert (await call("POST", gateway + "/v1/completions", json=COMPLETION | {"model": "no/such"}))[0] == 404
    assert (await call("POST", gateway + "/v1/completions", json=COMPLETION))[0] == 503
    samples = {
        f'shoal_gateway_requests_total{{model="{MODEL}",kind="chat",outcome="400"}}': 1,
        'shoal_gateway_requests_total{model="",kind="completion",outcome="400"}': 1,
        'shoal_gateway_requests_total{model="",kind="completion",outcome="404"}': 1,
        f'shoal_gateway_requests_total{{model="{MODEL}",kind="completion",outcome="503"}}': 1,
    }
    for sample, value in samples.items():
        assert await metric_value(gateway, sample) == value, sample


async def test_health_alias_and_version(gateway: str) -> None:
    for path in ("/health", "/healthz"):
        status, body, _ = await call("GET", gateway + path)
        assert status == 200 and body == {"status": "ok"}
    status, body, _ = await call("GET", gateway + "/version")
    assert status == 200 and body == {"version": SHOAL_VERSION}


async def test_bearer_scheme_is_case_insensitive(bus: Bus, nats_server: EmbeddedNatsServer) -> None:
    async with gateway_running(nats_server.url, api_keys=["user-key"], admin_api_keys=["admin-key"]) as url:
        for scheme in ("Bearer", "bearer", "BEARER"):
            status, _, _ = await call("GET", url + "/v1/models", headers={"Authorization": f"{scheme} user-key"})
            assert status == 200, scheme
        status, _, _ = await call("GET", url + "/admin/cluster", headers={"Authorization": "bearer admin-key"})
        assert status == 200
        for header in ("Basic user-key", "Bearer", "bearer  wrong", "Bearer caf\u00e9"):
            status, body, _ = await call("GET", url + "/v1/models", headers={"Authorization": header})
            assert status == 401, (header, body)


async def test_admin_registration_checks_keys_paths_and_counts(gateway: str) -> None:
    cases = [
        ({"key": "org/" + "\u65e5" * 60, "path": "m"}, "consumer name"),
        ({"key": "org/x", "path": "/etc"}, "models root"),
        ({"key": "org/x", "path": "a/../../etc"}, "models root"),
        ({"key": "org/x", "path": "m", "min_replicas": 10**6}, "min_replicas"),
    ]
    for body, message in cases:
        status, payload, headers = await call("POST", gateway + "/admin/models", json=body)
        assert status == 400 and message in payload["error"]["message"], (body, payload)
        assert REQUEST_ID.fullmatch(headers["X-Request-Id"])
    status, payload, _ = await call("POST", gateway + f"/admin/models/{MODEL}/scale", json={"replicas": 10**20})
    assert status == 400 and payload["error"]["param"] == "replicas"


@pytest.mark.parametrize(
    ("config", "outcome"),
    [
        ({"host": "0.0.0.0"}, "refused"),
        ({"host": "::"}, "refused"),
        ({"host": "0.0.0.0", "insecure_open_admin": True}, "warned"),
        ({"host": "0.0.0.0", "admin_api_keys": ["k"]}, "quiet"),
        ({"host": "0.0.0.0", "api_keys": ["k"]}, "quiet"),  # admin routes are off then
        ({"host": "127.0.0.1"}, "quiet"),
        ({"host": "localhost"}, "quiet"),
    ],
)
async def test_an_admin_api_open_to_the_network_is_refused_unless_explicitly_allowed(
    nats_server: EmbeddedNatsServer, config: dict[str, Any], outcome: str
) -> None:
    if outcome == "refused":
        with pytest.raises(ConfigError, match="SHOAL_GATEWAY_ADMIN_API_KEYS") as excinfo:
            create_app(GatewayConfig(**config), nats_server.url)
        assert "insecure_open_admin" in str(excinfo.value)
        return
    runner = web.AppRunner(create_app(GatewayConfig(**config), nats_server.url))
    with capture_logs() as logs:
        await runner.setup()  # starts the app's resources; binds no socket
    await runner.cleanup()
    warnings = [entry for entry in logs if entry["event"] == "admin_api_open"]
    assert bool(warnings) == (outcome == "warned"), logs
    if warnings:
        assert "insecure_open_admin" in json.dumps(warnings[0])
