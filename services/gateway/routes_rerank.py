"""``/v1/score`` and ``/v1/rerank`` (also ``/score``, ``/rerank`` and Cohere's ``/v2/rerank``),
as vLLM serves them: rerank_api.py reads the request and scores, the embeddings are computed
as ``/v1/embeddings`` computes them (placed, queued, woken and counted as any request)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web

from shoal.services.gateway.embeddings_api import EmbeddingRequest, EmbeddingUsage, embedding_floats
from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.json_body import json_response
from shoal.services.gateway.plans import embed_all, embedding_plans
from shoal.services.gateway.request_ids import REPLICA_HEADER, REQUEST_ID
from shoal.services.gateway.rerank_api import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
    ranked,
    rerank_inputs,
    score_pairs,
    scored,
)
from shoal.services.gateway.state import GATEWAY, GatewayState
from shoal.services.gateway.tally import Tally, tallied

routes = web.RouteTableDef()


@routes.post("/v1/rerank")
@routes.post("/rerank")
@routes.post("/v2/rerank")
async def rerank(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    with tallied(state, "rerank") as tally:
        body: RerankRequest = tally.decode(await request.read(), RerankRequest)
        inputs = rerank_inputs(body)
        embedded = await _embedded(state, tally, inputs.embeddings, request[REQUEST_ID], param="documents")
        answer = RerankResponse(id=f"rerank-{request[REQUEST_ID]}", model=body.model,
                                results=ranked(body, embedded.vectors, inputs.document_rows),
                                usage=EmbeddingUsage(prompt_tokens=embedded.num_tokens, total_tokens=embedded.num_tokens))
        return json_response(answer, headers=embedded.headers)


@routes.post("/v1/score")
@routes.post("/score")
async def score(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    with tallied(state, "score") as tally:
        body: ScoreRequest = tally.decode(await request.read(), ScoreRequest)
        texts, pairs = score_pairs(body)
        embedding = EmbeddingRequest(model=body.model, input=texts, truncate_prompt_tokens=body.truncate_prompt_tokens)
        embedded = await _embedded(state, tally, [embedding], request[REQUEST_ID], param="text_2")
        answer = ScoreResponse(id=f"score-{request[REQUEST_ID]}", created=int(time.time()), model=body.model,
                               data=scored(pairs, embedded.vectors),
                               usage=ScoreUsage(prompt_tokens=embedded.num_tokens, total_tokens=embedded.num_tokens))
        return json_response(answer, headers=embedded.headers)


@dataclass(frozen=True)
class _Embedded:
    vectors: list[list[float]]
    """Each text's, in order."""
    num_tokens: int
    """The texts' tokens."""
    headers: dict[str, str]
    """The answer's (the replica that computed the first)."""


async def _embedded(state: GatewayState, tally: Tally, embeddings: list[EmbeddingRequest], request_id: str, *,
                    param: str) -> _Embedded:
    """`embeddings` computed; an error about an input names `param` (what the request calls
    its texts)."""
    try:
        plans = [plan for n, embedding in enumerate(embeddings)
                 for plan in embedding_plans(state, embedding, request_id if n == 0 else f"{request_id}-{n}")]
        tally.start()
        finals = await embed_all(state, plans)
    except BadRequest as exc:
        if exc.param == "input":
            exc.param = param
        raise
    tally.outcome = "ok"
    return _Embedded([embedding_floats(final.embedding or b"") for final in finals],
                     sum(final.prompt_tokens for final in finals), {REPLICA_HEADER: finals[0].replica_id})
