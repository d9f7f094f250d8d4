"""What an inference request makes, whichever API it came in by: its plan (the generations
it queues, how their answers are read), its generations' events, and each choice's answer
collected (a response that is not streamed).

The OpenAI routes (routes_openai.py) and Ollama's (routes_ollama.py) both validate into the
same plans, so a request is sampled, placed, queued and read the same whichever API it uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from shoal.services.gateway.answer_reader import AnswerReader, Read
from shoal.services.gateway.choices import Choice, expand, merged
from shoal.services.gateway.dispatch import DispatchEvent, Restart
from shoal.services.gateway.embeddings_api import (
    EmbeddingRequest,
    as_input_error,
    batches,
    completion_request,
    embed_params,
)
from shoal.services.gateway.errors import ApiError, BadRequest
from shoal.services.gateway.openai_api import (
    UNLIMITED_MAX_TOKENS,
    Answer,
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
    chat_messages,
    check_fits_in_message,
    check_num_choices,
    completion_prompts,
    echoed_text,
    raise_prompt_too_large,
    sampling_params,
    session_id_of,
    stream_mode,
    template_kwargs,
    template_mode,
    usage,
)
from shoal.services.gateway.reasoning import THINK_END, ReasoningReader, with_thinking_budget
from shoal.services.gateway.state import GatewayState
from shoal.services.gateway.tool_call_parser import ToolCallReader
from shoal.services.gateway.tools import ToolPlan, forced, tool_plan, tool_specs
from shoal.shared.messages import FinalReply, InferenceRequest, PromptEcho, TokenChunk, TokenLogprob
from shoal.shared.model_settings import ReasoningParser


def inference_request(state: GatewayState, body: ChatCompletionRequest | CompletionRequest,
                      request_id: str) -> InferenceRequest:
    """The one request `body` makes, validated as it would be queued (``/tokenize`` renders its
    prompt); a 400 for a batch of prompts or ``n`` choices."""
    plan = plan_request(state, body, request_id, None)
    if len(plan.choices) > 1:
        raise BadRequest("send one prompt (a batch or n > 1 has several)", param="prompt")
    return plan.choices[0].request


@dataclass(frozen=True)
class Plan:
    """What one HTTP request makes: its generations (choices.py), how it answers."""

    choices: list[Choice]
    stream: bool
    include_usage: bool
    tools: ToolPlan | None = None
    """How answers are read for function calls; None: they are not."""
    reasoning: ReasoningParser | None = None
    """How a reasoning model's thinking is split out of its chat answers; None: it is not."""
    continued: str | None = None
    """The assistant message the answers go on with (``continue_final_message``), if any."""
    param_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The client's names of the fields a worker's error names otherwise (the Responses API's
    ``input`` for ``messages``, its ``max_output_tokens`` for ``max_tokens``)."""

    def name_param(self, error: ApiError) -> ApiError:
        """`error`, its ``param`` named as the client named that field."""
        if error.param is not None:
            error.param = self.param_names.get(error.param, error.param)
        return error

    def answer_reader(self) -> AnswerReader:
        """A reader for one choice's text."""
        return AnswerReader(ReasoningReader(self.reasoning, self.continued) if self.reasoning is not None else None,
                            ToolCallReader(self.tools) if self.tools is not None and self.tools.reads_calls else None)


