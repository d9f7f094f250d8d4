"""Shoal's paged engine: continuous batching over the KV block pool, behind the `Engine` protocol.

Threads: the step loop runs in ONE dedicated thread (torch releases the GIL in its ops, so
the worker's event loop stays responsive); `generate()` is an async generator fed from that
thread with `loop.call_soon_threadsafe`. A lock guards the scheduler and block tables; the
step loop holds it only to plan a step and to apply its results, never during the forward
pass, so `cancel()` frees a sequence's blocks at once. That is safe mid-pass: the pass
writes only into blocks its sequences own exclusively, and freed blocks are handed out
again only by the next plan, after the pass.

    generate() ──add──▶ BatchScheduler ◀──schedule/update── step thread ──▶ ModelRunner ──▶ model
        ▲                                                   │
        └──── GenerationOutput (call_soon_threadsafe) ◀─────┘  TextStream: text + stop strings
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
import torch

from shoal.kernels import ops
from shoal.kernels.ops import KernelBackend
from shoal.services.worker.device_errors import is_fatal_device_error
from shoal.services.worker.engine import packed_linear
from shoal.services.worker.engine.attention import ATTN_IMPLEMENTATION, register_attention
from shoal.services.worker.engine.batch_scheduler import (
    BatchScheduler,
    BatchSchedulerConfig,
    SequenceUpdate,
    StepPlan,
)
from shoal.services.worker.engine.cost_profile import get_cost_profile, get_profile_key
from shoal.services.worker.engine.engine_config import EngineConfig, EngineStats
from shoal.services.worker.engine.model_runner import ModelRunner
from shoal.services.worker.engine.native_forward import PackedModel, get_unsupported_reason, pack_model
from shoal.services.worker.engine.outputs import Outbox, RequestState, Tokens
from shoal.services.worker.engine.packed_load import restore_parameters
from shoal.services.worker.engine.sampler import (
    SamplingState,
    TokenHistory,
    sample,
    token_logprobs,
    token_scores,
)
from shoal.services.worker.engine.sequence import Sequence
from shoal.services.worker.engine.session_kv import SessionKV
from shoal.services.worker.engine.sizing import (
    get_max_model_len,
    get_reserve_bytes,
    make_thread_policy,
    size_pool,
)
from shoal.services.worker.engine.structured import Grammars
from shoal.services.worker.engine.thinking import ThinkingBudget, forced_end
from shoal.services.worker.engine.warm_up import get_warm_up_lengths, warm_up
from shoal.services.worker.generation import (
    EngineFailed,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    RequestRejected,
    TextStream,
    TokenLogprobs,
    check_fits_context,
    embedding_bytes,
)
from shoal.shared.kv_cache.block_pool import BlockPool
from shoal.shared.kv_cache.cost_model import CostProfile
from shoal.shared.kv_cache.manager import KVCacheManager
from shoal.shared.kv_cache.session_cache import SessionCache, SessionCacheConfig, SessionInfo
from shoal.shared.model_memory import (
    get_model_shape,
)

log = structlog.get_logger(__name__)

PROMPT_TAIL_TOKENS = 32
"""Tokens of a prompt's end decoded to find a reasoning end marker there."""


SESSION_EXPIRY_INTERVAL_S = 1.0
"""How often an idle engine with cached sessions looks for expired ones."""


_DEFAULT_CONFIG = EngineConfig()


