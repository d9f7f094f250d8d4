"""OpenAI's embeddings API (``POST /v1/embeddings``), as completions underneath.

Each input (a string, a list of token ids, or a list of either; up to 8,192, computed 128 at a
time) is one request that computes
its prompt and no text: the worker's engine answers with the prompt's last token's final
hidden state, L2-normalized (``SamplingParams.embed``: vLLM's default pooling of a decoder
model; vLLM's ``normalize: false`` leaves it raw), as float32 bytes in its final reply. So an embedding is placed, queued, woken, fairly
preempted and counted as any request is, and its prompt fills the prefix cache.

``encoding_format`` ``float`` (default) or ``base64`` (the float32 little-endian bytes, as
OpenAI sends them); ``dimensions`` (shortened embeddings) is a 400: the vectors are the
model's hidden size.
"""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from shoal.services.gateway.choices import MAX_CHOICES
from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import CompletionRequest, TruncatePromptTokens
from shoal.shared.messages import FinalReply, SamplingParams

MAX_INPUTS = 8192
"""Inputs of one request (OpenAI takes 2,048; Ollama's clients send a whole corpus at once).
Each is a request on the bus, as a choice is: they are computed `BATCH_INPUTS` at a time."""
BATCH_INPUTS = MAX_CHOICES
EMBED_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, embed=True)


def embed_params(req: EmbeddingRequest) -> SamplingParams:
    """What each input's request computes: its embedding (normalized unless `req` says not),
    from the input cut as `req` asks."""
    params = EMBED_PARAMS if req.normalize is not False else msgspec.structs.replace(EMBED_PARAMS,
                                                                                     embed_normalize=False)
    if req.truncate_prompt_tokens is None:
        return params
    return msgspec.structs.replace(params, truncate_prompt_tokens=req.truncate_prompt_tokens,
                                   truncation_side=req.truncation_side)


class EmbeddingRequest(Struct, kw_only=True):
    model: str
    input: Annotated[str, Meta(min_length=1)] | Annotated[list[Any], Meta(min_length=1, max_length=MAX_INPUTS)]
    """A string, a list of token ids, or a list of strings or token-id lists (none empty)."""
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    """vLLM's: keep only each input's last this many tokens (-1: as many as the context takes)."""
    truncation_side: Literal["left", "right"] = "left"
    """Shoal's, for Ollama's ``truncate``: which end a cut input loses (``right``: its end)."""
    normalize: bool | None = None
    """vLLM's: false returns each vector as the model computed it (not L2-normalized)."""


class Embedding(Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct, kw_only=True):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


def completion_request(req: EmbeddingRequest) -> CompletionRequest:
    """The completion request whose prompts are `req`'s inputs (its prompts' checks apply)."""
    if req.dimensions is not None:
        raise BadRequest("dimensions is not supported: an embedding has the model's hidden size",
                         code="unsupported_parameter", param="dimensions")
    return CompletionRequest(model=req.model, prompt=req.input, max_tokens=1, user=req.user,
                             truncate_prompt_tokens=req.truncate_prompt_tokens)


def batches(req: EmbeddingRequest, max_queue: int) -> list[EmbeddingRequest]:
    """`req` as requests of at most `BATCH_INPUTS` inputs each (fewer if the model's queue
    bound `max_queue` is lower: a batch must fit in it), in order."""
    size = max(1, min(BATCH_INPUTS, max_queue))
    inputs = req.input
    if not isinstance(inputs, list) or len(inputs) <= size or not all(isinstance(i, str | list) for i in inputs):
        return [req]
    return [msgspec.structs.replace(req, input=inputs[start:start + size]) for start in range(0, len(inputs), size)]


def as_input_error(exc: BadRequest) -> BadRequest:
    """A prompt's error, named after ``input`` (the embeddings API's name for it)."""
    if exc.param == "prompt":
        exc.param = "input"
    return exc


def embedding_floats(little_endian: bytes) -> list[float]:
    values = array("f", little_endian)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def embedding_list(req: EmbeddingRequest, finals: list[FinalReply]) -> EmbeddingList:
    """The response: each input's vector, in order, and the tokens read."""
    data = []
    for index, final in enumerate(finals):
        assert final.embedding is not None, "an embedding request's final reply carries its vector"
        vector: list[float] | str = (base64.b64encode(final.embedding).decode() if req.encoding_format == "base64"
                                     else embedding_floats(final.embedding))
        data.append(Embedding(index=index, embedding=vector))
    num_tokens = sum(final.prompt_tokens for final in finals)
    return EmbeddingList(data=data, model=req.model, usage=EmbeddingUsage(prompt_tokens=num_tokens,
                                                                           total_tokens=num_tokens))


