"""Engine benchmark: Shoal's paged engine vs three Hugging Face paths, on the demo models, in one run.

For each model and each concurrency C (1, 8, 32), the first C requests of one fixed sample
arrive together at t0 and each path serves them all:

    shoal       PagedEngine.generate() (async API, text streamed through TextStream)
    hf-serial   model.generate() one request after another
    hf-padded   one model.generate() over all C requests, left-padded; it runs until the
                longest request's length, and only each request's own tokens are counted
    hf-cb       transformers' continuous batching (the manager behind generate_batch(),
                driven directly so each request keeps its own max_new_tokens; warmed up
                once, outside the timings)
    floor       NOT an engine: Shoal's exact batches through the model's transformers
                modules (EngineConfig.native_forward off) with write_kv and paged_attention
                replaced by no-ops (wrong tokens, same lengths and schedule). It times the
                Hugging Face forward passes alone, a floor no engine that runs them can beat
                (Shoal's native forward pass, docs/engine.md, does not run them).

Reported per run: output tokens/s (all requests' generated tokens / time from t0 to the
last completion: prefill included), decode tokens/s (the tokens after each request's first
/ time from the first request's first token to the last request's last token: the decode
phase, though in continuous batching later prompts' prefills still share it), and time to
first token (from t0; mean, p50, p95). All paths decode greedily with EOS ignored, so every
request generates exactly its length; Shoal's and hf-serial's texts are compared as a
sanity check.

The same run also measures, unless `--sections` leaves them out, the KV block pool's
allocate+free throughput (`bench_block_pool.py`: single and batched, against vLLM's
reported 1.0 M/s and 5.9 M/s and a re-creation of its free list measured here) and the
CPU KV ops' bandwidth as a fraction of a contiguous copy of the same bytes
(`bench_kv_ops.py`: write_kv with prefill and decode slot patterns, the gather of
paged_attention, and write_kv at one decode step's size), and ends with one markdown
report of all three. Both scripts still run alone.

Request shapes come from the Azure LLM conversation trace (/work/shared/data): prompt
tokens = ContextTokens / prompt-divisor and output tokens = GeneratedTokens /
output-divisor, each clipped to a range tiny CPU models serve in seconds (see --help);
prompt token ids are random (seeded) from the model's vocabulary.

    python scripts/bench_engine.py --quick            # ~2 small models, shorter requests
    python scripts/bench_engine.py                     # all demo models
    python scripts/bench_engine.py --sections block-pool,kv-ops   # the micro-benchmarks only

The engine section also draws output tokens/s against concurrency, one line per path and a
panel per model (docs/images/engine_throughput.png; ``--plot-dir``).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_block_pool  # scripts/, next to this file (on sys.path when run as a script)
import bench_kv_ops
import plots
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    GenerationConfig,
)
from transformers.generation.streamers import BaseStreamer

from shoal.cli.demo_models import make_demo_models
from shoal.kernels import ops, reference
from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.generation import GenerationRequest
from shoal.shared.messages import SamplingParams

TRACE = Path("/work/shared/data/azure_llm_2023_conv.csv")
GiB = 1 << 30


@dataclass(frozen=True)
class Shape:
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class Timings:
    """What one path's run of C requests measured, each time from t0."""

    seconds: float
    """Until the last request completed."""
    ttft_s: list[float]
    """Each request's first token."""
    last_token_s: list[float]
    """Each request's last token."""
    texts: list[str]


