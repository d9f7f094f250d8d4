"""``GET /openapi.json``: the gateway's HTTP API as an OpenAPI 3.1 document.

Generated from the msgspec types the routes decode and encode (`msgspec.json.schema_components`),
so the document cannot drift from what the gateway accepts: the request bodies are the very
Structs `decode_body` validates against, with their bounds. Built once, on first use.
Schemathesis fuzzes the gateway with it (tests/integration/test_fuzz_http.py).
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from aiohttp import web

from shoal.services.gateway.anthropic_api import CountTokensRequest, MessageOut, MessagesRequest, TokenCount
from shoal.services.gateway.anthropic_batches import (
    DeletedMessageBatch,
    MessageBatch,
    MessageBatchCreate,
    MessageBatchList,
)
from shoal.services.gateway.batch_api import Batch, BatchCreate, BatchList, FileDeleted, FileList, FileObject
from shoal.services.gateway.embeddings_api import EmbeddingList, EmbeddingRequest
from shoal.services.gateway.errors import AnthropicError, ErrorEnvelope, OllamaError
from shoal.services.gateway.ollama_api import (
    ChatReply,
    ChatRequest,
    EmbeddingReply,
    EmbeddingsRequest,
    EmbedReply,
    EmbedRequest,
    GenerateReply,
    GenerateRequest,
)
from shoal.services.gateway.openai_api import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from shoal.services.gateway.rerank_api import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse
from shoal.services.gateway.responses_api import DeletedResponse, ResponseObject, ResponsesRequest
from shoal.services.gateway.responses_items import ItemList
from shoal.services.gateway.routes_admin import EvictBody, ScaleBody
from shoal.services.gateway.routes_ollama_models import PsReply, ShowReply, ShowRequest, TagsReply
from shoal.services.gateway.routes_tokenize import DetokenizeBody, DetokenizeResponse, TokenizeResponse
from shoal.shared.config import ModelConfig
from shoal.shared.messages import SchedulerReply
from shoal.shared.version import SHOAL_VERSION

OPENAPI_PATH = "/openapi.json"
_REF = "#/components/schemas/{name}"
_JSON = "application/json"


def _content(ref: dict[str, Any]) -> dict[str, Any]:
    return {_JSON: {"schema": ref}}


def _errors(refs: dict[str, dict[str, Any]], *statuses: int) -> dict[str, Any]:
    reasons = {400: "invalid request (the message names the field; `param` holds it)",
               401: "a key is needed and none or a wrong one was sent", 403: "this key may not use the route",
               404: "unknown model or route", 413: "the request is too large (its body, or as a queue message)",
               429: "the model's queue in this gateway is full (Retry-After)",
               503: "the model cannot be placed now, or NATS / the scheduler is unavailable (Retry-After)",
               504: "the request's deadline passed"}
    return {str(status): {"description": reasons[status], "content": _content(refs["ErrorEnvelope"])}
            for status in statuses}


def _sse_event(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event of a stream: a JSON chunk or error, or the final ``[DONE]``."""
    return {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string",
        "if": {"const": "[DONE]"},
        "then": True,
        "else": {"contentMediaType": _JSON, "contentSchema": {"anyOf": [chunk, error]}},
    }}}


_RESPONSES_EVENT = {"type": "object", "required": ["data"], "properties": {
    "event": {"type": "string"},
    "data": {"type": "string", "contentMediaType": _JSON,
             "contentSchema": {"type": "object", "required": ["type", "sequence_number"]}},
}}
"""One event of a streamed Responses answer (responses_stream.py lists them)."""


def _path_model() -> dict[str, Any]:
    return {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1},
            "description": "a model key, e.g. demo/llama-5m (slashes included)"}


