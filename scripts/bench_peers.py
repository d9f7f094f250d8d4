"""Shoal against llama.cpp on a CPU: the same models, prompts and load, side by side in one run.

1. Builds llama.cpp's `llama-server` once into a cache (``peer_llama_cpp.py``: the
   llama-cpp-python sdist's vendored llama.cpp, server target, static, no web UI) and
   converts each demo model to an f32 GGUF with llama.cpp's converter.
2. Starts `shoal up` as shipped (own state dir, free port, the models root) with
   ``SHOAL_WORKER_TORCH_THREADS`` = the thread count given to ``llama-server -t``.
3. Checks, per model: both sides tokenize the prompts identically (llama-server's
   /tokenize against the model's tokenizer, and every request's prompt_tokens on both
   sides), produce exactly the requested number of tokens, and how their greedy outputs
   compare with each other and with transformers' ``generate``.
4. For each model, prompt length (~64, 512, 2,048 tokens: lengths from the Azure
   conversation trace, text cut from the demo corpus) and C (1, 8, 32): C streamed
   requests sent together, exactly `--max-tokens` output tokens each (``ignore_eos`` on
   both sides), greedy; llama.cpp's best ``--parallel`` from a pilot run of each candidate;
   then `--rounds` rounds alternating which side goes first, fresh prompts per round (the
   same on both sides), best round kept. Output tokens/s = all output tokens / (last
   completion - t0); TTFT = first streamed text, from t0.
5. Prints the table and writes it, with the commands and settings, between the markers
   of the peer section in docs/benchmarks.md.

Prompts longer than the model's context allows (prompt + output > max_position_embeddings)
are clipped to fit, after one unclipped request has been sent to each side to record what
it does with it.

    python scripts/bench_peers.py                                     # everything (~1-2 h)
    python scripts/bench_peers.py --models demo/llama-5m --concurrency 1,8 --prompt-lengths 64
    python scripts/bench_peers.py --build-only

``--weights bf16`` compares bfloat16 weights on both sides instead: the models converted to
BF16 GGUFs (the converter's ``--outtype bf16``) and served by Shoal with ``dtype =
"bfloat16"`` (a shoal.toml of `[[models]]` entries; docs/engine.md, "Bfloat16 weights"),
greedy outputs checked against ``generate`` of the model with every weight rounded to
bfloat16.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import peer_llama_cpp as llama_cpp  # scripts/, next to this file (on sys.path when run as a script)
import peer_workload as wl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DOCS = REPO / "docs" / "benchmarks.md"
DEFAULT_MODELS = ("demo/llama-5m", "demo/llama-100m")
REQUEST_TIMEOUT_S = 1800.0


def parse_int_list(text: str) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32]; every item a positive integer."""
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda s: [m for m in s.split(",") if m], default=list(DEFAULT_MODELS),
                        help="comma-separated model keys under the models root (default: %(default)s)")
    parser.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 32], help="C values (1,8,32)")
    parser.add_argument("--prompt-lengths", type=parse_int_list, default=[64, 512, 2048],
                        help="nominal prompt lengths in tokens (64,512,2048)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (128)")
    parser.add_argument("--rounds", type=int, default=2, help="measured runs per side and cell, best kept (2)")
    parser.add_argument("--threads", type=int, default=2, help="threads for both sides (2)")
    parser.add_argument("--parallel", type=parse_int_list, default=None,
                        help="llama-server --parallel candidates for every C (default: C, C/2, C/4)")
    parser.add_argument("--models-root", type=Path,
                        default=Path(os.environ.get("SHOAL_TEST_MODELS_ROOT", REPO / "models")))
    parser.add_argument("--cache", type=Path, default=llama_cpp.DEFAULT_CACHE,
                        help="llama.cpp sources, build and GGUFs (default: %(default)s; env SHOAL_PEERS_CACHE)")
    parser.add_argument("--llama-cpp-python", default=llama_cpp.LLAMA_CPP_PYTHON_VERSION,
                        help="the llama-cpp-python sdist whose vendored llama.cpp is built (%(default)s)")
    parser.add_argument("--quiet-wait", type=float, default=30.0,
                        help="before each measured run, wait up to this many seconds for the other processes "
                             "of the machine to leave it >= --quiet-idle idle (0: never wait)")
    parser.add_argument("--quiet-idle", type=float, default=0.7, help="idle share of all cores to wait for (0.7)")
    parser.add_argument("--max-extra-rounds", type=int, default=2,
                        help="rounds added to a cell whose runs started on a busy machine (2)")
    parser.add_argument("--greedy-checks", type=int, default=2, help="prompts per length compared token by token")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the markdown file whose peer section is replaced")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave the docs alone")
    parser.add_argument("--json", type=Path, help="also write every run as JSON here")
    parser.add_argument("--build-only", action="store_true", help="build llama-server and convert the models, then stop")
    parser.add_argument("--weights", choices=["f32", "bf16"], default="f32",
                        help="the weights' type on both sides: f32 (GGUF f32, Shoal float32) or bf16 (GGUF bf16, "
                             "Shoal dtype = \"bfloat16\")")
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or args.rounds < 1 or args.threads < 1 or args.greedy_checks < 0 \
            or args.max_extra_rounds < 0:
        parser.error("--max-tokens, --rounds and --threads must be >= 1, --greedy-checks and --max-extra-rounds >= 0")
    if not args.models:
        parser.error("--models is empty")
    return args


