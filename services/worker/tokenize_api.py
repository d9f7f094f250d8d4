"""A replica's tokenizer, asked by the gateway's ``/tokenize`` and ``/detokenize``
(services/gateway/routes_tokenize.py). Two endpoints of the replica's ``shoal-worker`` micro
service:

    shoal.worker.<replica>.tokenize     Tokenize   -> TokenizeReply
    shoal.worker.<replica>.detokenize   Detokenize -> DetokenizeReply

A prompt is tokenized by the very function generation uses (`prompts.prompt_token_ids`), so
the count is the ``prompt_tokens`` a request with it would report.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nats.micro.service import Service
from transformers import PreTrainedTokenizerBase

from shoal.services.worker.generation import RequestRejected
from shoal.services.worker.prompts import check_in_vocabulary, prompt_token_ids, vocabulary_limit
from shoal.services.worker.service import WorkerIdentity
from shoal.shared.messages import (
    Detokenize,
    DetokenizeReply,
    Tokenize,
    TokenizeReply,
    detokenize_decoder,
    tokenize_decoder,
)
from shoal.shared.micro import RequestError, add_json_endpoint
from shoal.shared.subjects import worker_subject


def tokenize(tokenizer: PreTrainedTokenizerBase, command: Tokenize, vocab_size: int | None, max_model_len: int
             ) -> TokenizeReply:
    try:
        tokens = prompt_token_ids(tokenizer, command.request, vocab_size, max_model_len)
    except RequestRejected as exc:
        raise RequestError(exc.status, str(exc)) from exc
    token_strs = list(tokenizer.convert_ids_to_tokens(tokens)) if command.token_strs else None
    return TokenizeReply(tokens, max_model_len, token_strs)


def detokenize(tokenizer: PreTrainedTokenizerBase, command: Detokenize, vocab_size: int | None) -> DetokenizeReply:
    """The tokens' text; a 400 for an id past the model's embedding rows (`vocab_size`) or its tokenizer."""
    try:
        check_in_vocabulary(command.tokens, vocabulary_limit(tokenizer, vocab_size), "detokenize", param=None)
    except RequestRejected as exc:
        raise RequestError(exc.status, str(exc)) from exc
    text = tokenizer.decode(command.tokens)
    assert isinstance(text, str), "one sequence decodes to one text"
    return DetokenizeReply(text)


async def add_tokenize_endpoints(service: Service, identity: WorkerIdentity, tokenizer: PreTrainedTokenizerBase,
                                 vocab_size: int | None, max_model_len: Callable[[], int]) -> None:
    """`max_model_len`: the context the replica serves now (its engine's may be smaller than the
    model's, and change when the engine is rebuilt), as generation cuts prompts to it."""

    async def on_tokenize(command: Tokenize) -> TokenizeReply:
        return await asyncio.to_thread(tokenize, tokenizer, command, vocab_size, max_model_len())

    async def on_detokenize(command: Detokenize) -> DetokenizeReply:
        return await asyncio.to_thread(detokenize, tokenizer, command, vocab_size)

    replica_id = identity.replica_id
    await add_json_endpoint(service, "tokenize", worker_subject(replica_id, "tokenize"),
                            tokenize_decoder.decode, on_tokenize)
    await add_json_endpoint(service, "detokenize", worker_subject(replica_id, "detokenize"),
                            detokenize_decoder.decode, on_detokenize)
