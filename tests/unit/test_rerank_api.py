"""Scores and reranking from embeddings (rerank_api.py): which texts are embedded, which pairs
are scored, and how documents are ranked."""

from __future__ import annotations

import math

import msgspec
import pytest

from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import decode_body
from shoal.services.gateway.rerank_api import (
    MAX_DOCUMENTS,
    RerankDocument,
    RerankRequest,
    ScoreRequest,
    cosine,
    ranked,
    rerank_inputs,
    score_pairs,
    scored,
)


def _rerank(**fields: object) -> RerankRequest:
    return decode_body(msgspec.json.encode({"model": "m", "query": "q", **fields}), RerankRequest)


def _score(text_1: object, text_2: object) -> ScoreRequest:
    return decode_body(msgspec.json.encode({"model": "m", "text_1": text_1, "text_2": text_2}), ScoreRequest)


def test_cosine_is_the_angle_not_the_length() -> None:
    assert cosine([1.0, 0.0], [3.0, 0.0]) == pytest.approx(1.0)
    assert cosine([1.0, 0.0], [0.0, 2.0]) == pytest.approx(0.0)
    assert cosine([1.0, 1.0], [-1.0, -1.0]) == pytest.approx(-1.0)
    assert cosine([1.0, 2.0], [2.0, 1.0]) == pytest.approx(4 / 5)
    assert cosine([0.0, 0.0], [1.0, 0.0]) == 0.0  # no direction: no similarity, not a division by zero


def test_one_text_1_is_scored_against_each_text_2_and_embedded_once() -> None:
    texts, pairs = score_pairs(_score("sea", ["sea", "storm", "calm"]))
    assert texts == ["sea", "storm", "calm"]
    assert pairs == [(0, 0), (0, 1), (0, 2)]


def test_lists_of_one_length_are_scored_pair_by_pair() -> None:
    texts, pairs = score_pairs(_score(["a", "b"], ["b", "c"]))
    assert texts == ["a", "b", "c"]
    assert pairs == [(0, 1), (1, 2)]
    assert score_pairs(_score("a", "b")) == (["a", "b"], [(0, 1)])


def test_more_distinct_texts_than_one_request_embeds_are_a_400() -> None:
    with pytest.raises(BadRequest, match="distinct texts") as caught:
        score_pairs(_score([f"a{n}" for n in range(5000)], [f"b{n}" for n in range(5000)]))
    assert caught.value.param == "text_2"


def test_lists_of_two_lengths_are_a_400_naming_both() -> None:
    with pytest.raises(BadRequest, match="text_1 holds 2 texts and text_2 3") as caught:
        score_pairs(_score(["a", "b"], ["a", "b", "c"]))
    assert caught.value.param == "text_1"


@pytest.mark.parametrize(("fields", "param"), [
    ({"documents": []}, "documents"),
    ({"documents": [""]}, "documents"),
    ({"documents": [{"title": "no text"}]}, "documents"),
    ({"documents": ["d"], "top_n": -1}, "top_n"),
    ({"documents": ["d"] * (MAX_DOCUMENTS + 1)}, "documents"),
    ({"query": "", "documents": ["d"]}, "query"),
])
def test_bad_rerank_requests_name_the_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        _rerank(**fields)
    assert caught.value.param == param, caught.value.message


def test_the_query_is_embedded_first_then_each_distinct_document_once() -> None:
    request = _rerank(documents=["plain", {"text": "an object", "title": "ignored"}, "plain", "q"])
    assert request.documents[1] == RerankDocument("an object")
    inputs = rerank_inputs(request)
    [embedding] = inputs.embeddings
    assert embedding.input == ["q", "plain", "an object", "q"]  # the query's row, then the documents'
    assert inputs.document_rows == [1, 2, 1, 3]
    with pytest.raises(BadRequest, match=r"documents\[0\] has no text"):
        rerank_inputs(_rerank(documents=[{"text": ""}]))


def test_a_text_longer_than_the_context_is_read_up_to_it_unless_told() -> None:
    [embedding] = rerank_inputs(_rerank(documents=["d"])).embeddings
    assert (embedding.truncate_prompt_tokens, embedding.truncation_side) == (-1, "right")


def test_cohere_cuts_each_documents_end_never_the_query_vllm_each_texts_start() -> None:
    query, documents = rerank_inputs(_rerank(documents=["d", "e"], max_tokens_per_doc=8)).embeddings
    assert (query.input, query.truncate_prompt_tokens, query.truncation_side) == (["q"], -1, "right")
    assert (documents.input, documents.truncate_prompt_tokens, documents.truncation_side) == (["d", "e"], 8, "right")
    [vllm] = rerank_inputs(_rerank(documents=["d"], truncate_prompt_tokens=8)).embeddings
    assert (vllm.input, vllm.truncate_prompt_tokens, vllm.truncation_side) == (["q", "d"], 8, "left")
    with pytest.raises(BadRequest, match="not both"):
        rerank_inputs(_rerank(documents=["d"], max_tokens_per_doc=8, truncate_prompt_tokens=8))


def test_documents_are_ranked_best_first_ties_in_their_order() -> None:
    query = [1.0, 0.0]
    vectors = [query, [0.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]
    results = ranked(_rerank(documents=["far", "near", "same", "near again"]), vectors, [1, 2, 3, 4])
    assert [result.index for result in results] == [2, 1, 3, 0]
    assert results[0].relevance_score == pytest.approx(1.0)
    assert results[1].relevance_score == pytest.approx(math.sqrt(0.5))
    assert [result.document for result in results] == [RerankDocument(text) for text in
                                                       ("same", "near", "near again", "far")]


def test_top_n_keeps_the_best_and_documents_are_left_out_when_asked() -> None:
    vectors = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.5]]
    rows = [1, 2, 3]
    best_two = ranked(_rerank(documents=["a", "b", "c"], top_n=2, return_documents=False), vectors, rows)
    assert [result.index for result in best_two] == [1, 2]
    assert all(result.document is None for result in best_two)
    assert b"document" not in msgspec.json.encode(best_two)
    assert len(ranked(_rerank(documents=["a", "b", "c"], top_n=0), vectors, rows)) == 3  # vLLM's 0: all
    assert len(ranked(_rerank(documents=["a", "b", "c"], top_n=10), vectors, rows)) == 3
    repeated = ranked(_rerank(documents=["a", "b", "a"]), vectors[:3], [1, 2, 1])  # "a" embedded once
    assert [(result.index, result.document) for result in repeated] == [
        (1, RerankDocument("b")), (0, RerankDocument("a")), (2, RerankDocument("a"))]


def test_scores_follow_the_pairs() -> None:
    vectors = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    data = scored([(0, 0), (0, 1), (2, 0)], vectors)
    assert [item.index for item in data] == [0, 1, 2]
    assert [item.score for item in data] == pytest.approx([1.0, 0.0, math.sqrt(0.5)])