class PagedEngine:
    """Continuous batching over a paged KV cache for one loaded Hugging Face model.

    Args:
        model: a loaded transformers causal LM (Llama, Qwen2, Mistral style); its
            attention implementation is switched to Shoal's paged attention.
        tokenizer: its tokenizer (for text deltas and stop strings).
        allocation_bytes: the replica's GPU (or virtual GPU) bytes; the pool gets what
            weights, activations and runtime overhead leave. Ignored when
            `config.num_blocks` is set.
        config: engine limits.
        max_model_len: the serving limit on prompt + completion; None uses the model's.
        session_clock: seconds, monotonic: the session cache's clock (idle times, expiry).

    Raises:
        KernelBuildError: the model is on CUDA and Shoal's kernels cannot be built (see
            `shoal.kernels.ops.prepare`).
        KVPoolTooSmall: the allocation leaves no KV block.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        allocation_bytes: int | None = None,
        config: EngineConfig = _DEFAULT_CONFIG,
        max_model_len: int | None = None,
        session_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._grammars = Grammars(tokenizer)
        self.kernels: KernelBackend = ops.prepare(next(model.parameters()).device)
        """Which implementation runs the KV ops; on CUDA the kernels are built here, before
        any request (`ops.prepare` raises `KernelBuildError` when they cannot be)."""
        register_attention()
        # Each walks every module (0.2-0.5 ms for llama-100m): a wake onto another allocation
        # rebuilds the engine around a model already set up.
        if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if model.training:
            model.eval()
        packed: PackedModel | None = None
        self.forward: str = "transformers"
        """What runs the forward passes: "native" (`native_forward`) or "transformers"."""
        self.forward_reason: str | None = None
        """Why not "native", on the CPU."""
        on_cpu = next(model.parameters()).device.type == "cpu"
        if on_cpu:
            if config.kernels_path:
                self.forward_reason = "EngineConfig.kernels_path is on (the CUDA attention path, on the CPU)"
            elif not config.native_forward:
                self.forward_reason = "EngineConfig.native_forward is off"
            else:
                self.forward_reason = get_unsupported_reason(model)
            if self.forward_reason is None:
                packed = pack_model(model)
                self.forward = "native"
        if packed is not None:
            self.packed_weight_bytes = packed.nbytes
        else:
            restore_parameters(model)  # a model loaded packed (packed_load) runs without its panels
            self.packed_weight_bytes = (
                packed_linear.pack_linear_weights(model) if config.pack_cpu_linear_weights and on_cpu else 0
            )
            if self.packed_weight_bytes:
                packed_linear.warm_up(model, min(config.max_num_seqs, packed_linear.EXACT_ROWS))
        """Weight bytes moved out of the model's parameters into packed tensors (CPU): the
        native forward's panels, or oneDNN's."""
        self.reserve_bytes = get_reserve_bytes(model.config, next(model.parameters()).dtype, config)
        """Activations of one full step plus runtime overhead: kept out of the KV pool."""
        num_blocks = config.num_blocks or size_pool(
            model,
            allocation_bytes,
            packed_weight_bytes=self.packed_weight_bytes,
            reserve_bytes=self.reserve_bytes,
            block_size=config.block_size,
        )
        if config.max_kv_cache_tokens:
            num_blocks = min(num_blocks, max(1, -(-config.max_kv_cache_tokens // config.block_size)))
        block_bytes = get_model_shape(model.config, next(model.parameters()).dtype).get_kv_bytes_per_block(
            config.block_size
        )
        num_host_blocks = config.sessions.host_pool_bytes // block_bytes if config.sessions else 0
        self._runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            num_host_blocks,
            packed_model=packed,
            threads=make_thread_policy(config.cpu_threads),
            layer_devices=[torch.device(label) for label in config.kv_layer_devices]
            if config.kv_layer_devices
            else None,
            kernels_path=config.kernels_path or None,
            swap_in_by_layer=config.sessions.swap_in_by_layer if config.sessions else "auto",
        )
        self.max_model_len = get_max_model_len(model.config, max_model_len, num_blocks * config.block_size)
        self.num_warm_up_tokens = 0
        """Tokens of the warm-up pass run at construction (0: none)."""
        if config.warm_up:
            started = time.perf_counter()
            # With the torch threads the step thread runs with (`_run_steps`): the pass it
            # warms, without a fork/join per small op (on a busy host each waits for a core:
            # 8 ms for one 16 x 16 mask on the development VM).
            previous_threads = torch.get_num_threads()
            if self.forward == "native":
                torch.set_num_threads(1)
            try:
                self.num_warm_up_tokens = warm_up(
                    self._runner,
                    num_blocks,
                    get_warm_up_lengths(
                        on_cuda=self._runner.device.type == "cuda",
                        max_num_batched_tokens=config.max_num_batched_tokens,
                        max_num_seqs=config.max_num_seqs,
                        pool_tokens=num_blocks * config.block_size,
                        max_model_len=self.max_model_len,
                    ),
                )
            finally:
                torch.set_num_threads(previous_threads)
            log.info(
                "engine.warmed_up",
                num_tokens=self.num_warm_up_tokens,
                seconds=round(time.perf_counter() - started, 3),
            )
        self.cost_profile: CostProfile | None = None
        """The session cache's cost model and what it was measured for (None without one)."""
        if config.sessions is not None:
            self.cost_profile = get_cost_profile(
                self._runner,
                num_blocks,
                config.sessions,
                key=get_profile_key(model.config, self._runner.dtype, self._runner.device, config.block_size),
                max_pass_tokens=config.max_num_batched_tokens,
                max_context_tokens=self.max_model_len,
            )
        self._num_host_blocks = num_host_blocks
        self._session_clock = session_clock
        self._reset_kv_state(num_blocks)
        self._suspended = False
        self._requests: dict[str, RequestState] = {}
        self._embedding_ids: set[str] = set()
        """Embedding requests in the engine: a step looks for their rows only while there are any."""
        self._arrivals = itertools.count()
        self._mean_request_blocks = 1.0
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._closed = False
        self._num_steps = 0
        self._num_step_seqs = 0
        self._step_seconds = 0.0
        self.fatal_error: Exception | None = None
        """The CUDA error that ended the engine (`_die`); None while it serves."""
        self._pending: Outbox | None = None
        """A step's outputs, sent when the next pass starts (`_send_pending`), under the lock."""
        self._start_steps()
        log.info(
            "engine.started",
            num_blocks=num_blocks,
            block_size=config.block_size,
            kv_cache_tokens=num_blocks * config.block_size,
            kv_cache_bytes=self._runner.kv_cache_bytes,
            max_model_len=self.max_model_len,
            prefix_caching=config.enable_prefix_caching,
            kernels=self.kernels,
            host_pool_bytes=self._runner.host_cache_bytes,
            forward=self.forward,
            forward_reason=self.forward_reason,
            threads=self._runner.threads.fixed or f"auto (1-{self._runner.threads.max_threads})",
        )

    def _reset_kv_state(self, num_blocks: int) -> None:
        """A fresh block pool, prefix cache, session cache and scheduler over the runner's
        pool: nothing cached, nothing running."""
        config = self.config
        self._pool = BlockPool(num_blocks, config.block_size, self._runner.kv_cache_bytes // num_blocks)
        self._kv_cache = KVCacheManager(self._pool, enable_prefix_caching=config.enable_prefix_caching)
        self._sessions: SessionKV | None = None
        if config.sessions is not None and self.cost_profile is not None:
            self._sessions = SessionKV(
                SessionCache(
                    SessionCacheConfig(
                        block_size=config.block_size,
                        blocks_per_chunk=config.sessions.blocks_per_chunk,
                        gpu_budget_blocks=int(num_blocks * config.sessions.gpu_fraction),
                        cpu_budget_blocks=self._num_host_blocks,
                        idle_timeout_s=config.sessions.idle_timeout_s,
                        min_idle_s=config.sessions.min_idle_s,
                        copy_ahead_free_blocks=int(num_blocks * config.sessions.copy_ahead_free_fraction),
                    ),
                    self.cost_profile.cost_model,
                    self._session_clock,
                ),
                self._kv_cache,
                self._runner.kv_cache_bytes // num_blocks,
            )
        self._scheduler = BatchScheduler(
            BatchSchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
            self._kv_cache,
            self._sessions,
        )

    # ------------------------------------------------------------------ Engine protocol

    def num_free_slots(self) -> int:
        """Requests the engine can admit now: bounded by `max_num_seqs` and by free KV blocks
        (after the waiting requests' prompts) over the mean blocks of recent requests."""
        with self._lock:
            free_seqs = self.config.max_num_seqs - self._scheduler.get_num_unfinished()
            free_blocks = self._pool.get_num_free_blocks() - self._scheduler.get_num_waiting_blocks()
            if self._sessions is not None:  # cached sessions' blocks give way to requests
                free_blocks += self._sessions.get_num_gpu_blocks()
            return max(0, min(free_seqs, int(free_blocks // self._mean_request_blocks)))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Run `request`; yields text deltas, then one output with ``finished=True``.

        Raises:
            RequestRejected: before any output, when the prompt is empty, longer than the
                model or the KV pool takes (400), or the request id is in use.
            EngineFailed: a CUDA error poisoned the engine's context (`device_errors`),
                before or while the request ran.
        """
        state = self._admit(request)
        stream, num_unsent = state.text, 0
        logprobs: list[TokenLogprobs] = []  # of the unsent tokens
        scores_prompt = request.params.prompt_logprobs is not None

        def first_carries_prompt(output: GenerationOutput) -> GenerationOutput:
            nonlocal scores_prompt
            if not scores_prompt:
                return output
            scores_prompt = False
            return dataclasses.replace(output, prompt_logprobs=tuple(state.prompt_logprobs))

        try:
            while True:
                item = await state.queue.get()
                if self.fatal_error is not None and _is_error_end(item):
                    raise EngineFailed(f"the engine died: {self.fatal_error}") from self.fatal_error
                if isinstance(item, GenerationOutput):
                    yield first_carries_prompt(item)
                    if item.finished:
                        return
                    continue
                # tokens the step thread left for us to detokenize (no stop strings)
                text = ""
                for token_id in item.token_ids:
                    num_unsent += 1
                    text += stream.push(token_id)
                logprobs += item.logprobs
                final = item.final
                if final is not None:
                    if final.finish_reason != "cancelled":
                        text += stream.finish()
                    yield first_carries_prompt(dataclasses.replace(
                        final, text=text, num_new_tokens=num_unsent, token_hash=stream.token_hash,
                        logprobs=tuple(logprobs)))
                    return
                if text or scores_prompt:
                    yield first_carries_prompt(GenerationOutput(
                        request.request_id, text, num_unsent, token_hash=stream.token_hash, logprobs=tuple(logprobs)))
                    num_unsent = 0
                    logprobs.clear()
        finally:
            if not state.finished:  # the consumer went away: stop generating for it
                self.cancel(request.request_id)

    def cancel(self, request_id: str) -> bool:
        """Stop `request_id` now and free its KV blocks; False if it is not running here."""
        outbox = Outbox()
        with self._lock:
            self._send_pending()  # what the request already generated comes first
            state = self._requests.get(request_id)
            if state is None or state.finished:
                return False
            self._scheduler.finish(request_id, "cancelled")
            self._finish(state, "cancelled", outbox)
        outbox.send()
        return True

    async def close(self) -> None:
        """Stop the step thread; unfinished requests end with "cancelled"."""
        with self._lock:
            self._closed = True
        await self._stop_steps()

    async def suspend(self) -> None:
        """Parks the engine for a sleep: the step thread stops, unfinished requests end with
        "cancelled" (as in `close`), every cached block and session is forgotten and the KV
        pool's memory goes back (`ModelRunner.release_kv`). The rest (the packed model, the
        plans' buffers, the cost profile) stays for `resume`: a wake onto the same allocation
        then builds nothing. Requests are refused (503) until then."""
        with self._lock:
            self._suspended = True
        await self._stop_steps()
        with self._lock:
            self._reset_kv_state(self._pool.num_blocks)
            self._runner.release_kv()

    def resume(self) -> None:
        """Serves again after `suspend`: the KV pool back (zeroed, the same size) and the step
        thread started."""
        with self._lock:
            if not self._suspended or self._closed:
                raise RuntimeError("only a suspended engine resumes")
            self._runner.restore_kv()
            self._suspended = False
        self._start_steps()

    def _start_steps(self) -> None:
        self._thread = threading.Thread(target=self._run_steps, name="shoal-engine", daemon=True)
        self._thread.start()

    @property
    def suspended(self) -> bool:
        """Parked by `suspend` (until `resume`)."""
        return self._suspended

    async def _stop_steps(self) -> None:
        """Joins the step thread (told to stop by `_closed` or `_suspended`); unfinished
        requests end with "cancelled"."""
        with self._lock:
            self._wakeup.notify()
        await asyncio.to_thread(self._thread.join)
        outbox = Outbox()
        with self._lock:
            self._send_pending()
            for state in list(self._requests.values()):
                self._scheduler.finish(state.request.request_id, "cancelled")
                self._finish(state, "cancelled", outbox)
        outbox.send()

    # ------------------------------------------------------------------ introspection

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV block pool's tensor."""
        return self._runner.kv_cache_bytes

    @property
    def held_bytes(self) -> int:
        """What the engine holds on its device besides the weights: the KV pool and the
        activation reserve (the session cache's host pool is host memory)."""
        return self._runner.kv_cache_bytes + self.reserve_bytes

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV block pool holds (all sequences together)."""
        return self._pool.num_blocks * self.config.block_size

    def get_stats(self) -> EngineStats:
        with self._lock:
            sessions = None if self._sessions is None else self._sessions.get_stats()
            return EngineStats(
                pool=self._pool.get_stats(),
                num_running=self._scheduler.get_num_running(),
                num_waiting=self._scheduler.get_num_waiting(),
                num_preemptions=self._scheduler.get_num_preemptions(),
                sessions=sessions,
                num_steps=self._num_steps,
                num_step_seqs=self._num_step_seqs,
                step_seconds=self._step_seconds,
            )

    # ------------------------------------------------------------------ sessions

    def list_sessions(self) -> list[SessionInfo]:
        """Sessions whose KV this engine holds between turns, least recently active first
        (empty without a session cache), after forgetting those idle too long. A session
        with a turn running is not listed: its KV belongs to the turn until it ends."""
        with self._lock:
            if self._sessions is None:
                return []
            self._sessions.expire()
            return self._sessions.get_sessions()

    def get_active_session_ids(self) -> set[str]:
        """Sessions with a turn in the engine now (running or waiting)."""
        with self._lock:
            return {state.request.session_id for state in self._requests.values() if state.request.session_id}

    def drop_session(self, session_id: str) -> bool:
        """Forget a cached session's KV now; False if none is cached (a running turn's KV
        is kept when it ends)."""
        with self._lock:
            return self._sessions is not None and self._sessions.drop(session_id)

    # ------------------------------------------------------------------ admission

    def _admit(self, request: GenerationRequest) -> RequestState:
        num_prompt_tokens = len(request.prompt_token_ids)
        max_model_len = min(self.max_model_len, request.max_model_len or self.max_model_len)
        if num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty", 400)
        params = request.params
        check_fits_context(num_prompt_tokens, max_model_len, params, "the model's context or its KV pool")
        if params.min_tokens and params.has_grammar:
            raise RequestRejected(f"min_tokens cannot be combined with {params.grammar_param}: the grammar's end "
                                  "ends the answer", 400, param="min_tokens")
        eos_token_ids = request.ending_token_ids
        sampling = SamplingState.from_params(params, eos_token_ids)
        if params.has_grammar:
            sampling.matcher = self._grammars.matcher(params)
            sampling.grammar_waits = (params.grammar_after is not None
                                      and not self._prompt_ends_with(request.prompt_token_ids, params.grammar_after))
        thinking = self._thinking_budget(request)
        if thinking is not None:
            if params.has_grammar and params.grammar_after is None:
                raise RequestRejected(f"a thinking budget cannot be combined with {params.grammar_param} shaping the "
                                      "whole answer: the grammar leaves no think block to cut", 400,
                                      param="thinking_token_budget")
            sampling.forced.extend(thinking.at_start())
        max_num_tokens = min(max_model_len, num_prompt_tokens + (1 if params.embed else max(1, params.max_tokens)))
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.fatal_error is not None:
                raise EngineFailed(f"the engine died: {self.fatal_error}") from self.fatal_error
            if self._closed:
                raise RequestRejected("the engine is shutting down", 503)
            if self._suspended:
                raise RequestRejected("the replica is asleep", 503)
            if request.request_id in self._requests:
                raise RequestRejected(
                    f"request id {request.request_id!r} is already running", 400, param="request_id"
                )
            seq = Sequence(
                request.request_id,
                list(request.prompt_token_ids),
                num_prompt_tokens,
                max_num_tokens,
                next(self._arrivals),
                eos_token_ids,
                session_id=request.session_id,
                prompt_logprobs=params.prompt_logprobs,
            )
            state = RequestState(
                request,
                seq,
                sampling,
                TextStream(self._tokenizer, params.stop, params.min_tokens),
                loop,
                asyncio.Queue(),
                thinking=thinking,
                detokenize_in_step=bool(params.stop) or sampling.grammar_waits or thinking is not None,
            )
            self._requests[request.request_id] = state
            if params.embed:
                self._embedding_ids.add(request.request_id)
            self._scheduler.add(seq)
            request_blocks = self._kv_cache.get_num_blocks_for(max_num_tokens)
            self._mean_request_blocks += 0.1 * (request_blocks - self._mean_request_blocks)
            self._wakeup.notify()
        return state

    # ------------------------------------------------------------------ the step thread

    def _run_steps(self) -> None:
        if self.forward == "native":
            # torch's ops in this thread are small (inputs, sampling): one thread each, no
            # fork/join per op (the native forward has threads of its own; `torch_threads`
            # still applies to torch work in other threads). Per thread, not process-wide.
            torch.set_num_threads(1)
        while True:
            try:
                if not self._step():
                    return
            except Exception as exc:  # a bug: end every request with an error rather than hang them
                if is_fatal_device_error(exc):  # a kernel's error surfaces at the next sync, anywhere
                    self._die(exc)
                    return
                log.exception("engine.step_failed")
                self._fail(list(self._requests), exc)

    def _step(self) -> bool:
        """Plan, run and apply one forward pass; False once the engine is closed."""
        with self._lock:
            while not self._stopping() and not self._scheduler.get_num_unfinished():
                self._send_pending()
                self._runner.rest()
                if self._sessions is not None and self._sessions.get_stats().num_sessions:
                    # Idle with sessions cached: wake now and then to forget expired ones.
                    self._sessions.expire()
                    self._wakeup.wait(timeout=SESSION_EXPIRY_INTERVAL_S)
                else:
                    self._wakeup.wait()
            if self._stopping():
                self._send_pending()
                return False
            if self._sessions is not None:
                self._sessions.expire()
                self._sessions.copy_ahead()
            plan = self._scheduler.schedule()
            if plan.is_empty:
                # Only when every unfinished request waits for blocks no one will free:
                # admission rejects such prompts, so this is a bug; don't spin on it.
                log.error("engine.empty_plan", num_waiting=self._scheduler.get_num_waiting())
                self._send_pending()
                self._wakeup.wait(timeout=0.1)
                return True
            step = self._runner.prepare(plan, self._kv_cache)
            sampled = [chunk.seq for chunk in plan.chunks if chunk.samples]
            sampling_states = [self._requests[seq.seq_id].sampling for seq in sampled]
            embedding_rows = ([row for row, seq in enumerate(sampled) if seq.seq_id in self._embedding_ids]
                              if self._embedding_ids else [])
            self._runner.want_hidden = bool(embedding_rows)
            histories = None
            if any(state.has_penalties for state in sampling_states):
                # The lists themselves: only this thread appends to them (`update`, below).
                histories = [TokenHistory(seq.token_ids, seq.num_prompt_tokens) for seq in sampled]
            # The previous step's outputs go now, not when that step ended: their consumers
            # (detokenization, NATS) then run on the event loop while this pass runs without
            # the GIL, instead of holding the GIL the step thread needs to start the pass.
            self._send_pending()
        started = time.perf_counter()
        try:
            logits = self._runner.execute(step)
            prompt_scores = self._score_prompts(plan)
            token_ids = sample(logits, sampling_states, histories, self._runner.last_argmax)
            logprobs = token_logprobs(logits, sampling_states, token_ids)
            embeddings = self._embeddings(sampled, embedding_rows)
        except Exception as exc:  # a failed pass fails its requests, not the engine...
            if is_fatal_device_error(exc):  # ...unless the GPU context is poisoned
                self._die(exc)
                return False
            log.exception("engine.forward_failed", num_seqs=len(plan.chunks))
            if self._sessions is not None:
                with self._lock:
                    self._sessions.end_step(self._runner.take_swap_in_seconds())
            self._fail([chunk.seq.seq_id for chunk in plan.chunks], exc)
            return True
        elapsed = time.perf_counter() - started
        outbox = Outbox()
        with self._lock:
            if self._sessions is not None:
                self._sessions.end_step(self._runner.take_swap_in_seconds())
            self._num_steps += 1
            self._num_step_seqs += len(plan.chunks)
            self._step_seconds += elapsed
            has_first_token = False
            for seq, scores in prompt_scores:
                if (scored := self._requests.get(seq.seq_id)) is not None:
                    scored.prompt_logprobs += scores
            logprobs_by_seq = {} if logprobs is None else {
                seq.seq_id: entry for seq, entry in zip(sampled, logprobs, strict=True) if entry is not None}
            for update in self._scheduler.update(plan, token_ids):
                if (embedding := embeddings.get(update.seq.seq_id)) is not None:
                    self._finish(self._requests[update.seq.seq_id], "stop", outbox, embedding=embedding)
                    continue
                self._emit(update, outbox, logprobs_by_seq.get(update.seq.seq_id))
                has_first_token = has_first_token or update.seq.num_output_tokens == 1
            if has_first_token:
                # A request's first token goes at once, not after the next pass is planned: time
                # to first token counts it, and it comes once per request.
                self._send_pending()
                outbox.send()
            else:
                self._pending = outbox
        if has_first_token:
            # ...and this thread steps aside for the thread that carries it out. Woken on this
            # thread's CPU (Linux places a wakee next to its waker), the event loop otherwise
            # waited for the scheduler's tick behind the next pass: 2.4-4.9 ms for one first
            # token in four (docs/engine.md, "Threads").
            os.sched_yield()
        return True

    def _score_prompts(self, plan: StepPlan) -> list[tuple[Sequence, list[TokenLogprobs]]]:
        """The scores of the prompt rows the last pass kept (`ModelRunner.last_prompt_logits`),
        each sequence's count of scored rows moved on (this thread alone changes it)."""
        scores = []
        for rows, rows_logits in self._runner.last_prompt_logits:
            seq = plan.chunks[rows.chunk].seq
            assert seq.prompt_logprobs is not None, "rows are kept for sequences that score their prompt"
            start = rows.first_position + 1
            scores.append((seq, token_scores(rows_logits, seq.token_ids[start:start + rows.count],
                                             seq.prompt_logprobs)))
            seq.num_scored_prompt_rows = rows.first_position + rows.count
        return scores

    def _embeddings(self, sampled: list[Sequence], rows: list[int]) -> dict[str, bytes]:
        """The embedding requests' vectors, by sequence, from their rows' final hidden states
        (`ModelRunner.last_hidden`)."""
        if not rows:
            return {}
        hidden = self._runner.last_hidden
        assert hidden is not None, "the pass kept its hidden states (want_hidden)"
        vectors = {}
        for row in rows:
            state = self._requests.get(sampled[row].seq_id)  # None: cancelled meanwhile (its vector goes nowhere)
            vectors[sampled[row].seq_id] = embedding_bytes(hidden[row], state is None or
                                                           state.request.params.embed_normalize)
        return vectors

    def _prompt_tail(self, prompt_token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))

    def _prompt_ends_with(self, prompt_token_ids: list[int], marker: str) -> bool:
        """The prompt's text ends with `marker` (blanks after it aside): its reasoning is over
        before the answer starts (a template that turns thinking off closes the block)."""
        return self._prompt_tail(prompt_token_ids).rstrip().endswith(marker)

    def _thinking_budget(self, request: GenerationRequest) -> ThinkingBudget | None:
        """The request's thinking budget, if it has one and its prompt leaves a block to think in."""
        params = request.params
        if params.thinking_budget is None:
            return None
        forced_ids = tuple(self._tokenizer.encode(forced_end(params.thinking_end), add_special_tokens=False))
        return ThinkingBudget.start(max(0, params.thinking_budget), params.thinking_start, params.thinking_end,
                                    forced_ids, self._prompt_tail(request.prompt_token_ids))

    @staticmethod
    def _watch_reasoning_end(state: RequestState) -> None:
        """The text so far completes the reasoning's end marker: the grammar applies from the next token."""
        marker = state.request.params.grammar_after
        assert marker is not None, "only a request whose grammar waits for a marker is watched"
        text = state.text.text
        if text.find(marker, state.marker_search_from) >= 0:
            state.sampling.grammar_waits = False
        state.marker_search_from = max(0, len(text) - len(marker) + 1)

    def _stopping(self) -> bool:
        """The step thread is to end (closed, or suspended for a park)."""
        return self._closed or self._suspended

    def _emit(self, update: SequenceUpdate, outbox: Outbox, logprobs: TokenLogprobs | None) -> None:
        """Turn a new token into text; end the request on a stop string or a finish reason."""
        state = self._requests[update.seq.seq_id]
        if logprobs is not None:
            state.unsent_logprobs.append(logprobs)
        if not state.detokenize_in_step:
            if update.finish_reason is not None:
                self._finish(state, update.finish_reason, outbox, token_ids=(update.token_id,))
            else:
                outbox.put(state, Tokens((update.token_id,), logprobs=self._take_logprobs(state)))
            return
        state.num_unsent_tokens += 1
        delta = state.text.push(update.token_id)
        if state.thinking is not None:
            state.sampling.forced.extend(state.thinking.after_token(state.text.text))
            if state.thinking.phase == "done":
                state.thinking = None
        if state.sampling.grammar_waits and not state.sampling.forced:  # the grammar starts after a forced close
            self._watch_reasoning_end(state)
        if state.text.stopped:
            self._scheduler.finish(update.seq.seq_id, "stop")
            self._finish(state, "stop", outbox)
        elif update.finish_reason is not None:
            self._finish(state, update.finish_reason, outbox, delta=delta)
        elif delta:
            outbox.put(state, GenerationOutput(state.request.request_id, delta, state.num_unsent_tokens,
                                               token_hash=state.text.token_hash,
                                               logprobs=self._take_logprobs(state)))
            state.num_unsent_tokens = 0

    @staticmethod
    def _take_logprobs(state: RequestState) -> tuple[TokenLogprobs, ...]:
        """The log probabilities of the tokens an output now carries (forgotten here)."""
        if not state.unsent_logprobs:
            return ()
        taken = tuple(state.unsent_logprobs)
        state.unsent_logprobs.clear()
        return taken

    def _finish(
        self,
        state: RequestState,
        finish_reason: FinishReason,
        outbox: Outbox,
        *,
        delta: str = "",
        error: str | None = None,
        token_ids: tuple[int, ...] = (),
        embedding: bytes | None = None,
    ) -> None:
        """Ends a request: its last output (or, detokenized by its consumer, its last tokens
        and that output without its text); an embedding request's, its vector and no text."""
        state.finished = True
        del self._requests[state.request.request_id]
        self._embedding_ids.discard(state.request.request_id)
        if embedding is not None:
            outbox.put(state, GenerationOutput(
                state.request.request_id, "", 0, finished=True, finish_reason=finish_reason,
                num_prompt_tokens=state.seq.num_prompt_tokens, num_cached_tokens=state.seq.num_cached_tokens or 0,
                embedding=embedding))
            return
        final = GenerationOutput(
            state.request.request_id,
            "",
            state.num_unsent_tokens,
            finished=True,
            finish_reason=finish_reason,
            num_prompt_tokens=state.seq.num_prompt_tokens,
            num_completion_tokens=state.seq.num_output_tokens,
            num_cached_tokens=state.seq.num_cached_tokens or 0,
            error=error,
            token_hash=state.text.token_hash,
        )
        if not state.detokenize_in_step:
            outbox.put(state, Tokens(token_ids, final, self._take_logprobs(state)))
            return
        text = delta + (state.text.finish() if finish_reason != "cancelled" else "")
        outbox.put(state, dataclasses.replace(final, text=text, logprobs=self._take_logprobs(state),
                                              stop_reason=state.text.stopped_by))

    def _send_pending(self) -> None:
        """Sends the last step's outputs if not yet sent (call under the lock)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.send()

    def _die(self, exc: Exception) -> None:
        """A CUDA error poisoned the context: nothing can run here any more. Every request
        ends (its consumer raises `EngineFailed`), new ones are refused the same way, and
        the step thread stops. The error's text (a device-side assert's marker included)
        goes to the log, where the node agent reads it."""
        log.error("engine.device_error", error=str(exc), num_requests=len(self._requests))
        with self._lock:
            self.fatal_error = exc
            self._closed = True
        self._fail(list(self._requests), exc)

    def _fail(self, seq_ids: list[str], exc: Exception) -> None:
        outbox = Outbox()
        with self._lock:
            self._send_pending()
            for seq_id in seq_ids:
                state = self._requests.get(seq_id)
                if state is not None and not state.finished:
                    self._scheduler.finish(seq_id, "error")
                    self._finish(state, "error", outbox, error=f"{type(exc).__name__}: {exc}")
        outbox.send()


def _is_error_end(item: GenerationOutput | Tokens) -> bool:
    """Whether `item` ends its request with an error."""
    final = item.final if isinstance(item, Tokens) else item
    return final is not None and final.finished and final.finish_reason == "error"
