"""Scores and reranking from embeddings, as vLLM serves them for an embedding model: ``/v1/score``
(pairs of texts) and ``/v1/rerank`` (a query against documents, in Jina's and Cohere's shapes:
``/rerank``, ``/v1/rerank``, ``/v2/rerank``), so a retrieval pipeline's reranker (LangChain's
or LlamaIndex's Cohere and Jina rerankers, Cohere's own client) can point at Shoal.

Each distinct text is embedded once (embeddings_api.py: its last token's final hidden state,
L2-normalized) and a pair's score is the cosine of their vectors, in [-1, 1], as vLLM scores
with an embedding model (Cohere's hosted cross-encoders report [0, 1]; a decoder model here has
no classification head to do so). Rerank results come best first; ties keep the documents'
order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Literal

from msgspec import Meta, Struct

from shoal.services.gateway.embeddings_api import MAX_INPUTS, EmbeddingRequest
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


class RerankUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class RerankResult(Struct, kw_only=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(Struct, kw_only=True):
    id: str
    model: str
    usage: RerankUsage
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


def rerank_texts(req: RerankRequest) -> list[str]:
    """The texts to embed: the query, then each document (a document without text is a 400)."""
    texts = [req.query]
    for index, document in enumerate(req.documents):
        text = document_text(document)
        if not text:
            raise BadRequest(f"documents[{index}] has no text", param="documents")
        texts.append(text)
    return texts


def embedding_request(model: str, texts: list[str], *, max_tokens_per_doc: int | None = None,
                      truncate_prompt_tokens: int | None = None) -> EmbeddingRequest:
    """The embedding request computing `texts` once each, cut as asked (at most one way)."""
    if max_tokens_per_doc is not None and truncate_prompt_tokens is not None:
        raise BadRequest("send max_tokens_per_doc (keeps each text's start) or truncate_prompt_tokens (keeps its "
                         "end), not both", param="truncate_prompt_tokens")
    if max_tokens_per_doc is not None:
        return EmbeddingRequest(model=model, input=texts, truncate_prompt_tokens=max_tokens_per_doc,
                                truncation_side="right")
    return EmbeddingRequest(model=model, input=texts, truncate_prompt_tokens=truncate_prompt_tokens)


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
    return list(positions), [(positions[a], positions[b]) for a, b in zip(firsts, seconds, strict=True)]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of two vectors (0.0 when either is all zeros)."""
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norms if norms else 0.0


def ranked(req: RerankRequest, vectors: Sequence[Sequence[float]]) -> list[RerankResult]:
    """Each document's score against the query (`vectors`: the query's, then the documents'),
    best first (ties in the documents' order), the best `top_n`."""
    query, documents = vectors[0], vectors[1:]
    scores = [cosine(query, vector) for vector in documents]
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    if req.top_n:
        order = order[:req.top_n]
    return [RerankResult(index=index, relevance_score=scores[index],
                         document=RerankDocument(document_text(req.documents[index])) if req.return_documents else None)
            for index in order]


def scored(pairs: list[tuple[int, int]], vectors: Sequence[Sequence[float]]) -> list[ScoreData]:
    return [ScoreData(index=index, score=cosine(vectors[a], vectors[b])) for index, (a, b) in enumerate(pairs)]
