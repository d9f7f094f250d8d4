"""Scores and reranking from embeddings, as vLLM serves them for an embedding model: ``/v1/score``
(pairs of texts) and ``/v1/rerank`` (a query against documents, in Jina's and Cohere's shapes:
``/rerank``, ``/v1/rerank``, ``/v2/rerank``), so a retrieval pipeline's reranker (LangChain's
or LlamaIndex's Cohere and Jina rerankers, Cohere's own client) can point at Shoal.

Each distinct text is embedded once (embeddings_api.py: its last token's final hidden state,
L2-normalized) and a pair's score is the cosine of their vectors, in [-1, 1], as vLLM scores
with an embedding model (Cohere's hosted cross-encoders report [0, 1]; a decoder model here has
no classification head to do so). Rerank results come best first; ties keep the documents'
order. A rerank text longer than the model's context is read up to it (its end cut, as
Cohere cuts long documents) unless the request says how to cut; Cohere's
``max_tokens_per_doc`` cuts the documents only, never the query.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from msgspec import Meta, Struct

from shoal.services.gateway.embeddings_api import MAX_INPUTS, EmbeddingRequest, EmbeddingUsage
from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import MAX_INT32, TruncatePromptTokens

MAX_DOCUMENTS = MAX_INPUTS - 1
"""Documents of one rerank request (with its query, an embedding request's inputs at most)."""
NonEmptyText = Annotated[str, Meta(min_length=1)]


class RerankDocument(Struct):
    """A document as Jina's and Cohere's v1 clients may send it (other fields are ignored)."""

    text: str


class RerankRequest(Struct, kw_only=True):
    model: str
    query: NonEmptyText
    documents: Annotated[list[NonEmptyText | RerankDocument], Meta(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: Annotated[int, Meta(ge=0)] | None = None
    """The best this many (none or 0: all, as vLLM reads 0)."""
    return_documents: bool = True
    """Each result's document text (vLLM's and Jina's default; Cohere's v1 asks)."""
    max_tokens_per_doc: Annotated[int, Meta(ge=1, le=MAX_INT32)] | None = None
    """Cohere's v2: each text's first this many tokens are read (its end is cut)."""
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    """vLLM's: each text's last this many tokens are read (-1: as many as the context takes)."""


class ScoreRequest(Struct, kw_only=True):
    model: str
    text_1: NonEmptyText | Annotated[list[NonEmptyText], Meta(min_length=1, max_length=MAX_INPUTS)]
    """One text scored against each of `text_2`'s, or as many as `text_2` holds, pair by pair."""
    text_2: NonEmptyText | Annotated[list[NonEmptyText], Meta(min_length=1, max_length=MAX_INPUTS)]
    truncate_prompt_tokens: TruncatePromptTokens | None = None


class RerankResult(Struct, kw_only=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(Struct, kw_only=True):
    id: str
    model: str
    usage: EmbeddingUsage
    results: list[RerankResult]


class ScoreData(Struct, kw_only=True):
    index: int
    score: float
    object: Literal["score"] = "score"


class ScoreUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage
    object: Literal["list"] = "list"


def document_text(document: str | RerankDocument) -> str:
    return document if isinstance(document, str) else document.text


@dataclass(frozen=True)
class RerankInputs:
    """What a rerank request embeds: `embeddings` in order, whose vectors are the query's (row
    0), then each distinct document's; `document_rows`: each document's row among them."""

    embeddings: list[EmbeddingRequest]
    document_rows: list[int]


def rerank_inputs(req: RerankRequest) -> RerankInputs:
    """The query and each distinct document, embedded once, cut as the request asks (a
    document without text, or two ways to cut, is a 400)."""
    if req.max_tokens_per_doc is not None and req.truncate_prompt_tokens is not None:
        raise BadRequest("send max_tokens_per_doc (keeps each document's start) or truncate_prompt_tokens (keeps "
                         "each text's end), not both", param="truncate_prompt_tokens")
    positions: dict[str, int] = {}
    document_rows = []
    for index, document in enumerate(req.documents):
        text = document_text(document)
        if not text:
            raise BadRequest(f"documents[{index}] has no text", param="documents")
        document_rows.append(1 + positions.setdefault(text, len(positions)))
    documents = list(positions)
    if req.truncate_prompt_tokens is not None:  # vLLM's: every text keeps its end
        embeddings = [EmbeddingRequest(model=req.model, input=[req.query, *documents],
                                       truncate_prompt_tokens=req.truncate_prompt_tokens)]
    elif req.max_tokens_per_doc is not None:  # Cohere's: each document keeps its start; the query whole
        embeddings = [_read_up_to_context(req.model, [req.query]),
                      EmbeddingRequest(model=req.model, input=documents, truncate_prompt_tokens=req.max_tokens_per_doc,
                                       truncation_side="right")]
    else:
        embeddings = [_read_up_to_context(req.model, [req.query, *documents])]
    return RerankInputs(embeddings, document_rows)


def _read_up_to_context(model: str, texts: list[str]) -> EmbeddingRequest:
    """`texts`, each read up to the model's context (a longer one loses its end)."""
    return EmbeddingRequest(model=model, input=texts, truncate_prompt_tokens=-1, truncation_side="right")


def score_pairs(req: ScoreRequest) -> tuple[list[str], list[tuple[int, int]]]:
    """The distinct texts to embed, and each pair to score as indices into them (vLLM's 1:1,
    1:N and N:N; an N:M with N != M is a 400)."""
    firsts = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    seconds = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise BadRequest(f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: send one text_1, or as many "
                         "as text_2 (scored pair by pair)", param="text_1")
    positions: dict[str, int] = {}
    for text in firsts + seconds:
        positions.setdefault(text, len(positions))
    if len(positions) > MAX_INPUTS:
        raise BadRequest(f"the pairs hold {len(positions)} distinct texts; at most {MAX_INPUTS} are embedded for one "
                         "request", param="text_2")
    return list(positions), [(positions[a], positions[b]) for a, b in zip(firsts, seconds, strict=True)]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of two vectors (0.0 when either is all zeros)."""
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norms if norms else 0.0


def ranked(req: RerankRequest, vectors: Sequence[Sequence[float]], document_rows: list[int]) -> list[RerankResult]:
    """Each document's score against the query (`vectors[0]`; document i's is
    `vectors[document_rows[i]]`), best first (ties in the documents' order), the best `top_n`."""
    query = vectors[0]
    scores = [cosine(query, vectors[row]) for row in document_rows]
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    if req.top_n:
        order = order[:req.top_n]
    return [RerankResult(index=index, relevance_score=scores[index],
                         document=RerankDocument(document_text(req.documents[index])) if req.return_documents else None)
            for index in order]


def scored(pairs: list[tuple[int, int]], vectors: Sequence[Sequence[float]]) -> list[ScoreData]:
    return [ScoreData(index=index, score=cosine(vectors[a], vectors[b])) for index, (a, b) in enumerate(pairs)]