def plan_request(state: GatewayState, body: ChatCompletionRequest | CompletionRequest, request_id: str,
                 session_header: str | None, format_param: str = "response_format") -> Plan:
    """Validate `body` (a 400 for what is invalid, a 413 for a generation too large for a NATS
    message) into what it makes; a schema the model cannot follow is blamed on `format_param`
    (the Responses API's answer format is ``text``)."""
    prompts: list[dict[str, Any]]
    tools: ToolPlan | None = None
    reasoning: ReasoningParser | None = None
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        spec = state.cluster.get_model(body.model)
        tools = tool_plan(body, spec.tool_call_parser if spec is not None else "hermes")
        reasoning = spec.reasoning_parser if spec is not None else None
        thinks_first = reasoning is not None and spec is not None and spec.grammar_after_reasoning
        params = forced(sampling_params(body, max_tokens, UNLIMITED_MAX_TOKENS), tools, body)
        if params.json_schema is not None and params.grammar_param == "response_format":
            params = msgspec.structs.replace(params, grammar_param=format_param)
        if thinks_first and params.has_grammar:  # the model thinks first, freely (as vLLM has it)
            params = msgspec.structs.replace(params, grammar_after=THINK_END)
        params = with_thinking_budget(params, body.thinking_token_budget, reasoning)
        prompts = [{"messages": chat_messages(body, state.config.max_prompt_chars), "tools": tool_specs(body),
                    "chat_template_kwargs": template_kwargs(body), **template_mode(body)}]
    else:
        params = sampling_params(body, body.max_tokens, 16)
        prompts = completion_prompts(body, state.config.max_prompt_chars)
    n = body.n or 1
    check_num_choices(n, len(prompts))
    stream, include_usage = stream_mode(body)
    session_id = session_id_of(body, session_header)
    if session_id is not None:
        if len(prompts) > 1:
            raise BadRequest("a session is one conversation: send one prompt with session_id", param="session_id")
        structlog.contextvars.bind_contextvars(session_id=session_id)
    created = time.time()
    inference = InferenceRequest(
        request_id=request_id,
        model=body.model,
        params=params,
        deadline=created + state.config.request_timeout_s,
        reply_to=state.router.reply_subject(request_id),
        stream=stream,
        gateway_id=state.router.gateway_id,
        created=created,
        session_id=session_id,
    )
    continued = (prompts[0]["messages"][-1].content if isinstance(body, ChatCompletionRequest)
                 and body.continue_final_message else None)
    choices = expand(inference, prompts, n, state.router.reply_subject)
    for choice in choices:
        check_fits_in_message(choice.request, state.bus.nc.max_payload)
    return Plan(choices, stream, include_usage, tools, reasoning, continued)


def with_params(plan: Plan, **changes: Any) -> Plan:
    """`plan` with sampling parameters ``/v1`` has no field for (every stop string: ``/v1``
    takes 4; a conversation's oldest messages dropped to fit, Ollama's ``truncate``)."""
    choices = [dataclasses.replace(choice, request=msgspec.structs.replace(
        choice.request, params=msgspec.structs.replace(choice.request.params, **changes))) for choice in plan.choices]
    return dataclasses.replace(plan, choices=choices)


def embedding_plan(state: GatewayState, body: EmbeddingRequest, request_id: str) -> Plan:
    """One request per input, each computing its prompt's embedding (embeddings_api.py)."""
    try:
        plan = plan_request(state, completion_request(body), request_id, None)
    except BadRequest as exc:
        raise as_input_error(exc) from None
    params = embed_params(body)
    choices = [dataclasses.replace(choice, request=msgspec.structs.replace(choice.request, params=params))
               for choice in plan.choices]
    return dataclasses.replace(plan, choices=choices)


def choices_usage(choices: list[Choice], finals: Sequence[FinalReply | None], num_reasoning_tokens: int) -> Usage:
    """Each prompt's tokens once (as OpenAI counts ``n > 1``), every choice's completion tokens
    (`num_reasoning_tokens` of them the model thought in)."""
    ended = [final for final in finals if final is not None]
    assert len(ended) == len(choices), "every choice ends with its final reply"
    prompts = [final for choice, final in zip(choices, ended, strict=True) if choice.counts_prompt]
    return usage(sum(final.prompt_tokens for final in prompts), sum(final.completion_tokens for final in ended),
                 sum(final.cached_tokens for final in prompts), num_reasoning_tokens)


@contextlib.asynccontextmanager
async def generating(state: GatewayState, choices: list[Choice], *, restartable: bool
                     ) -> AsyncIterator[AsyncIterator[tuple[int, DispatchEvent]]]:
    """Every choice's dispatcher events as they come, each with its choice's index; on
    leaving, every choice still running is cancelled."""
    runs = [state.dispatcher.run(choice.request, restartable=restartable) for choice in choices]
    events = merged(runs)
    async with contextlib.AsyncExitStack() as closing:
        for run in runs:
            closing.push_async_callback(run.aclose)
        closing.push_async_callback(events.aclose)  # first: it stops the tasks reading the runs
        yield events


