"""Where a decode step of Shoal's paged engine spends its time, on the CPU.

Two views, both for C concurrent requests of ~64 prompt tokens and 128 output tokens:

``--mode engine`` (default): the engine alone (no NATS, as `bench_engine.py` drives it).
  Pass 1, timers only: every phase of each pure-decode step (`PagedEngine._step`) timed
  with perf_counter and the step thread's CPU clock: scheduling, metadata (the runner's
  `prepare`, with the CPU attention plan), the forward pass, sampling, the scheduler's
  update, detokenization and output building (`_emit`, with `TextStream.push`), and the
  hand-off to the event loop; plus the CPU time of the event-loop thread that consumes
  the outputs. Pass 2, the torch profiler over the same workload with a named scope
  around every module and function of the forward pass; each ATen op's own time goes to
  its innermost scope's category, and each scope's own time (outside any op) is Python:
  matmuls, lm_head, attention (native write_kv and decode kernel, and their Python),
  norms, rotary, activation, embedding, other ops, Python between ops.

``--mode worker``: the same requests through `shoal up` (gateway, NATS, worker): CPU
  seconds of every process per output token (/proc), and py-spy samples of the worker's
  threads (step thread vs event loop: NATS, msgspec, asyncio).

    python scripts/profile_decode.py --models demo/llama-5m,demo/llama-100m --concurrency 1,32
    python scripts/profile_decode.py --mode worker --models demo/llama-5m --concurrency 1,32
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GiB = 1 << 30
SCOPE = "shoal::"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["engine", "worker"], default="engine")
    parser.add_argument("--models", default="demo/llama-5m,demo/llama-100m")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the peer benchmark's 2)")
    parser.add_argument("--allocation-gib", type=float, default=4.0,
                        help="the replica's memory: weights, activations and the KV pool (4 GiB: room for every "
                             "request of the default workload)")
    parser.add_argument("--kv-cache-tokens", type=int, default=0,
                        help="cap the KV pool at this many tokens (0: no cap; `shoal up` caps at 4,096)")
    parser.add_argument("--forward", choices=["native", "transformers"], default="native",
                        help="the engine's forward pass: Shoal's native C code (default, as shipped) or the model's "
                             "transformers modules (passes 2 and 3 split only that one)")
    parser.add_argument("--cpu-threads", default="auto", help="EngineConfig.cpu_threads: auto or a number")
    parser.add_argument("--dtype", default="float32",
                        help="engine mode: the weights' dtype, or several (float32,bfloat16) each in turn; "
                             "bfloat16 loads packed with bf16 panels (packed_load), computes in float32")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per level (pass 1); the median step is kept")
    parser.add_argument("--models-root", type=Path,
                        default=Path(os.environ.get("SHOAL_TEST_MODELS_ROOT", REPO / "models")))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--spy-dir", type=Path, help="worker mode: keep py-spy's raw samples here")
    return parser.parse_args(argv)


def make_prompts(tokenizer: Any, num: int, num_tokens: int, first: int) -> list[list[int]]:
    """Token ids cut from the demo corpus, each starting at a different place (no prefix hits)."""
    ids = tokenizer.encode((REPO / "cli" / "demo_corpus.txt").read_text())
    return [[ids[(997 * (first + k) + i) % len(ids)] for i in range(num_tokens)] for k in range(num)]


# --- pass 1: phase timers ---------------------------------------------------------------------------


class PhaseTimer:
    """Wraps engine methods to time each phase of the step the step thread is running."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] | None = None
        self._decode_only = False

    def wrap(self, owner: Any, name: str, phase: str) -> Callable[[], None]:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if self._current is not None and threading.current_thread().name == "shoal-engine":
                    self._current[phase] = self._current.get(phase, 0.0) + time.perf_counter() - started

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    def wrap_step(self, engine: Any) -> Callable[[], None]:
        original = engine._step

        def step() -> bool:
            self._current = {}
            started, cpu_started = time.perf_counter(), time.thread_time()
            try:
                return bool(original())
            finally:
                record = self._current
                record["step"] = time.perf_counter() - started
                record["step_cpu"] = time.thread_time() - cpu_started
                if self._decode_only and "forward" in record:
                    self.steps.append(record)
                self._current = None

        engine._step = step
        return lambda: setattr(engine, "_step", original)

    def wrap_schedule(self, scheduler: Any) -> Callable[[], None]:
        original = scheduler.schedule

        def schedule() -> Any:
            started = time.perf_counter()
            plan = original()
            self._decode_only = bool(plan.chunks) and all(c.num_new_tokens == 1 for c in plan.chunks)
            if self._current is not None:
                self._current["schedule"] = time.perf_counter() - started
                self._current["num_seqs"] = len(plan.chunks)
            return plan

        scheduler.schedule = schedule
        return lambda: setattr(scheduler, "schedule", original)