@functools.cache
def get_document() -> bytes:
    """The OpenAPI document (JSON bytes)."""
    types = [ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk, Completion, ModelList,
             ModelCard, ErrorEnvelope, ModelConfig, ScaleBody, EvictBody, SchedulerReply, ResponsesRequest,
             ResponseObject, DeletedResponse, ItemList, EmbeddingRequest, EmbeddingList, TokenizeResponse, DetokenizeBody,
             DetokenizeResponse, RerankRequest, RerankResponse, ScoreRequest, ScoreResponse, *_OLLAMA_TYPES,
             *_ANTHROPIC_TYPES, *_BATCH_TYPES]
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    refs = {t.__name__: schema for t, schema in zip(types, schemas, strict=True)}
    inference_errors = _errors(refs, 400, 401, 404, 413, 429, 503, 504)
    admin_errors = _errors(refs, 400, 401, 403, 404, 503)

    def inference(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _content(refs[request])},
            "responses": {
                "200": {"description": f"a {response}, or with `\"stream\": true` server-sent events: {chunk}s, "
                                       "an error after the stream started, then `data: [DONE]`",
                        "content": {**_content(refs[response]),
                                    "text/event-stream": {"schema": _sse_event(refs[chunk], refs["ErrorEnvelope"])}}},
                **inference_errors,
            },
        }}

    def admin(method: str, summary: str, body: str | None = None) -> dict[str, Any]:
        operation: dict[str, Any] = {
            "summary": summary, "parameters": [_path_model()],
            "responses": {"200": {"description": "the scheduler's reply", "content": _content(refs["SchedulerReply"])},
                          **admin_errors},
        }
        if body is not None:
            operation["requestBody"] = {"required": True, "content": _content(refs[body])}
        return {method: operation}

    rerank = {"post": {
        "summary": "documents ranked against a query (vLLM's, Jina's and Cohere's rerank; also at /rerank): "
                   "a document's relevance_score is the cosine of its embedding and the query's",
        "requestBody": {"required": True, "content": _content(refs["RerankRequest"])},
        "responses": {"200": {"description": "the results, best first", "content": _content(refs["RerankResponse"])},
                      **inference_errors},
    }}
    paths: dict[str, Any] = {**_ollama_paths(refs), **_anthropic_paths(refs), **_batch_paths(refs), **{
        "/v1/models": {"get": {"summary": "every registered model",
                               "responses": {"200": {"description": "the models",
                                                     "content": _content(refs["ModelList"])},
                                             **_errors(refs, 401)}}},
        "/v1/models/{model}": {"get": {"summary": "one model", "parameters": [_path_model()],
                                       "responses": {"200": {"description": "the model",
                                                             "content": _content(refs["ModelCard"])},
                                                     **_errors(refs, 401, 404)}}},
        "/v1/chat/completions": inference("chat completion (the model's chat template)", "ChatCompletionRequest",
                                          "ChatCompletion", "ChatCompletionChunk"),
        "/v1/completions": inference("text completion of a prompt (text or token ids) or a batch of them", "CompletionRequest",
                                     "Completion", "Completion"),
        "/v1/responses": {"post": {
            "summary": "a response (OpenAI's Responses API: a chat request underneath; stored unless store is false)",
            "requestBody": {"required": True, "content": _content(refs["ResponsesRequest"])},
            "responses": {
                "200": {"description": "a response, or with `\"stream\": true` server-sent events, each "
                                       "named by its type: response.created ... response.completed (or "
                                       "response.incomplete, response.failed)",
                        "content": {**_content(refs["ResponseObject"]),
                                    "text/event-stream": {"schema": _RESPONSES_EVENT}}},
                **inference_errors,
            },
        }},
        "/v1/responses/{response_id}": {
            "parameters": [{"name": "response_id", "in": "path", "required": True,
                            "schema": {"type": "string", "minLength": 1}, "description": "a stored response's id"}],
            "get": {"summary": "a stored response (made with store, not yet expired)",
                    "responses": {"200": {"description": "the response", "content": _content(refs["ResponseObject"])},
                                  **_errors(refs, 401, 404)}},
            "delete": {"summary": "forget a stored response",
                       "responses": {"200": {"description": "deleted",
                                             "content": _content(refs["DeletedResponse"])},
                                     **_errors(refs, 401, 404)}},
        },
        "/v1/embeddings": {"post": {
            "summary": "embeddings: each input's last token's final hidden state, L2-normalized",
            "requestBody": {"required": True, "content": _content(refs["EmbeddingRequest"])},
            "responses": {"200": {"description": "the embeddings", "content": _content(refs["EmbeddingList"])},
                          **inference_errors},
        }},
        "/v1/rerank": rerank, "/v2/rerank": rerank,
        "/v1/score": {"post": {
            "summary": "scores of text pairs (vLLM's; also at /score): text_1 against each text_2, or pair by pair; "
                       "a score is the cosine of the two texts' embeddings",
            "requestBody": {"required": True, "content": _content(refs["ScoreRequest"])},
            "responses": {"200": {"description": "the scores", "content": _content(refs["ScoreResponse"])},
                          **inference_errors},
        }},
        "/v1/responses/{response_id}/input_items": {"get": {
            "summary": "a stored response's input items, a page at a time",
            "parameters": [
                {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
                {"name": "after", "in": "query", "schema": {"type": "string"},
                 "description": "an item id: the page starts after it"},
            ],
            "responses": {"200": {"description": "the items", "content": _content(refs["ItemList"])},
                          **_errors(refs, 400, 401, 404)},
        }},
        "/tokenize": {"post": {
            "summary": "a prompt's tokens, as generation would use them (vLLM's): a chat request's after its "
                       "template, or a completion's one prompt; `return_token_strs` adds each token's text",
            "requestBody": {"required": True, "content": {_JSON: {"schema": {
                "anyOf": [refs["ChatCompletionRequest"], refs["CompletionRequest"]]}}}},
            "responses": {"200": {"description": "the tokens", "content": _content(refs["TokenizeResponse"])},
                          **inference_errors},
        }},
        "/detokenize": {"post": {
            "summary": "token ids' text, by the model's tokenizer (vLLM's)",
            "requestBody": {"required": True, "content": _content(refs["DetokenizeBody"])},
            "responses": {"200": {"description": "the text", "content": _content(refs["DetokenizeResponse"])},
                          **_errors(refs, 400, 401, 404, 413, 503, 504)},
        }},
        "/admin/models": {"post": {"summary": "register (or update) a model",
                                   "requestBody": {"required": True, "content": _content(refs["ModelConfig"])},
                                   "responses": {"200": {"description": "the scheduler's reply",
                                                         "content": _content(refs["SchedulerReply"])},
                                                 **admin_errors}}},
        "/admin/models/{model}": admin("delete", "remove a model (its replicas stop)"),
        "/admin/models/{model}/scale": admin("post", "set the desired replica count", "ScaleBody"),
        "/admin/models/{model}/evict": admin("post", "evict every replica, or one", "EvictBody"),
        "/healthz": {"get": {"summary": "200 while the gateway's NATS connection is up",
                             "responses": {"200": {"description": "healthy"},
                                           "503": {"description": "NATS is disconnected"}}}},
        "/version": {"get": {"summary": "Shoal's version",
                             "responses": {"200": {"description": "the version", "content": {_JSON: {"schema": {
                                 "type": "object", "required": ["version"],
                                 "properties": {"version": {"type": "string"}}}}}}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (text format)",
                             "responses": {"200": {"description": "the exposition",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "Shoal gateway", "version": SHOAL_VERSION,
                 "description": "OpenAI-compatible API, Ollama's API (/api), Anthropic's Messages API "
                                "(/v1/messages) and Shoal's admin API (docs/api.md)."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "gateway.api_keys for /v1, gateway.admin_api_keys "
                                                          "for /admin (none needed when none are set)"}},
        },
        "security": [{}, {"bearer": []}],
    }
    return msgspec.json.encode(document)


_BATCH_TYPES = [FileObject, FileList, FileDeleted, BatchCreate, Batch, BatchList, MessageBatchCreate, MessageBatch,
                MessageBatchList, DeletedMessageBatch]


def _batch_paths(refs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's Files and Batch APIs (routes_batches.py)."""

    def answer(summary: str, schema: str, *statuses: int, **operation: Any) -> dict[str, Any]:
        return {"summary": summary, **operation,
                "responses": {"200": {"description": summary, "content": _content(refs[schema])},
                              **_errors(refs, 401, *statuses)}}

    def path_id(name: str) -> list[dict[str, Any]]:
        return [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}]

    page = [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
            {"name": "after", "in": "query", "schema": {"type": "string"}, "description": "the page starts after it"}]
    upload = {"multipart/form-data": {"schema": {
        "type": "object", "required": ["purpose", "file"],
        "properties": {"purpose": {"type": "string", "enum": ["batch"]}, "file": {"type": "string",
                                                                                  "format": "binary"}}}}}
    return {
        "/v1/files": {
            "post": answer("a file kept for the Batch API", "FileObject", 400, 413, 503,
                           requestBody={"required": True, "content": upload}),
            "get": answer("the files kept, newest first", "FileList", 400, parameters=[
                {"name": "purpose", "in": "query", "schema": {"type": "string"}},
                {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}}, *page]),
        },
        "/v1/files/{file_id}": {
            "get": answer("a file's record", "FileObject", 404, parameters=path_id("file_id")),
            "delete": answer("the file forgotten", "FileDeleted", 404, parameters=path_id("file_id")),
        },
        "/v1/files/{file_id}/content": {"get": {
            "summary": "a file's bytes", "parameters": path_id("file_id"),
            "responses": {"200": {"description": "the bytes", "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary"}}}}, **_errors(refs, 401, 404)}}},
        "/v1/batches": {
            "post": answer("a batch of an uploaded file's requests, run in the background", "Batch", 400, 404,
                           requestBody={"required": True, "content": _content(refs["BatchCreate"])}),
            "get": answer("the batches, newest first", "BatchList", 400, parameters=page),
        },
        "/v1/batches/{batch_id}": {"get": answer("a batch: its status, counts and files", "Batch", 404,
                                                 parameters=path_id("batch_id"))},
        "/v1/batches/{batch_id}/cancel": {"post": answer("the batch asked to stop", "Batch", 404,
                                                         parameters=path_id("batch_id"))},
    }