@dataclass
class RunResult:
    model: str
    path: str
    concurrency: int
    num_output_tokens: list[int]
    """Each request's generated tokens."""
    timings: Timings

    @property
    def seconds(self) -> float:
        return self.timings.seconds

    @property
    def texts(self) -> list[str] | None:
        return self.timings.texts or None

    @property
    def tokens_per_s(self) -> float:
        """All generated tokens / time to the last completion (prefill included)."""
        return sum(self.num_output_tokens) / self.timings.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after each request's first / time from the first first token to the last
        last token: throughput of the decode phase, without the initial prefill."""
        span = max(self.timings.last_token_s) - min(self.timings.ttft_s)
        return sum(n - 1 for n in self.num_output_tokens) / span if span > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.timings.ttft_s)
        return {
            "model": self.model,
            "path": self.path,
            "concurrency": self.concurrency,
            "output_tokens": sum(self.num_output_tokens),
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 1),
            "ttft_mean_ms": round(1000 * statistics.mean(ttft), 1),
            "ttft_p50_ms": round(1000 * ttft[len(ttft) // 2], 1),
            "ttft_p95_ms": round(1000 * ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 1),
        }


def sample_shapes(
    num: int,
    seed: int,
    prompt_divisor: int,
    prompt_range: tuple[int, int],
    output_divisor: int,
    output_range: tuple[int, int],
) -> list[Shape]:
    with TRACE.open() as trace:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(trace)]
    picked = random.Random(seed).sample(rows, num)
    return [
        Shape(
            min(max(context // prompt_divisor, prompt_range[0]), prompt_range[1]),
            min(max(generated // output_divisor, output_range[0]), output_range[1]),
        )
        for context, generated in picked
    ]


def make_prompts(shapes: list[Shape], vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed % (1 << 63))
    return [
        torch.randint(5, vocab_size, (shape.num_prompt_tokens,), generator=generator).tolist()
        for shape in shapes
    ]


# ---------------------------------------------------------------------- the four paths


def run_shoal(engine: PagedEngine, prompts: list[list[int]], shapes: list[Shape]) -> Timings:
    async def serve() -> Timings:
        t0 = time.perf_counter()
        ttft = [0.0] * len(prompts)
        last = [0.0] * len(prompts)
        texts = [""] * len(prompts)

        async def one(index: int) -> None:
            params = SamplingParams(
                max_tokens=shapes[index].num_output_tokens, temperature=0.0, ignore_eos=True
            )
            async for output in engine.generate(GenerationRequest(f"r{index}", prompts[index], params)):
                if output.num_new_tokens:
                    last[index] = time.perf_counter() - t0
                    if not ttft[index]:
                        ttft[index] = last[index]
                texts[index] += output.text
            assert output.num_completion_tokens == shapes[index].num_output_tokens

        await asyncio.gather(*(one(index) for index in range(len(prompts))))
        return Timings(time.perf_counter() - t0, ttft, last, texts)

    return asyncio.run(serve())


def run_without_attention(engine: PagedEngine, prompts: list[list[int]], shapes: list[Shape]) -> Timings:
    """`run_shoal` with the attention ops as no-ops (the `floor` row; its texts are garbage).

    Both ways the engine attends are stubbed: the public ops, and the CPU functions its
    CPU path calls with a per-pass plan."""
    saved = ops.write_kv, ops.paged_attention, reference.write_kv, reference.run_attention
    ops.write_kv = ops.paged_attention = reference.write_kv = reference.run_attention = _no_op  # type: ignore[assignment]
    try:
        timings = run_shoal(engine, prompts, shapes)
    finally:
        ops.write_kv, ops.paged_attention, reference.write_kv, reference.run_attention = saved
    return Timings(timings.seconds, timings.ttft_s, timings.last_token_s, [])


def _no_op(*args: Any, **kwargs: Any) -> None:
    pass


class _TokenClock(BaseStreamer):
    """Records when generate() produces each step's new tokens (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.token_at: list[float] = []
        self._saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._saw_prompt:
            self.token_at.append(time.perf_counter())
        self._saw_prompt = True

    def end(self) -> None:
        pass


def _greedy_config(max_new_tokens: int, pad_token_id: int) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_token_id
    )


def run_hf_serial(model: Any, tokenizer: Any, prompts: list[list[int]], shapes: list[Shape]) -> Timings:
    t0 = time.perf_counter()
    ttft, last, texts = [], [], []
    for prompt, shape in zip(prompts, shapes, strict=True):
        clock = _TokenClock()
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            output = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                streamer=clock,
                generation_config=_greedy_config(shape.num_output_tokens, tokenizer.pad_token_id),
            )
        ttft.append(clock.token_at[0] - t0)
        last.append(clock.token_at[-1] - t0)
        texts.append(tokenizer.decode(output[0, len(prompt) :], skip_special_tokens=True))
    return Timings(time.perf_counter() - t0, ttft, last, texts)