def serve(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """All prompts at once through `engine.generate`; (wall s, CPU s of this event-loop thread)."""
    from shoal.services.worker.generation import GenerationRequest
    from shoal.shared.messages import SamplingParams

    async def run() -> None:
        async def one(index: int) -> None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for output in engine.generate(GenerationRequest(f"p{time.monotonic_ns()}-{index}",
                                                                  prompts[index], params)):
                last = output
            assert last.num_completion_tokens == max_tokens, last

        await asyncio.gather(*(one(i) for i in range(len(prompts))))

    started, cpu_started = time.perf_counter(), time.thread_time()
    asyncio.run(run())
    return time.perf_counter() - started, time.thread_time() - cpu_started


def time_phases(engine: Any, tokenizer: Any, c: int, args: argparse.Namespace) -> dict[str, Any]:
    from shoal.services.worker.engine import outputs, paged_engine
    from shoal.services.worker.generation import TextStream

    timer = PhaseTimer()
    undo = [
        timer.wrap_step(engine),
        timer.wrap_schedule(engine._scheduler),
        timer.wrap(engine._runner, "prepare", "metadata"),
        timer.wrap(engine._runner, "execute", "forward"),
        timer.wrap(paged_engine, "sample", "sampling"),
        timer.wrap(engine._scheduler, "update", "scheduler_update"),
        timer.wrap(engine, "_emit", "emit"),
        timer.wrap(TextStream, "push", "detokenize"),
        timer.wrap(outputs.Outbox, "send", "handoff"),
    ]
    loop_cpu, walls, per_run = [], [], []
    try:
        for run in range(args.runs):
            before = len(timer.steps)
            wall, cpu = serve(engine, make_prompts(tokenizer, c, args.prompt_tokens, 100 * (run + 1)), args.max_tokens)
            walls.append(wall)
            loop_cpu.append(cpu / max(1, len(timer.steps) - before))
            per_run.append(timer.steps[before:])
    finally:
        for restore in reversed(undo):
            restore()
    steps = [s for run in per_run[1:] or per_run for s in run]  # the first run warms shapes up
    keys = ["step", "step_cpu", "schedule", "metadata", "forward", "sampling", "scheduler_update", "emit",
            "detokenize", "handoff"]
    phases = {k: 1000 * statistics.median(s.get(k, 0.0) for s in steps) for k in keys}
    phases["emit_other"] = phases["emit"] - phases["detokenize"]
    phases["step_glue"] = phases["step"] - sum(phases[k] for k in ("schedule", "metadata", "forward", "sampling",
                                                                   "scheduler_update", "emit", "handoff"))
    return {
        "num_decode_steps": len(steps),
        "mean_batch": statistics.fmean(s["num_seqs"] for s in steps),
        "phases_ms": {k: round(v, 3) for k, v in phases.items()},
        "event_loop_cpu_ms_per_step": round(1000 * statistics.median(loop_cpu[1:] or loop_cpu), 3),
        "tokens_per_s": round(c * args.max_tokens / statistics.median(walls), 1),
    }


# --- pass 2: the forward pass split by category ----------------------------------------------------


CATEGORIES = ("matmul (q/k/v/o, gate/up/down)", "lm_head", "attention: native write_kv",
              "attention: native decode kernel", "attention: Python and small ops around the kernels",
              "norm (RMSNorm)", "rotary", "activation (SiLU)", "embedding",
              "rest of the forward (residual adds, gate*up, reshapes, module calls)")
REST = CATEGORIES[-1]


def _module_label(name: str, module: torch.nn.Module) -> str | None:
    kind = type(module).__name__
    if name == "lm_head":
        return "lm_head"
    if isinstance(module, torch.nn.Linear):
        return "matmul (q/k/v/o, gate/up/down)"
    if kind.endswith("RMSNorm"):
        return "norm (RMSNorm)"
    if kind.endswith("RotaryEmbedding"):
        return "rotary"
    if name.endswith("act_fn"):
        return "activation (SiLU)"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    return None


class CategoryTimer:
    """Wall time of the step thread inside wrapped callables, each moment charged to the
    innermost one (exclusive time), during decode forward passes only."""

    def __init__(self) -> None:
        self.totals: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.active = False
        self._children: list[float] = []

    @contextmanager
    def wrapped(self, owner: Any, name: str, label: str) -> Iterator[None]:
        had_own = name in vars(owner)
        own = vars(owner).get(name)
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return original(*args, **kwargs)
            started = time.perf_counter()
            self._children.append(0.0)
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self.totals[label] += elapsed - self._children.pop()
                if self._children:
                    self._children[-1] += elapsed

        setattr(owner, name, wrapper)
        try:
            yield
        finally:
            if had_own:
                setattr(owner, name, own)
            else:
                delattr(owner, name)


class _AttentionHolder:
    """Holds Shoal's attention function where `CategoryTimer.wrapped` can wrap it."""

    @staticmethod
    def forward(*args: Any, **kwargs: Any) -> Any:
        from shoal.services.worker.engine import attention

        return attention.paged_attention_forward(*args, **kwargs)


@contextmanager
def instrumented_forward(engine: Any, timer: CategoryTimer) -> Iterator[None]:
    """Every module and function of the forward pass wrapped by `timer` (see CATEGORIES)."""
    import contextlib

    from transformers import AttentionInterface
    from transformers.models.llama import modeling_llama

    from shoal.kernels import cpu_kernels
    from shoal.services.worker.engine import attention

    around = "attention: Python and small ops around the kernels"
    with contextlib.ExitStack() as stack:
        for name, module in engine._runner.model.named_modules():
            label = _module_label(name, module)
            if label is not None:
                stack.enter_context(timer.wrapped(module, "forward", label))
        stack.enter_context(timer.wrapped(modeling_llama, "apply_rotary_pos_emb", "rotary"))
        stack.enter_context(timer.wrapped(cpu_kernels.CpuKernels, "write_kv", "attention: native write_kv"))
        stack.enter_context(timer.wrapped(cpu_kernels.DecodePlan, "run", "attention: native decode kernel"))
        stack.enter_context(timer.wrapped(_AttentionHolder, "forward", around))
        AttentionInterface.register(attention.ATTN_IMPLEMENTATION, _AttentionHolder.forward)
        stack.callback(attention.register_attention)
        yield


def time_forward(engine: Any, tokenizer: Any, c: int, args: argparse.Namespace) -> dict[str, Any]:
    """Pass 2: the decode forward passes of one run, split by category with wall-clock wrappers."""
    timer = CategoryTimer()
    phase = PhaseTimer()  # its schedule wrapper says whether the step is pure decode
    undo_schedule = phase.wrap_schedule(engine._scheduler)
    original_execute = engine._runner.execute
    forwards: list[float] = []

    def execute(step: Any) -> Any:
        if not phase._decode_only:
            return original_execute(step)
        timer.active = True
        started = time.perf_counter()
        try:
            return original_execute(step)
        finally:
            forwards.append(time.perf_counter() - started)
            timer.active = False

    engine._runner.execute = execute
    try:
        with instrumented_forward(engine, timer):
            for run in range(2):  # the first run meets new shapes; the second is kept
                timer.totals.clear()
                forwards.clear()
                serve(engine, make_prompts(tokenizer, c, args.prompt_tokens, 900 + 10 * run), args.max_tokens)
    finally:
        engine._runner.execute = original_execute
        undo_schedule()
    num = max(1, len(forwards))
    forward_ms = 1000 * sum(forwards) / num
    split = {k: 1000 * timer.totals[k] / num for k in CATEGORIES}
    split[REST] += forward_ms - sum(split.values())  # outside every wrapper: the model's own glue
    return {"forward_ms_timed": round(forward_ms, 3), "split_ms": {k: round(v, 3) for k, v in split.items()}}


# --- pass 3: ATen ops per decode forward (torch profiler) -------------------------------------------


def count_ops(engine: Any, tokenizer: Any, c: int, args: argparse.Namespace) -> dict[str, Any]:
    """ATen ops per decode forward, and the profiler's own view of how much of it is Python.

    The profiler runs in the step thread (it records the thread that starts it) over a
    window of decode forwards. Its per-op bookkeeping inflates small ops and Python, so its
    times are not reported as the split; its op counts are exact.
    """
    phase = PhaseTimer()
    undo_schedule = phase.wrap_schedule(engine._scheduler)
    original_execute = engine._runner.execute
    state: dict[str, Any] = {"seen": 0, "profiler": None, "events": None}
    first, last = 8, 8 + min(32, args.max_tokens - 16)

    def execute(step: Any) -> Any:
        if not phase._decode_only:
            return original_execute(step)
        state["seen"] += 1
        if state["seen"] == first:
            state["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            state["profiler"].__enter__()
        try:
            if state["profiler"] is None:
                return original_execute(step)
            with torch.profiler.record_function(SCOPE + "forward"):
                return original_execute(step)
        finally:
            if state["seen"] == last and state["profiler"] is not None:
                state["profiler"].__exit__(None, None, None)
                state["events"] = state["profiler"].events()
                state["profiler"] = None

    engine._runner.execute = execute
    try:
        serve(engine, make_prompts(tokenizer, c, args.prompt_tokens, 950), args.max_tokens)
    finally:
        engine._runner.execute = original_execute
        undo_schedule()
    if state["events"] is None:
        raise RuntimeError(f"fewer than {last} decode steps: nothing profiled (raise --max-tokens)")
    forwards = [e for e in state["events"] if e.name == SCOPE + "forward"]
    ops: collections.Counter[str] = collections.Counter()
    own_us = 0.0

    def visit(event: Any, depth: int) -> None:
        nonlocal own_us
        if depth == 1 and not event.name.startswith(SCOPE):
            ops[event.name] += 1  # top-level ops only: what Python dispatched
        if not event.name.startswith(SCOPE):
            own_us += event.self_cpu_time_total
        for child in event.cpu_children:
            visit(child, depth + (0 if event.name.startswith(SCOPE) else 1))

    for forward in forwards:
        for child in forward.cpu_children:
            visit(child, 1)
    num = max(1, len(forwards))
    total_us = sum(e.cpu_time_total for e in forwards) / num
    return {
        "ops_per_forward": round(sum(ops.values()) / num, 1),
        "top_ops": {k: round(v / num, 1) for k, v in ops.most_common(8)},
        "profiled_forward_ms": round(total_us / 1000, 3),
        "profiled_ops_ms": round(own_us / num / 1000, 3),
    }


# --- modes ---------------------------------------------------------------------------------------


def engine_mode(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from shoal.services.worker.engine import packed_load
    from shoal.services.worker.engine.engine_config import EngineConfig
    from shoal.services.worker.engine.paged_engine import PagedEngine

    torch.set_num_threads(args.threads)
    results = []
    for key, dtype in ((k, d) for k in args.models.split(",") for d in args.dtype.split(",")):
        path = args.models_root / key
        tokenizer = AutoTokenizer.from_pretrained(path)
        if dtype == "float32":
            model = AutoModelForCausalLM.from_pretrained(path).eval()
        elif dtype == "bfloat16":
            loaded = packed_load.load_packed(path, AutoConfig.from_pretrained(path), attn_implementation=None,
                                             weights_dtype=torch.bfloat16)
            if loaded is None:
                raise SystemExit(f"{key} does not load with bfloat16 panels")
            model = loaded[0]
        else:
            raise SystemExit(f"--dtype: float32 or bfloat16, not {dtype!r}")
        config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, warm_up=True,
                              max_kv_cache_tokens=args.kv_cache_tokens or None,
                              native_forward=args.forward == "native",
                              cpu_threads="auto" if args.cpu_threads == "auto" else int(args.cpu_threads))
        engine = PagedEngine(model, tokenizer, allocation_bytes=int(args.allocation_gib * GiB), config=config)
        try:
            for c in (int(x) for x in args.concurrency.split(",")):
                result = {"model": key, "dtype": dtype, "c": c, "forward": engine.forward,
                          **time_phases(engine, tokenizer, c, args)}
                if engine.forward == "transformers":  # the native pass is one C call: no modules to wrap
                    result |= {**time_forward(engine, tokenizer, c, args), **count_ops(engine, tokenizer, c, args)}
                result["num_preemptions"] = engine.get_stats().num_preemptions
                print(json.dumps(result), flush=True)
                results.append(result)
        finally:
            asyncio.run(engine.close())
    return results


def main() -> None:
    args = parse_args()
    if args.mode == "engine":
        results = engine_mode(args)
    else:
        import profile_worker  # scripts/, next to this file

        results = profile_worker.worker_mode(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