_OLLAMA_TYPES = [OllamaError, ChatRequest, ChatReply, GenerateRequest, GenerateReply, EmbedRequest, EmbedReply,
                 EmbeddingsRequest, EmbeddingReply, TagsReply, PsReply, ShowRequest, ShowReply]
_NDJSON = "application/x-ndjson"


def _ollama_paths(refs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ollama's routes (routes_ollama.py, routes_ollama_models.py); their errors are ``{"error": "..."}``."""
    reasons = {400: "invalid request (the message names the field)", 401: "a key is needed and none or a wrong "
               "one was sent", 403: "this key may not unload models", 404: "unknown model or route",
               413: "the request is too large (its body, or as a queue message)", 429: "the model's queue in this gateway is full",
               503: "the model cannot be placed now, or NATS / the scheduler is unavailable",
               504: "the request's deadline passed"}

    def errors(*statuses: int) -> dict[str, Any]:
        return {str(status): {"description": reasons[status], "content": _content(refs["OllamaError"])}
                for status in statuses}

    def post(summary: str, request: str, response: str, *, lines: bool = False) -> dict[str, Any]:
        content = _content(refs[response])
        if lines:  # streamed (the default): one reply per line, the last done, or an error line
            content[_NDJSON] = {"schema": {"type": "string"}}
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": _content(refs[request])},
                         "responses": {"200": {"description": f"a {response}" + (
                             ", or with `\"stream\": true` (the default) JSON lines of them" if lines else ""),
                             "content": content}, **errors(400, 401, 403, 404, 413, 429, 503, 504)}}}

    def get(summary: str, response: str) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": {"description": summary,
                                                                  "content": _content(refs[response])},
                                                          **errors(401)}}}

    return {
        "/api/chat": post("Ollama's chat (no messages: load the model; with keep_alive 0: unload it)",
                          "ChatRequest", "ChatReply", lines=True),
        "/api/generate": post("Ollama's generate (empty prompt: load the model; with keep_alive 0: unload it)",
                              "GenerateRequest", "GenerateReply", lines=True),
        "/api/embed": post("Ollama's embeddings of each input", "EmbedRequest", "EmbedReply"),
        "/api/embeddings": post("Ollama's older embedding of one prompt", "EmbeddingsRequest", "EmbeddingReply"),
        "/api/show": post("one model's details", "ShowRequest", "ShowReply"),
        "/api/tags": get("the served models", "TagsReply"),
        "/api/ps": get("the models with a replica on a GPU now", "PsReply"),
    }


