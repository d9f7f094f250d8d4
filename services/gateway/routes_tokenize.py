"""``/tokenize`` and ``/detokenize``, as vLLM serves them: a prompt's tokens (a chat's after
its template, exactly those a request with it is generated from) and token ids' text, from a
replica's own tokenizer (services/worker/tokenize_api.py).

A body with ``messages`` is read as a chat request (tools and ``chat_template_kwargs``
included), one with ``prompt`` as a completion's (one prompt, text or token ids). A model
with no replica running gets one placed first, as an inference request would.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

import msgspec
import structlog
from aiohttp import web
from msgspec import Meta, Struct

from shoal.services.gateway.errors import BadRequest, Unavailable
from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.openai_api import (
    MAX_INT32,
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
)
from shoal.services.gateway.plans import inference_request
from shoal.services.gateway.request_ids import REQUEST_ID
from shoal.services.gateway.service_calls import ask_worker
from shoal.services.gateway.state import GATEWAY, GatewayState
from shoal.shared.messages import (
    Detokenize,
    Tokenize,
    TokenizeReply,
    detokenize_reply_decoder,
    tokenize_reply_decoder,
)

log = structlog.get_logger(__name__)
routes = web.RouteTableDef()
WORKER_TIMEOUT_S = 30.0
REASK_AFTER_S = 0.25
"""How long the gateway's view of the replicas gets to catch up before a replica is chosen again."""
MAX_DETOKENIZE_TOKENS = 1 << 20


class _TokenizeOptions(Struct):
    """What picks the body's shape, and vLLM's options (at their only honoured values)."""

    model: str | None = None
    messages: Any = None
    return_token_strs: bool | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeBody(Struct):
    model: str
    tokens: Annotated[list[Annotated[int, Meta(ge=0, le=MAX_INT32)]], Meta(max_length=MAX_DETOKENIZE_TOKENS)]


class DetokenizeResponse(Struct):
    prompt: str


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    raw = await request.read()
    options = decode_body(raw, _TokenizeOptions)
    is_chat = options.messages is not None
    # The tokens are those generation uses: a chat's template adds no special tokens of its own
    # (its add_generation_prompt and continue_final_message are chat's fields, honoured as chat
    # honours them); a prompt gets the tokenizer's (a BOS, for most models).
    honoured_values = ({"add_special_tokens": (None, False)} if is_chat
                       else {"add_special_tokens": (None, True), "add_generation_prompt": (None,)})
    for name, honoured in honoured_values.items():
        if getattr(options, name) not in honoured:
            raise BadRequest(f"{name} other than generation's is not supported (its tokens are generation's)",
                             code="unsupported_parameter", param=name)
    body = decode_body(raw, ChatCompletionRequest if is_chat else CompletionRequest)
    reply = await prompt_tokens(state, body, request[REQUEST_ID], with_strings=bool(options.return_token_strs))
    return json_response(TokenizeResponse(len(reply.tokens), reply.max_model_len, reply.tokens, reply.token_strs))


async def prompt_tokens(state: GatewayState, body: ChatCompletionRequest | CompletionRequest, request_id: str, *,
                        with_strings: bool = False) -> TokenizeReply:
    """The tokens `body`'s prompt is generated from, as a serving replica of its model
    tokenizes it (one placed first if none runs)."""
    state.cluster.require_model(body.model)
    inference = inference_request(state, body, request_id)
    return await _ask_serving_worker(state, body.model, inference.deadline, "tokenize",
                                     Tokenize(inference, with_strings), tokenize_reply_decoder)


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    body = decode_body(await request.read(), DetokenizeBody)
    state.cluster.require_model(body.model)
    reply = await _ask_serving_worker(state, body.model, time.time() + state.config.request_timeout_s, "detokenize",
                                      Detokenize(body.tokens), detokenize_reply_decoder)
    return json_response(DetokenizeResponse(reply.prompt))


async def _ask_serving_worker(state: GatewayState, model: str, deadline: float, verb: str, command: Struct,
                              decoder: msgspec.json.Decoder[Any]) -> Any:
    """A serving replica's answer to `command`. A replica that goes away between being chosen
    and answering (put to sleep, stopped: the gateway's view lags a moment) is not the
    client's fault: another serving replica (or the same, woken) is asked, until `deadline`."""
    while True:
        replica = await state.dispatcher.serving_replica(model, deadline)
        try:
            return await ask_worker(state.bus, replica.replica_id, verb, command, decoder, timeout_s=WORKER_TIMEOUT_S)
        except Unavailable:
            if time.time() + REASK_AFTER_S >= deadline:
                raise
            log.info("replica_gone_asking_again", replica=replica.replica_id, verb=verb)
            await asyncio.sleep(REASK_AFTER_S)