def run_hf_padded(model: Any, tokenizer: Any, prompts: list[list[int]], shapes: list[Shape]) -> Timings:
    t0 = time.perf_counter()
    width = max(len(prompt) for prompt in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _TokenClock()
    with torch.inference_mode():
        model.generate(
            input_ids,
            attention_mask=attention_mask,
            streamer=clock,
            generation_config=_greedy_config(max(s.num_output_tokens for s in shapes), pad),
        )
    seconds = time.perf_counter() - t0
    # Every row gets a token per step; request i's own tokens are the first n_i of them.
    last = [clock.token_at[shape.num_output_tokens - 1] - t0 for shape in shapes]
    return Timings(seconds, [clock.token_at[0] - t0] * len(prompts), last, [])


def run_hf_cb(manager: Any, prompts: list[list[int]], shapes: list[Shape]) -> Timings:
    t0 = time.perf_counter()
    request_ids = [
        manager.add_request(prompt, max_new_tokens=shape.num_output_tokens, record_timestamps=True)
        for prompt, shape in zip(prompts, shapes, strict=True)
    ]
    finished: dict[str, Any] = {}
    while len(finished) < len(request_ids):
        result = manager.get_result(timeout=60)
        if result is None:
            raise RuntimeError("transformers' continuous batching stopped answering")
        if result.is_finished():
            finished[result.request_id] = result
    seconds = time.perf_counter() - t0
    for request_id, shape in zip(request_ids, shapes, strict=True):
        assert len(finished[request_id].generated_tokens) == shape.num_output_tokens
    return Timings(
        seconds,
        [finished[r].timestamps[0] - t0 for r in request_ids],
        [finished[r].timestamps[-1] - t0 for r in request_ids],
        [],
    )


# ---------------------------------------------------------------------- driver


def bench_model(
    key: str,
    models_root: Path,
    shapes: list[Shape],
    levels: list[int],
    seed: int,
    paths: list[str],
    max_num_batched_tokens: int,
    repeats: int,
) -> list[RunResult]:
    """Every path on one model. Paths run interleaved (each repeat runs every path at every
    level), so load that drifts over time on a shared machine hits all paths alike; the
    median repeat is reported. hf-serial, far from the others, runs once per level."""
    path = models_root / key
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    runners: dict[str, Callable[..., Any]] = {}
    cleanups: list[Callable[[], None]] = []
    try:
        warmup_prompts = make_prompts(shapes[:2], vocab_size, seed=-1)
        for name in paths:
            model = AutoModelForCausalLM.from_pretrained(path).eval()
            runners[name], cleanup = _make_runner(name, model, tokenizer, max_num_batched_tokens)
            cleanups.append(cleanup)
            runners[name](warmup_prompts, [Shape(s.num_prompt_tokens, 4) for s in shapes[:2]])
        runs: dict[tuple[str, int], list[RunResult]] = {}
        for repeat in range(repeats):
            for concurrency in levels:
                # Fresh prompts for every run (the same for every path): no path may reuse a
                # prompt it has seen (Shoal's prefix cache would skip its prefill).
                prompts = make_prompts(
                    shapes, vocab_size, seed=seed * 1_000_003 + repeat * 1009 + concurrency
                )
                for name in paths:
                    if name == "hf-serial" and repeat > 0:
                        continue
                    timings = runners[name](prompts[:concurrency], shapes[:concurrency])
                    num_tokens = [shape.num_output_tokens for shape in shapes[:concurrency]]
                    result = RunResult(key, name, concurrency, num_tokens, timings)
                    runs.setdefault((name, concurrency), []).append(result)
                    print(json.dumps({"repeat": repeat, **result.summary()}), flush=True)
    finally:
        for cleanup in cleanups:
            cleanup()
    _check_texts([rs[0] for rs in runs.values()])  # repeat 0: the same prompts on every path
    return [sorted(rs, key=lambda r: r.seconds)[len(rs) // 2] for rs in runs.values()]


def _make_runner(
    name: str, model: Any, tokenizer: Any, max_num_batched_tokens: int
) -> tuple[Callable[..., Any], Callable[[], None]]:
    if name in ("shoal", "floor"):
        engine = PagedEngine(
            model,
            tokenizer,
            allocation_bytes=GiB,
            config=EngineConfig(
                max_num_seqs=64,
                max_num_batched_tokens=max_num_batched_tokens,
                runtime_overhead_bytes=0,
                # the floor times transformers' forward passes, which Shoal's native one replaces
                native_forward=name == "shoal",
            ),
        )
        run = run_shoal if name == "shoal" else run_without_attention
        return (lambda p, s: run(engine, p, s)), (lambda: asyncio.run(engine.close()))
    if name == "hf-serial":
        return (lambda p, s: run_hf_serial(model, tokenizer, p, s)), (lambda: None)
    if name == "hf-padded":
        return (lambda p, s: run_hf_padded(model, tokenizer, p, s)), (lambda: None)
    assert name == "hf-cb", name
    config = _greedy_config(16, tokenizer.pad_token_id)
    config.eos_token_id = -1  # transformers' continuous batching spells "no EOS" as -1
    manager = model.init_continuous_batching(
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=max_num_batched_tokens),
    )
    started = time.perf_counter()
    manager.warmup()
    print(json.dumps({"path": "hf-cb", "warmup_s": round(time.perf_counter() - started, 1)}), flush=True)
    manager.start()
    return (lambda p, s: run_hf_cb(manager, p, s)), (lambda: manager.stop(block=True))


def _check_texts(results: list[RunResult]) -> None:
    by_level = {(r.path, r.concurrency): r.texts for r in results if r.texts}
    for (path, concurrency), texts in by_level.items():
        if path != "shoal" or ("hf-serial", concurrency) not in by_level:
            continue
        reference = by_level[("hf-serial", concurrency)]
        num_same = sum(a == b for a, b in zip(texts, reference, strict=True))
        print(
            json.dumps(
                {
                    "check": "shoal text == hf-serial text",
                    "concurrency": concurrency,
                    "same": num_same,
                    "of": len(texts),
                }
            ),
            flush=True,
        )


SECTIONS = ("engine", "block-pool", "kv-ops")


def engine_report(results: list[RunResult], levels: list[int]) -> str:
    """The engine table (medians), and Shoal over the best HF path at the top concurrency."""
    lines = [
        "| model | path | C | output tok/s (incl. prefill) | decode tok/s | TTFT mean ms | p50 | p95 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        summary = r.summary()
        path = f"**{r.path}**" if r.path == "shoal" else r.path
        lines.append(
            f"| {r.model} | {path} | {r.concurrency} | {summary['tokens_per_s']} | "
            f"{summary['decode_tokens_per_s']} | {summary['ttft_mean_ms']:.0f} | "
            f"{summary['ttft_p50_ms']:.0f} | {summary['ttft_p95_ms']:.0f} |"
        )
    top = max(levels)
    for key in dict.fromkeys(r.model for r in results):
        at_top = {r.path: r for r in results if r.model == key and r.concurrency == top}
        best_hf = max(
            (r for p, r in at_top.items() if p.startswith("hf-")), key=lambda r: r.tokens_per_s, default=None
        )
        if "shoal" in at_top and best_hf is not None:
            shoal = at_top["shoal"]
            lines.append(
                f"\n{key}, C = {top}: Shoal / best HF path ({best_hf.path}) = "
                f"{shoal.tokens_per_s / best_hf.tokens_per_s:.2f}x output tok/s, "
                f"{shoal.decode_tokens_per_s / best_hf.decode_tokens_per_s:.2f}x decode tok/s"
            )
    return "\n".join(lines)


def plot_engine(results: list[RunResult], plot_dir: str, caption: str) -> None:
    """Output tok/s (medians) against concurrency, one panel per model, one line per path."""
    keys = list(dict.fromkeys(r.model for r in results))
    figure, axes = plots.new_figure(3.0 * len(keys) + 1.0, 3.6, columns=len(keys))
    for axis, key in zip(axes, keys, strict=True):
        for path in dict.fromkeys(r.path for r in results):
            points = sorted((r.concurrency, r.tokens_per_s) for r in results if r.model == key and r.path == path)
            style = "--" if path == "floor" else "-"
            axis.plot([c for c, _ in points], [t for _, t in points], style, marker="o", markersize=3,
                      color=plots.COLORS.get(path), label=path, linewidth=2.2 if path == "shoal" else 1.2)
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted({r.concurrency for r in results}))
        axis.xaxis.set_major_formatter(plots.plain_numbers())
        axis.set_xlabel("concurrent requests")
        axis.set_title(key.removeprefix("demo/"), fontsize=10)
        axis.set_ylim(bottom=0)
    axes[0].set_ylabel("output tokens/s (prefill included)")
    axes[0].legend(fontsize=7)
    plots.save(figure, plot_dir, "engine_throughput", caption)


def block_pool_report(quick: bool) -> str:
    num_ops, repeats = (200_000, 3) if quick else (1_000_000, 7)
    rows = bench_block_pool.bench_block_pools(4096, num_ops, repeats)
    shoal = {
        row["mode"]: float(row["M ops/s"]) for row in rows if row["implementation"] == bench_block_pool.SHOAL
    }  # type: ignore[arg-type]
    lines = [
        f"4096 blocks, {num_ops} allocate+free ops per run, best of {repeats} interleaved rounds.",
        "",
        "| mode | implementation | M ops/s | net allocs/op |",
        "| --- | --- | ---: | ---: |",
    ]
    lines += [
        f"| {row['mode']} | {row['implementation']} | {float(row['M ops/s']):.2f} | {float(row['net allocs/op']):.4f} |"  # type: ignore[arg-type]
        for row in rows
    ]
    lines.append("")
    for mode, reported in bench_block_pool.VLLM_REPORTED_M_OPS.items():
        lines.append(
            f"- {mode}: Shoal {shoal[mode]:.2f} M ops/s = {shoal[mode] / reported:.2f}x vLLM's reported {reported} M ops/s"
        )
    return "\n".join(lines)


def kv_ops_report(quick: bool) -> str:
    bench_kv_ops.use_cpu_time()
    repeats = 5 if quick else 11
    token_counts = (16384,) if quick else (16384, 65536)
    return "\n".join(
        [
            f"Thread CPU time, one torch thread, medians of {repeats} interleaved rounds; the baseline "
            "is `dst.copy_(src)` of the same bytes between contiguous tensors.",
            "",
            bench_kv_ops.markdown(bench_kv_ops.bench_bandwidth(token_counts, repeats)),
            "",
            "At the size of one layer of a decode step the fixed cost per call is what is measured:",
            "",
            bench_kv_ops.markdown(bench_kv_ops.bench_write_kv_steps(repeats)),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the two small models, shorter requests")
    parser.add_argument("--models-root", type=Path, help="demo models directory (default: a temp dir)")
    parser.add_argument("--models", help="comma-separated model keys")
    parser.add_argument("--paths", default="shoal,hf-serial,hf-padded,hf-cb,floor")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"which parts to run (default: all of {', '.join(SECTIONS)})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="per-step token budget of shoal and hf-cb (default 2048)",
    )
    parser.add_argument("--repeats", type=int, help="runs per path and level (default 3, --quick 2)")
    parser.add_argument("--json", type=Path, help="write all engine results here")
    plots.add_plot_argument(parser)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for every path (default 1: on a shared 2-core machine "
        "more threads oversubscribe the cores and make every path slower and noisier)",
    )
    args = parser.parse_args()
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    report = [
        f"# Shoal benchmark\n\ntorch {torch.__version__}, {args.threads} torch thread(s) for the engine paths"
    ]
    if "engine" in sections:
        report += ["\n## Engine\n", run_engine_section(args, levels)]
    if "block-pool" in sections:
        report += ["\n## Block pool: allocate + free\n", block_pool_report(args.quick)]
    if "kv-ops" in sections:
        report += ["\n## CPU KV ops: bandwidth against a contiguous copy\n", kv_ops_report(args.quick)]
    print("\n".join(report), flush=True)


def run_engine_section(args: argparse.Namespace, levels: list[int]) -> str:
    if args.quick:
        models = args.models or "demo/llama-5m,demo/qwen2-25m"
        shape_args = (16, (4, 128), 8, (4, 32))
    else:
        models = args.models or "demo/llama-5m,demo/qwen2-25m,demo/llama-100m"
        shape_args = (8, (4, 256), 4, (4, 64))
    shapes = sample_shapes(max(levels), args.seed, *shape_args)
    workload = {
        "trace": str(TRACE),
        "prompt_tokens": f"ContextTokens // {shape_args[0]}, clipped to {shape_args[1]}",
        "output_tokens": f"GeneratedTokens // {shape_args[2]}, clipped to {shape_args[3]}",
        "mean_prompt_tokens": statistics.mean(s.num_prompt_tokens for s in shapes),
        "mean_output_tokens": statistics.mean(s.num_output_tokens for s in shapes),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(json.dumps(workload), flush=True)
    with tempfile.TemporaryDirectory() as temp_dir:
        models_root = args.models_root or Path(temp_dir)
        keys = models.split(",")
        make_demo_models(models_root, names=keys)
        results = []
        for key in keys:
            results += bench_model(
                key,
                models_root,
                shapes,
                levels,
                args.seed,
                args.paths.split(","),
                args.max_num_batched_tokens,
                args.repeats or (2 if args.quick else 3),
            )
    print(json.dumps({"medians": [r.summary() for r in results]}), flush=True)
    repeats = args.repeats or (2 if args.quick else 3)
    plot_engine(results, args.plot_dir,
                f"scripts/bench_engine.py, {'medians of ' + str(repeats) + ' repeats' if repeats > 1 else 'one run'}, "
                f"{torch.get_num_threads()} torch thread(s), {time.strftime('%Y-%m-%d')}")
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {**r.summary(), "ttft_s": r.timings.ttft_s, "last_token_s": r.timings.last_token_s}
                    for r in results
                ],
                indent=1,
            )
        )
    header = (
        f"Prompts: {workload['prompt_tokens']} (mean {workload['mean_prompt_tokens']:.0f}); outputs: "
        f"{workload['output_tokens']} (mean {workload['mean_output_tokens']:.0f}); medians of the repeats. "
        "Output tok/s counts all generated tokens over the time from t0 to the last completion "
        "(prefill included); decode tok/s the tokens after each request's first over the time from "
        "the first first-token to the last token.\n"
    )
    return header + "\n" + engine_report(results, levels)


if __name__ == "__main__":
    main()
