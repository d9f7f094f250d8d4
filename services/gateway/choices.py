"""One HTTP request, several generations: ``n`` choices per prompt and, on ``/v1/completions``, a
list of prompts. Each generation is a request of its own on the bus (its own wire id, reply
subject, replica, cancellation), so the workers need nothing new; the gateway numbers the
choices as OpenAI does (prompt by prompt, ``n`` each) and joins their answers.

Seeds: choice ``j`` of a prompt samples with ``seed + j`` (wrapped into int64), so a seeded
request with ``n > 1`` gets distinct but reproducible choices, and each prompt of a batch the
same choices as a request of its own would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from shoal.shared.messages import InferenceRequest

MAX_CHOICES = 128
"""Generations per HTTP request (prompts x n), as OpenAI bounds ``n``."""

_INT64 = 2**64
_INT64_MIN = -(2**63)

T = TypeVar("T")


@dataclass(frozen=True)
class Choice:
    """One generation of a request: its index in the response and the request that makes it."""

    index: int
    request: InferenceRequest
    counts_prompt: bool = True
    """The first choice of its prompt: the usage counts each prompt's tokens once."""


def choice_seed(seed: int | None, offset: int) -> int | None:
    """`seed + offset`, wrapped into int64 (what msgpack carries to the worker)."""
    if seed is None:
        return None
    return (seed + offset - _INT64_MIN) % _INT64 + _INT64_MIN


def expand(base: InferenceRequest, prompts: Sequence[dict[str, Any]], n: int,
           reply_subject: Any) -> list[Choice]:
    """The generations of `base`: for each prompt (the fields it sets on the request), `n`
    choices. A single generation keeps `base`'s id; several get ``<id>-<index>``, each with
    its reply subject (`reply_subject(wire_id)`). Only the first choice carries the session:
    a session is one conversation, and any of its choices may be the one that continues it."""
    if len(prompts) * n == 1:
        return [Choice(0, msgspec.structs.replace(base, **prompts[0]))]
    choices = []
    for prompt_index, prompt in enumerate(prompts):
        for j in range(n):
            index = prompt_index * n + j
            wire_id = f"{base.request_id}-{index}"
            params = msgspec.structs.replace(base.params, seed=choice_seed(base.params.seed, j))
            request = msgspec.structs.replace(
                base, request_id=wire_id, reply_to=reply_subject(wire_id), params=params,
                session_id=base.session_id if index == 0 else None, **prompt)
            choices.append(Choice(index, request, counts_prompt=j == 0))
    return choices


_END = object()


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """The items of every stream as they come, each with its stream's index. The first error
    of any stream ends it all (raised here); leaving early cancels the streams still running."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None))
        except Exception as exc:  # handed to the consumer, raised there
            queue.put_nowait((index, None, exc))
        else:
            queue.put_nowait((index, _END, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