def get_parallel_candidates(concurrency: int, fixed: list[int] | None) -> list[int]:
    """llama-server --parallel values to try for C concurrent requests: C and C/2 (at least 1)."""
    if fixed:
        return sorted(set(fixed), reverse=True)
    return sorted({max(1, concurrency // d) for d in (1, 2)}, reverse=True)


def get_llama_ctx_tokens(workload: wl.Workload, parallel: int) -> int:
    """llama-server -c: `parallel` slots, each holding the longest prompt + output, rounded to 256."""
    per_slot = max(workload.prompt_lengths) + workload.max_tokens
    per_slot = -(-per_slot // 256) * 256
    return parallel * per_slot


def read_cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all cores since boot (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return values[3] + values[4], sum(values)  # idle + iowait


def wait_for_quiet(max_wait_s: float, min_idle: float, sample_s: float = 1.0) -> float:
    """Wait (up to `max_wait_s`) until the cores were >= `min_idle` idle over `sample_s`; the last idle share.

    The machine is shared: a run started while another job holds the cores measures that job.
    """
    deadline = time.monotonic() + max_wait_s
    while True:
        idle_0, total_0 = read_cpu_times()
        time.sleep(sample_s)
        idle_1, total_1 = read_cpu_times()
        idle = (idle_1 - idle_0) / max(1, total_1 - total_0)
        if idle >= min_idle or time.monotonic() >= deadline:
            return idle


# --- one side's run ---------------------------------------------------------------------------


@dataclass
class Answer:
    """What one streamed completion returned."""

    status: int
    ttft_s: float = 0.0
    done_s: float = 0.0
    text: str = ""
    num_prompt_tokens: int | None = None
    num_output_tokens: int | None = None
    finish_reason: str | None = None
    error: str = ""


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict[str, Any], t0: float) -> Answer:
    """POST a streamed /v1/completions and read its SSE events; times from `t0` (perf_counter)."""
    async with session.post(url, json=body) as response:
        if response.status != 200:
            return Answer(response.status, error=(await response.text())[:500])
        answer = Answer(200)
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                answer.error = json.dumps(event["error"])[:500]
                break
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    if not answer.text:
                        answer.ttft_s = time.perf_counter() - t0
                    answer.text += choice["text"]
                if choice.get("finish_reason"):
                    answer.finish_reason = choice["finish_reason"]
            usage = event.get("usage")
            if usage:
                answer.num_prompt_tokens = usage.get("prompt_tokens")
                answer.num_output_tokens = usage.get("completion_tokens")
        answer.done_s = time.perf_counter() - t0
        return answer


def completion_body(model: str, prompt: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    """The same OpenAI-style body for both sides: greedy, exactly `max_tokens` (EOS ignored)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class CellFailed(RuntimeError):
    """A side answered a request with an error or the wrong number of tokens."""


async def run_side(base_url: str, model: str, prompts: list[str], workload: wl.Workload) -> wl.RunResult:
    """All prompts sent together as streamed requests; raises CellFailed on any wrong answer."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        url = base_url + "/v1/completions"
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(
            stream_completion(session, url, completion_body(model, p, workload.max_tokens), t0) for p in prompts
        ))
    problems = []
    for i, (answer, expected) in enumerate(zip(answers, workload.prompt_lengths, strict=True)):
        if answer.status != 200 or answer.error:
            problems.append(f"request {i}: HTTP {answer.status} {answer.error}")
        elif answer.num_output_tokens != workload.max_tokens:
            problems.append(f"request {i}: {answer.num_output_tokens} output tokens (finish "
                            f"{answer.finish_reason}), not {workload.max_tokens}")
        elif answer.num_prompt_tokens != expected:
            problems.append(f"request {i}: {answer.num_prompt_tokens} prompt tokens, not {expected}")
    if problems:
        raise CellFailed("; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""))
    return wl.RunResult(
        seconds=max(a.done_s for a in answers),
        ttft_s=tuple(a.ttft_s for a in answers),
        num_output_tokens=tuple(a.num_output_tokens or 0 for a in answers),
    )


async def complete_once(base_url: str, model: str, prompt: str, max_tokens: int) -> Answer:
    """One streamed request alone (probes, greedy checks)."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await stream_completion(session, base_url + "/v1/completions",
                                       completion_body(model, prompt, max_tokens), time.perf_counter())


STATS_INTERVAL_S = 1.0
"""The workers' stats interval under the benchmark (``SHOAL_WORKER_STATS_INTERVAL_S``), so the
preemption counter read from /metrics is at most this old."""


async def read_shoal_preemptions(base_url: str, model: str) -> int:
    """Requests the model's replicas have preempted since they started (their engines' own
    counter, as the gateway exports it), read after one stats interval has passed."""
    await asyncio.sleep(1.5 * STATS_INTERVAL_S)
    async with aiohttp.ClientSession() as session, session.get(base_url + "/metrics") as response:
        response.raise_for_status()
        return int(wl.sum_metric(await response.text(), "shoal_worker_preemptions_total", model))


async def llama_tokenize(base_url: str, text: str) -> list[int]:
    """llama-server's tokens for `text`, special tokens added as for a completion."""
    async with aiohttp.ClientSession() as session, session.post(
        base_url + "/tokenize", json={"content": text, "add_special": True}
    ) as response:
        response.raise_for_status()
        return list((await response.json())["tokens"])


# --- the benchmark ----------------------------------------------------------------------------


@dataclass
class ModelReport:
    model: str
    gguf: str
    rows: list[wl.Row] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    server_commands: list[str] = field(default_factory=list)


class Bench:
    def __init__(self, args: argparse.Namespace, llama: llama_cpp.LlamaCpp, shoal_url: str, logs: Path) -> None:
        self.args = args
        self.llama = llama
        self.shoal_url = shoal_url
        self.logs = logs
        self.contexts = wl.read_trace_contexts()
        self.runs: list[dict[str, Any]] = []
        self.numbers = wl.PromptNumbers(0)
        self.loads: list[float] = []
        self.idle_shares: list[float] = []

    def _prompts(self, maker: wl.PromptMaker, workload: wl.Workload) -> list[str]:
        """Fresh prompts for one run (the same list then goes to both sides)."""
        return wl.make_prompts(maker, workload, self.numbers.take(workload.concurrency))

    def _wait_for_quiet(self) -> float:
        idle = wait_for_quiet(self.args.quiet_wait, self.args.quiet_idle) if self.args.quiet_wait > 0 else 1.0
        self.idle_shares.append(idle)
        return idle

    def _record(self, **fields: Any) -> None:
        self.loads.append(os.getloadavg()[0])
        fields["load1"] = round(self.loads[-1], 2)
        self.runs.append(fields)
        print(json.dumps(fields), flush=True)

    def _start_llama(self, report: ModelReport, gguf: Path, workload: wl.Workload, parallel: int
                     ) -> llama_cpp.LlamaServer:
        server = llama_cpp.start_server(self.llama, gguf, self.logs / "llama-server.log", parallel=parallel,
                                        ctx_tokens=get_llama_ctx_tokens(workload, parallel),
                                        threads=self.args.threads)
        argv = ["llama-server", *server.argv[1:]]
        argv[argv.index("--port") + 1] = "<free port>"
        command = " ".join(argv).replace(str(gguf), gguf.name)
        if command not in report.server_commands:
            report.server_commands.append(command)
        return server

    def bench_model(self, model: str, gguf: Path) -> ModelReport:
        from transformers import AutoConfig, AutoTokenizer

        path = self.args.models_root / model
        tokenizer = AutoTokenizer.from_pretrained(path)
        context_tokens = int(AutoConfig.from_pretrained(path).max_position_embeddings)
        corpus = (REPO / "cli" / "demo_corpus.txt").read_text()
        maker = wl.make_prompt_maker(tokenizer, corpus)
        self.numbers = wl.PromptNumbers(maker.num_corpus_tokens)  # per model: each side's prefix cache is per model
        report = ModelReport(model, gguf.name)
        self._warm_shoal(model, maker)
        for target in self.args.prompt_lengths:
            workloads = [wl.make_workload(self.contexts, target, c, self.args.max_tokens, context_tokens)
                         for c in self.args.concurrency]
            if workloads[0].clipped:
                self._probe_unclipped(report, model, gguf, maker, target, context_tokens)
            self._check_model(report, model, gguf, maker, tokenizer, max(workloads, key=lambda w: w.concurrency))
            for workload in workloads:
                report.rows.append(self._bench_cell(report, model, gguf, maker, workload))
        return report

    def _warm_shoal(self, model: str, maker: wl.PromptMaker) -> None:
        """The first request places the model (a worker starts); wait for it outside the timings."""
        started = time.perf_counter()
        answer = asyncio.run(complete_once(self.shoal_url, model, maker.make(16, self.numbers.take(1)), 4))
        if answer.status != 200 or answer.error:
            raise RuntimeError(f"Shoal could not serve {model}: HTTP {answer.status} {answer.error}")
        self._record(event="shoal_warm", model=model, seconds=round(time.perf_counter() - started, 1))

    def _probe_unclipped(self, report: ModelReport, model: str, gguf: Path, maker: wl.PromptMaker,
                         target: int, context_tokens: int) -> None:
        """Send one prompt of the trace's longest length in this bucket, unclipped, to each side."""
        longest = max(wl.select_prompt_lengths(self.contexts, target, max(self.args.concurrency)))
        prompt = maker.make(longest, self.numbers.take(1))
        fake = wl.Workload(target, (longest,), self.args.max_tokens)
        outcomes = {"Shoal": asyncio.run(complete_once(self.shoal_url, model, prompt, self.args.max_tokens))}
        server = self._start_llama(report, gguf, fake, 1)
        try:
            outcomes["llama.cpp"] = asyncio.run(complete_once(server.base_url, model, prompt, self.args.max_tokens))
        finally:
            server.stop()
        for side, answer in outcomes.items():
            what = (f"HTTP {answer.status}: {answer.error}" if answer.status != 200 or answer.error else
                    f"{answer.num_output_tokens} output tokens, finish_reason {answer.finish_reason!r}, "
                    f"prompt_tokens {answer.num_prompt_tokens}")
            report.checks.append(f"~{target:,}-token bucket, one {longest:,}-token prompt + {self.args.max_tokens} "
                                 f"output tokens > the model's {context_tokens:,}-token context — {side}: {what}")
        self._record(event="probe", model=model, target=target, prompt_tokens=longest,
                     **{side: asdict(a) | {"text": a.text[:80]} for side, a in outcomes.items()})

    def _check_model(self, report: ModelReport, model: str, gguf: Path, maker: wl.PromptMaker, tokenizer: Any,
                     workload: wl.Workload) -> None:
        """Tokenization (every prompt of one round) and greedy outputs (a few prompts) on both sides."""
        prompts = self._prompts(maker, workload)
        server = self._start_llama(report, gguf, workload, 1)
        try:
            ids_llama = [asyncio.run(llama_tokenize(server.base_url, p)) for p in prompts]
            num_same = sum(a == tokenizer.encode(p) for a, p in zip(ids_llama, prompts, strict=True))
            checked = prompts[: self.args.greedy_checks]
            texts_llama = [asyncio.run(complete_once(server.base_url, model, p, self.args.max_tokens)) for p in checked]
        finally:
            server.stop()
        texts_shoal = [asyncio.run(complete_once(self.shoal_url, model, p, self.args.max_tokens)) for p in checked]
        ids_hf = [_hf_greedy(self.args.models_root / model, tokenizer, p, self.args.max_tokens,
                             rounded=self.args.weights == "bf16") for p in checked]
        label = f"~{workload.target_length:,}-token prompts"
        report.checks.append(f"{label}: llama-server's /tokenize equals the model tokenizer for {num_same} of "
                             f"{len(prompts)} prompts")
        for i, (shoal, llama, (hf, margins)) in enumerate(zip(texts_shoal, texts_llama, ids_hf, strict=True)):
            report.checks.append(
                f"{label}, greedy prompt {i} ({workload.prompt_lengths[i]:,} tokens, {self.args.max_tokens} out): "
                f"Shoal vs HF generate: {compare_texts(tokenizer, shoal.text, hf, margins)}; "
                f"llama.cpp vs HF generate: {compare_texts(tokenizer, llama.text, hf, margins)}; "
                f"Shoal vs llama.cpp: {'equal' if shoal.text == llama.text else 'differ'}"
            )
        self._record(event="checks", model=model, target=workload.target_length, tokenize_same=num_same,
                     of=len(prompts), greedy=report.checks[-len(checked):] if checked else [])

    def _bench_cell(self, report: ModelReport, model: str, gguf: Path, maker: wl.PromptMaker,
                    workload: wl.Workload) -> wl.Row:
        c, target = workload.concurrency, workload.target_length
        row = wl.Row(model, workload, None, None, parallel=c)
        # warm-up: a few requests of this cell's lengths and 8 tokens, so first-use costs stay out
        warm = wl.Workload(target, workload.prompt_lengths[:4], 8, workload.clipped)
        candidates = get_parallel_candidates(c, self.args.parallel)
        try:
            asyncio.run(run_side(self.shoal_url, model, self._prompts(maker, warm), warm))
            preemptions_before = asyncio.run(read_shoal_preemptions(self.shoal_url, model))
            if len(candidates) > 1:  # pilot: each candidate twice (A B B A), its best run kept
                rates: dict[int, float] = {}
                for parallel in candidates + candidates[::-1]:
                    pilot = self._prompts(maker, workload)
                    server = self._start_llama(report, gguf, workload, parallel)
                    try:
                        self._wait_for_quiet()
                        rate = asyncio.run(run_side(server.base_url, model, pilot, workload)).tokens_per_s
                    finally:
                        server.stop()
                    rates[parallel] = max(rate, rates.get(parallel, 0.0))
                row.parallel = max(rates, key=lambda p: rates[p])
                self._record(event="pilot", model=model, target=target, c=c,
                             tokens_per_s={p: round(r, 1) for p, r in rates.items()})
            else:
                row.parallel = candidates[0]
            server = self._start_llama(report, gguf, workload, row.parallel)
            try:
                asyncio.run(run_side(server.base_url, model, self._prompts(maker, warm), warm))
                runs: dict[str, list[wl.RunResult]] = {"shoal": [], "llama": []}
                num_quiet, round_index = 0, 0
                # A round whose runs did not all start on a quiet machine is repeated (both sides),
                # at most --max-extra-rounds times; every round's runs count for the best.
                while num_quiet < self.args.rounds and round_index < self.args.rounds + self.args.max_extra_rounds:
                    prompts = self._prompts(maker, workload)
                    order = ("shoal", "llama") if round_index % 2 == 0 else ("llama", "shoal")
                    quiet = True
                    for side in order:
                        url = self.shoal_url if side == "shoal" else server.base_url
                        idle = self._wait_for_quiet()
                        quiet = quiet and idle >= self.args.quiet_idle
                        result = asyncio.run(run_side(url, model, prompts, workload))
                        runs[side].append(result)
                        self._record(event="run", model=model, target=target, c=c, side=side, round=round_index,
                                     parallel=row.parallel, tokens_per_s=round(result.tokens_per_s, 1),
                                     ttft_mean_ms=round(result.ttft_mean_ms, 1), seconds=round(result.seconds, 2),
                                     idle_before=round(idle, 2))
                    num_quiet += quiet
                    round_index += 1
                row.num_rounds, row.num_busy_rounds = round_index, round_index - num_quiet
            finally:
                server.stop()
            row.num_shoal_preemptions = asyncio.run(read_shoal_preemptions(self.shoal_url, model)) - preemptions_before
            row.shoal, row.llama = wl.best_run(runs["shoal"]), wl.best_run(runs["llama"])
        except CellFailed as exc:
            row.notes.append(str(exc))
            self._record(event="failed", model=model, target=target, c=c, error=str(exc))
        return row


def _hf_greedy(path: Path, tokenizer: Any, prompt: str, max_tokens: int, *, rounded: bool = False
               ) -> tuple[list[int], list[float]]:
    """transformers' greedy `generate` of the prompt, never stopping at EOS (as Shoal's ``ignore_eos``):
    the token ids, and at each step the gap between the two largest logits (a near tie flips on
    the smallest difference in summation order). `rounded`: the model with every weight rounded
    to bfloat16, run in float32 (what Shoal serves with ``dtype = "bfloat16"``)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = _HF_MODELS.get((path, rounded))
    if model is None:
        model = _HF_MODELS[path, rounded] = AutoModelForCausalLM.from_pretrained(path).eval()
        if rounded:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.data = parameter.data.to(torch.bfloat16).float()
    ids = torch.tensor([tokenizer.encode(prompt)])
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id, output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    margins = [float(top[0, 0] - top[0, 1]) for top in (logits.topk(2).values for logits in out.logits)]
    return [int(t) for t in out.sequences[0, ids.shape[1]:]], margins


_HF_MODELS: dict[tuple[Path, bool], Any] = {}


def compare_texts(tokenizer: Any, text: str, reference_ids: list[int], margins: list[float]) -> str:
    """"equal", or the token (of the reference) where `text` departs from it, and what that token is.

    Texts are compared because both servers return text; the reference is decoded without
    special tokens, as the servers do, and the position is the length in reference tokens
    of the longest common prefix (approximate where a token is cut in half).
    """
    reference = tokenizer.decode(reference_ids, skip_special_tokens=True)
    if text == reference:
        return "equal"
    common = 0
    while common < min(len(text), len(reference)) and text[common] == reference[common]:
        common += 1
    position = 0
    while position < len(reference_ids) and len(
            tokenizer.decode(reference_ids[: position + 1], skip_special_tokens=True)) <= common:
        position += 1
    what = ""
    if position < len(reference_ids):
        token = tokenizer.convert_ids_to_tokens(reference_ids[position])
        special = ", a special token" if reference_ids[position] in tokenizer.all_special_ids else ""
        what = f" (the reference's token there: {token!r}{special}; its top-2 logit gap {margins[position]:.2g})"
    return f"differ from token {position} of {len(reference_ids)}{what}"


# --- report -----------------------------------------------------------------------------------


def render_section(args: argparse.Namespace, reports: list[ModelReport], *, command: str, shoal_command: str,
                   llama_version: str, started: datetime.datetime, minutes: float, loads: list[float],
                   idle_shares: list[float]) -> str:
    """The generated part of the peer section: how it was run, the table, the checks."""
    rows = [row for report in reports for row in report.rows]
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    lines = [
        f"Run of {started:%Y-%m-%d %H:%M} UTC, {minutes:.0f} min, Shoal at `{commit}`, llama.cpp from "
        f"llama-cpp-python {args.llama_cpp_python} (`llama-server --version`: {llama_version}); "
        f"{os.cpu_count()} cores, load average (1 min) {min(loads, default=0):.1f}–{max(loads, default=0):.1f} "
        f"during the runs; before each measured run the script waited (at most {args.quiet_wait:.0f} s) for the "
        f"cores to be ≥ {100 * args.quiet_idle:.0f}% idle over 1 s: idle share then "
        f"{_fmt_share(idle_shares)}.",
        "",
        "```",
        command,
        "```",
        "",
        f"Threads: {args.threads} on both sides. Shoal: `{shoal_command}`. llama.cpp, per cell "
        "(`-c` = `--parallel` × (longest prompt + output, rounded up to 256)):",
        "",
        "```",
        *[c for report in reports for c in report.server_commands],
        "```",
        "",
        f"Output tokens/s over all C requests ({args.max_tokens} output tokens each, greedy, EOS ignored, "
        f"all sent at once, streamed), best of {args.rounds} rounds per side in alternating order (a round "
        f"with a run that started on a busy machine repeated, up to {args.max_extra_rounds} more: the last "
        "column); "
        "TTFT = mean time to the first streamed text. `--parallel`: the best of a pilot at C and C/2 "
        "slots (each measured twice). Shoal preemptions: its engines' own counter over the cell's runs "
        "(`shoal_worker_preemptions_total` on the gateway's /metrics).",
        "",
        wl.render_table(rows),
    ]
    failed = [row for row in rows if row.notes]
    if failed:
        lines += ["", "Cells that did not run to the end (—):", ""]
        lines += [f"* {row.model}, ~{row.workload.target_length:,} tokens, C = {row.workload.concurrency}: "
                  f"{'; '.join(row.notes)}" for row in failed]
    lines += ["", "Checks:", ""]
    lines += [f"* {report.model}: {check}" for report in reports for check in report.checks]
    return "\n".join(lines)


def _fmt_share(shares: list[float]) -> str:
    if not shares:
        return "not measured"
    below = sum(share < 0.7 for share in shares)
    return (f"median {100 * statistics.median(shares):.0f}%, lowest {100 * min(shares):.0f}% "
            f"({below} of {len(shares)} runs started below 70%)")


def get_bf16_config(models: list[str]) -> str:
    """A shoal.toml serving `models` (demo keys) with bfloat16 weights, under their own keys."""
    return "".join(f'[[models]]\nkey = "{m}"\npath = "{m}"\ndtype = "bfloat16"\n\n' for m in models)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.UTC)
    command = "python scripts/bench_peers.py " + " ".join(sys.argv[1:] if argv is None else argv)
    llama = llama_cpp.build_server(args.cache, args.llama_cpp_python)
    llama_version = llama_cpp.get_server_commit(llama)
    ggufs = {}
    for model in args.models:
        gguf = llama_cpp.get_version_dir(args.cache, args.llama_cpp_python) / "gguf" / (
            model.replace("/", "--") + f"-{args.weights}.gguf")
        ggufs[model] = llama_cpp.convert_model(llama, args.models_root / model, gguf, gguf.with_suffix(".log"),
                                               outtype=args.weights)
    print(f"llama-server: {llama.server} ({llama_version}); GGUFs: {', '.join(map(str, ggufs.values()))}",
          flush=True)
    if args.build_only:
        return

    from tests.e2e.conftest import start_shoal_up

    os.environ["SHOAL_WORKER_TORCH_THREADS"] = str(args.threads)
    reports: list[ModelReport] = []
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as state:
        logs = Path(state) / "bench-logs"
        logs.mkdir()
        extra: list[str] = []
        if args.weights == "bf16":  # the models under their own keys, served with bfloat16 weights
            config = Path(state) / "shoal.toml"
            config.write_text(get_bf16_config(args.models))
            extra = ["--config", str(config)]
        shoal = start_shoal_up(args.models_root.resolve(), Path(state) / "shoal", "--log-level", "warning", *extra,
                               env={"SHOAL_WORKER_STATS_INTERVAL_S": str(STATS_INTERVAL_S)})
        shoal_command = (f"SHOAL_WORKER_TORCH_THREADS={args.threads} SHOAL_WORKER_STATS_INTERVAL_S="
                         f"{STATS_INTERVAL_S:g} shoal up --port <free> --models-root <models root> --state-dir <temp> "
                         f"--gpus virtual:2x16GiB" + (" --config <shoal.toml: the models with dtype = \"bfloat16\">"
                                                      if extra else ""))
        bench = Bench(args, llama, shoal.base_url, logs)
        try:
            for model in args.models:
                reports.append(bench.bench_model(model, ggufs[model]))
        finally:
            shoal.stop()
            if args.json:
                args.json.write_text(json.dumps(bench.runs, indent=1))
    minutes = (datetime.datetime.now(datetime.UTC) - started).total_seconds() / 60
    section = render_section(args, reports, command=command, shoal_command=shoal_command,
                             llama_version=llama_version, started=started, minutes=minutes, loads=bench.loads,
                             idle_shares=bench.idle_shares)
    print("\n" + section)
    if not args.no_docs:
        args.docs.write_text(wl.replace_section(args.docs.read_text(), section))
        print(f"\nwrote the peer section of {args.docs}")


if __name__ == "__main__":
    main()
