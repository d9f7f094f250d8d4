"""The plain transformers engine: one request at a time through `model.generate`.

Kept as ``worker.engine = "hf"`` for models Shoal's paged engine cannot run,
and as the baseline the engine benchmark compares against.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from shoal.services.worker.device_errors import is_fatal_device_error
from shoal.services.worker.generation import (
    EngineFailed,
    GenerationOutput,
    GenerationRequest,
    RequestRejected,
    TextStream,
    check_fits_context,
    embedding_bytes,
)

_DONE = object()


class _QueueStreamer(BaseStreamer):
    """Hands each new token id from the generate thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]) -> None:
        self._loop = loop
        self._queue = queue
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        for token_id in value.reshape(-1).tolist():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, int(token_id))

    def end(self) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, _DONE)


class _StopFlag(StoppingCriteria):
    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class HFGenerateEngine:
    """Serial generation with Hugging Face `generate` (see module doc)."""

    def __init__(self, model: Any, tokenizer: Any, max_model_len: int) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._lock = asyncio.Lock()
        self._stops: dict[str, _StopFlag] = {}
        self._num_waiting = 0
        self.fatal_error: Exception | None = None
        """The CUDA error that poisoned the context (`device_errors`); None while it serves."""

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def num_free_slots(self) -> int:
        return 0 if self._num_waiting or self._lock.locked() else 1

    def cancel(self, request_id: str) -> bool:
        flag = self._stops.get(request_id)
        if flag is None:
            return False
        flag.event.set()
        return True

    async def close(self) -> None:
        for flag in self._stops.values():
            flag.event.set()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        num_prompt = len(request.prompt_token_ids)
        max_len = min(self._max_model_len, request.max_model_len or self._max_model_len)
        check_fits_context(num_prompt, max_len, request.params, "the model's context")
        if request.params.presence_penalty or request.params.frequency_penalty:
            raise RequestRejected(
                "presence_penalty and frequency_penalty need the paged engine; this model runs on the hf engine",
                400,
                param="presence_penalty" if request.params.presence_penalty else "frequency_penalty",
            )
        if request.params.prompt_logprobs is not None:
            raise RequestRejected("prompt log probabilities (echo with logprobs) need the paged engine; this model "
                                  "runs on the hf engine", 400, param="echo")
        if request.params.logprobs is not None:
            raise RequestRejected("logprobs need the paged engine; this model runs on the hf engine", 400,
                                  param="logprobs")
        if request.params.thinking_budget is not None:
            raise RequestRejected("a thinking budget needs the paged engine; this model runs on the hf engine", 400,
                                  param="thinking_token_budget")
        if request.params.has_grammar:
            param = request.params.grammar_param
            raise RequestRejected(f"structured output ({param}) needs the paged engine; this model runs on the hf "
                                  "engine", 400,
                                  param=param)
        if self.fatal_error is not None:
            raise EngineFailed(f"the engine died: {self.fatal_error}") from self.fatal_error
        max_new = min(request.params.max_tokens, max_len - num_prompt)
        flag = _StopFlag()
        self._stops[request.request_id] = flag
        self._num_waiting += 1
        try:
            async with self._lock:
                self._num_waiting -= 1
                if request.params.embed:
                    yield await asyncio.to_thread(self._embed, request)
                    return
                async for output in self._run(request, max_new, flag):
                    yield output
        finally:
            self._stops.pop(request.request_id, None)

    def _embed(self, request: GenerationRequest) -> GenerationOutput:
        """The prompt's embedding (`embedding_bytes`), as the paged engine computes it."""
        input_ids = torch.tensor([request.prompt_token_ids], device=self._model.device)
        with torch.inference_mode():
            hidden = self._model.get_decoder()(input_ids).last_hidden_state[0, -1]
        return GenerationOutput(request.request_id, "", 0, finished=True, finish_reason="stop",
                                num_prompt_tokens=len(request.prompt_token_ids), embedding=embedding_bytes(hidden, request.params.embed_normalize))

    async def _run(self, request: GenerationRequest, max_new: int, flag: _StopFlag) -> AsyncIterator[GenerationOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        params = request.params
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new,
            "do_sample": params.temperature > 0,
            "streamer": _QueueStreamer(loop, queue),
            "stopping_criteria": StoppingCriteriaList([flag]),
            "pad_token_id": self._tokenizer.pad_token_id or self._tokenizer.eos_token_id,
        }
        if params.temperature > 0:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
            if params.min_p:
                kwargs["min_p"] = params.min_p
        if params.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = params.repetition_penalty
        if params.logit_bias:
            kwargs["sequence_bias"] = [[[token_id], bias] for token_id, bias in params.logit_bias.items()]
        ending_ids = request.ending_token_ids
        if ending_ids:
            kwargs.update(eos_token_id=sorted(ending_ids), min_new_tokens=params.min_tokens)
        else:  # ignore_eos: only its length ends it
            kwargs["min_new_tokens"] = max_new
        input_ids = torch.tensor([request.prompt_token_ids], device=self._model.device)

        def run() -> None:
            try:
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                with torch.inference_mode():
                    self._model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
            except Exception as exc:  # surfaces as an error output below
                loop.call_soon_threadsafe(queue.put_nowait, exc)
                loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        thread = threading.Thread(target=run, name=f"generate-{request.request_id}", daemon=True)
        thread.start()
        text = TextStream(self._tokenizer, params.stop, params.min_tokens)
        num_generated = 0
        finish_reason = "length"
        error: str | None = None
        while (item := await queue.get()) is not _DONE:
            if isinstance(item, Exception):
                if is_fatal_device_error(item):  # the context is poisoned: this worker is done
                    self.fatal_error = item
                    await asyncio.to_thread(thread.join)
                    raise EngineFailed(f"the engine died: {item}") from item
                error, finish_reason = str(item), "error"
                continue
            if text.stopped or flag.event.is_set():
                continue  # generate noticed the stop one token late
            num_generated += 1
            delta = text.push(item)
            if item in ending_ids or text.stopped:
                finish_reason = "stop"
                flag.event.set()
            if delta:
                yield GenerationOutput(request.request_id, delta, 1, token_hash=text.token_hash)
        await asyncio.to_thread(thread.join)
        if flag.event.is_set() and finish_reason == "length" and num_generated < max_new:
            finish_reason = "cancelled"
        tail = text.finish()
        if text.stopped and finish_reason == "length":  # the stop string was in the last bytes flushed
            finish_reason = "stop"
        yield GenerationOutput(
            request.request_id,
            tail,
            0,
            finished=True,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            num_prompt_tokens=len(request.prompt_token_ids),
            num_completion_tokens=num_generated,
            stop_reason=text.stopped_by,
            error=error,
            token_hash=text.token_hash,
        )