_ANTHROPIC_TYPES = [AnthropicError, MessagesRequest, MessageOut, CountTokensRequest, TokenCount]
_ANTHROPIC_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string"},
    "data": {"type": "string", "contentMediaType": _JSON, "contentSchema": {"type": "object", "required": ["type"]}},
}}
"""One event of a streamed message (routes_anthropic.py lists them); its name is its data's ``type``."""


def _anthropic_paths(refs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Anthropic's routes (routes_anthropic.py); their errors are ``{"type": "error", "error": {...}}``."""
    reasons = {400: "invalid request (the message names the field), or a prompt longer than the model's context "
               "(\"prompt is too long: ...\")", 401: "a key is needed and none or a wrong "
               "one was sent (x-api-key or Authorization: Bearer)", 404: "unknown model",
               413: "the request body is too large", 429: "the model's queue in this gateway is full",
               503: "the model cannot be placed now, or NATS / the scheduler is unavailable",
               504: "the request's deadline passed"}
    errors = {str(status): {"description": reason, "content": _content(refs["AnthropicError"])}
              for status, reason in reasons.items()}
    return {
        "/v1/messages": {"post": {
            "summary": "Anthropic's Messages API: a chat request underneath",
            "requestBody": {"required": True, "content": _content(refs["MessagesRequest"])},
            "responses": {"200": {"description": "a message, or with `\"stream\": true` server-sent events named "
                                                 "by their type: message_start ... message_stop (or error)",
                                  "content": {**_content(refs["MessageOut"]),
                                              "text/event-stream": {"schema": _ANTHROPIC_EVENT}}},
                          **errors},
        }},
        "/v1/messages/count_tokens": {"post": {
            "summary": "the input tokens a message request's prompt is, by the model's template and tokenizer",
            "requestBody": {"required": True, "content": _content(refs["CountTokensRequest"])},
            "responses": {"200": {"description": "the count", "content": _content(refs["TokenCount"])}, **errors},
        }},
        **_message_batch_paths(refs, errors),
    }


def _message_batch_paths(refs: dict[str, dict[str, Any]], errors: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's Message Batches (routes_anthropic_batches.py)."""
    batch_id = [{"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}]

    def answer(summary: str, schema: str, **operation: Any) -> dict[str, Any]:
        return {"summary": summary, **operation, "responses": {
            "200": {"description": summary, "content": _content(refs[schema])}, **errors}}

    return {
        "/v1/messages/batches": {
            "post": answer("a batch of Messages requests, run in the background", "MessageBatch",
                           requestBody={"required": True, "content": _content(refs["MessageBatchCreate"])}),
            "get": answer("the message batches, newest first", "MessageBatchList", parameters=[
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                {"name": "after_id", "in": "query", "schema": {"type": "string"}},
                {"name": "before_id", "in": "query", "schema": {"type": "string"}}]),
        },
        "/v1/messages/batches/{batch_id}": {
            "get": answer("a message batch", "MessageBatch", parameters=batch_id),
            "delete": answer("an ended message batch forgotten, with its results", "DeletedMessageBatch",
                             parameters=batch_id),
        },
        "/v1/messages/batches/{batch_id}/cancel": {"post": answer("the batch asked to stop", "MessageBatch",
                                                                  parameters=batch_id)},
        "/v1/messages/batches/{batch_id}/results": {"get": {
            "summary": "an ended batch's results, one JSON line per request", "parameters": batch_id,
            "responses": {"200": {"description": "the results", "content": {"application/x-jsonl": {
                "schema": {"type": "string"}}}}, **errors}}},
    }


async def openapi_json(_: web.Request) -> web.Response:
    return web.Response(body=get_document(), content_type=_JSON)


def add_routes(app: web.Application) -> None:
    app.router.add_get(OPENAPI_PATH, openapi_json)