class Collected:
    """One choice's answer as its events come (a non-streamed response)."""

    def __init__(self, choice: Choice, reader: AnswerReader) -> None:
        self.parts: list[tuple[str, int]] = []
        """The answer's text as it came: (text, the tokens it came in)."""
        self.logprobs: list[TokenLogprob] | None = [] if choice.request.params.logprobs is not None else None
        self.final: FinalReply | None = None
        self.prompt: PromptEcho | None = None
        self._own_prompt = choice.request.prompt
        self._reader = reader

    def add(self, event: DispatchEvent) -> None:
        match event:
            case Restart():
                self.parts.clear()
                self.prompt = None
                if self.logprobs is not None:
                    self.logprobs.clear()
            case TokenChunk(text=text):
                if event.prompt is not None:
                    self.prompt = event.prompt
                    self.parts.append((echoed_text(event.prompt, self._own_prompt), 0))
                self.parts.append((text, event.num_tokens))
                if self.logprobs is not None:
                    self.logprobs += event.logprobs or ()
            case FinalReply():
                self.final = event

    def ended(self) -> FinalReply:
        assert self.final is not None, "dispatcher ended without a final reply or an error"
        return self.final

    @property
    def num_reasoning_tokens(self) -> int:
        return self._reader.num_reasoning_tokens

    def answer(self) -> Answer:
        final = self.ended()
        finish_reason, stop_reason = final.finish_reason, final.stop_reason
        if self._reader.passes_through:
            return Answer("".join(text for text, _ in self.parts), finish_reason, self.logprobs, prompt=self.prompt,
                          stop_reason=stop_reason)
        read = Read()
        for text, num_tokens in self.parts:  # as they came: the reasoning's tokens are counted chunk by chunk
            read += self._reader.feed(text, num_tokens)
        rest, finish_reason = self._reader.finish(finish_reason)
        read += rest
        return Answer(read.content, finish_reason, self.logprobs, read.calls or None, reasoning=read.reasoning or None,
                      stop_reason=stop_reason)


async def collect(state: GatewayState, plan: Plan) -> list[Collected]:
    """Every choice's answer, collected as its events come (a response that is not streamed)."""
    collected = [Collected(choice, plan.answer_reader()) for choice in plan.choices]
    try:
        async with generating(state, plan.choices, restartable=True) as events:
            async for index, event in events:
                collected[index].add(event)
    except ApiError as exc:
        raise plan.name_param(exc) from None
    return collected


@contextlib.contextmanager
def admitted(state: GatewayState, plan: Plan) -> Iterator[None]:
    """`plan`'s generations admitted to their model's queue for the whole block: a 404 for an
    unknown model, a 429 when the queue is full (each generation counts against its bound)."""
    with contextlib.ExitStack() as admissions:
        for choice in plan.choices:
            admissions.enter_context(state.dispatcher.admitted(choice.request.model))
        yield


def embedding_plans(state: GatewayState, body: EmbeddingRequest, request_id: str) -> list[Plan]:
    """The plans of `body`'s inputs, a batch each (`embeddings_api.batches`, no larger than the
    model's queue bound), all validated before any is computed: the character bound is on all
    the inputs together, as on a batch of prompts."""
    spec = state.cluster.require_model(body.model)
    parts = batches(body, spec.max_queue or state.config.max_queue_per_model)
    if len(parts) == 1:
        return [embedding_plan(state, body, request_id)]
    total_chars = sum(len(text) for text in body.input)
    if total_chars > state.config.max_prompt_chars:
        raise_prompt_too_large(total_chars, state.config.max_prompt_chars, param="input")
    return [embedding_plan(state, part, f"{request_id}-b{n}") for n, part in enumerate(parts)]


async def embed_all(state: GatewayState, plans: list[Plan], on_placed: Callable[[], None] = lambda: None
                    ) -> list[FinalReply]:
    """Every input's final reply (its vector), in order: the model placed first (`on_placed`
    then), a batch at a time, each admitted to its model's queue while it waits and runs."""
    first = plans[0].choices[0].request
    finals: list[FinalReply] = []
    for n, plan in enumerate(plans):
        with admitted(state, plan):
            if n == 0:
                await state.dispatcher.ensure_placed(first.model, first.deadline)
                on_placed()
            finals += await collect_embeddings(state, plan)
    return finals


async def collect_embeddings(state: GatewayState, plan: Plan) -> list[FinalReply]:
    """Each input's final reply (its vector), in order."""
    finals: list[FinalReply | None] = [None] * len(plan.choices)
    try:
        async with generating(state, plan.choices, restartable=True) as events:
            async for index, event in events:
                if isinstance(event, FinalReply):
                    finals[index] = event
    except BadRequest as exc:  # the worker's, about a prompt: an input here
        raise as_input_error(exc) from None
    ended = [final for final in finals if final is not None]
    assert len(ended) == len(finals), "every input ends with its final reply"
    return ended
