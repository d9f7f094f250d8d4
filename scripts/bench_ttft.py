"""Time to first token at C = 1: Shoal's engine alone, Shoal through its gateway, llama.cpp.

One request at a time, as a user typing into a chat would send them. Three sides, the same
prompts (~`--prompt-tokens` tokens, cut from the demo corpus as in ``bench_peers.py``),
exactly `--max-tokens` output tokens each, greedy, EOS ignored:

* **engine**: the `PagedEngine` a worker builds (worker defaults, session cache on), in this
  process; TTFT from the `generate()` call to its first output with text. What Shoal's
  serving path adds (HTTP, the gateway, JetStream, the worker's loop, NATS replies, SSE) is
  the gateway side's figure minus this one.
* **gateway**: `shoal up` as shipped (its own state directory, a free port), streamed
  ``/v1/completions``; TTFT from the request's send to the first streamed text.
* **llama.cpp**: ``llama-server --parallel 1`` on the same weights as an f32 GGUF, built and
  converted by ``peer_llama_cpp.py`` (skipped with ``--no-llama``, or when it is not built
  yet and ``--build`` is not given: a build takes ~10 minutes).

* **gateway, asyncio loop** (with ``--asyncio-side``): a second `shoal up`, its processes on
  asyncio's standard event loop instead of uvloop (``SHOAL_EVENT_LOOP=asyncio``).

All sides get `--threads` threads. Each round runs every side once (`--requests` requests
each), the order reversed every other round; a round waits first (at most `--quiet-wait`
seconds) for the cores to be idle. Per side the table gives the median TTFT of every request
and of its best round, and the median time per output token after the first.

    python scripts/bench_ttft.py --models-root /work/main/models
    python scripts/bench_ttft.py --model demo/llama-5m --threads 2 --rounds 4 --no-llama
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import bench_peers  # scripts/, next to this file (on sys.path when run as a script)
import peer_llama_cpp as llama_cpp
import peer_workload as wl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Timing:
    """One request: seconds to its first text, and per output token after that."""

    ttft_s: float
    per_token_s: float


@dataclass
class Side:
    """One way of serving the requests, and what its requests measured, per round."""

    name: str
    rounds: list[list[Timing]] = field(default_factory=list)

    def get_ttft_ms(self) -> float:
        """Median TTFT over every request of every round, in ms."""
        return 1e3 * statistics.median(t.ttft_s for r in self.rounds for t in r)

    def get_best_round_ttft_ms(self) -> float:
        """The lowest of the rounds' median TTFTs, in ms."""
        return 1e3 * min(statistics.median(t.ttft_s for t in r) for r in self.rounds)

    def get_per_token_ms(self) -> float:
        """Median time per output token after the first, in ms."""
        return 1e3 * statistics.median(t.per_token_s for r in self.rounds for t in r)


def render_table(sides: Sequence[Side], baseline: str | None) -> str:
    """A markdown table of the sides, with each one's TTFT as a multiple of `baseline`'s."""
    reference = next((s for s in sides if s.name == baseline), None)
    header = "| side | TTFT median, ms | best round's median, ms | ms per output token (tok/s) |"
    rule = "| --- | ---: | ---: | ---: |"
    if reference is not None:
        header += f" TTFT / {reference.name} |"
        rule += " ---: |"
    lines = [header, rule]
    for side in sides:
        per_token = side.get_per_token_ms()
        line = (f"| {side.name} | {side.get_ttft_ms():.2f} | {side.get_best_round_ttft_ms():.2f} | "
                f"{per_token:.3f} ({1e3 / per_token:,.0f}) |")
        if reference is not None:
            line += f" {side.get_ttft_ms() / reference.get_ttft_ms():.2f} |"
        lines.append(line)
    return "\n".join(lines)


def get_round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The sides' order in round `round_index`: as given, reversed every other round."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


async def time_http_stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                           max_tokens: int) -> Timing:
    """One streamed completion through an OpenAI-style server; raises if it is not exact."""
    t0 = time.perf_counter()
    answer = await bench_peers.stream_completion(session, url + "/v1/completions",
                                                 bench_peers.completion_body(model, prompt, max_tokens), t0)
    if answer.status != 200 or answer.error or answer.num_output_tokens != max_tokens:
        raise RuntimeError(f"{url}: HTTP {answer.status} {answer.error} ({answer.num_output_tokens} tokens)")
    return Timing(answer.ttft_s, (answer.done_s - answer.ttft_s) / max(1, max_tokens - 1))


class DirectEngine:
    """The worker's engine for one model, in this process."""

    def __init__(self, model_dir: Path, model_key: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from shoal.services.worker.engine.factory import build_paged_engine
        from shoal.services.worker.loader import LoadedModel
        from shoal.services.worker.main import GIL_SWITCH_INTERVAL_S, resolve_session_settings
        from shoal.services.worker.prompts import eos_token_ids
        from shoal.shared.config import WorkerConfig

        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as in a worker process
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        max_model_len = int(model.config.max_position_embeddings)
        loaded = LoadedModel(model, tokenizer, torch.device("cpu"), torch.float32, 0, max_model_len, 0)
        worker = WorkerConfig()
        self.engine = build_paged_engine(loaded, worker,
                                         sessions=resolve_session_settings(worker.sessions, model_key))
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids(tokenizer, model)
        self._max_model_len = max_model_len
        self._num_requests = 0

    async def time_request(self, prompt: str, max_tokens: int) -> Timing:
        """One request, as the worker runs it: its prompt encoded, then `generate()`."""
        from shoal.services.worker.generation import GenerationRequest
        from shoal.shared.messages import SamplingParams

        t0 = time.perf_counter()
        self._num_requests += 1
        request = GenerationRequest(
            f"direct-{self._num_requests}", list(self._tokenizer.encode(prompt, add_special_tokens=True)),
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), self._eos_token_ids,
            self._max_model_len)
        first = None
        num_tokens = 0
        async for output in self.engine.generate(request):
            if output.text and first is None:
                first = time.perf_counter()
            num_tokens = output.num_completion_tokens or num_tokens
        done = time.perf_counter()
        if first is None or num_tokens != max_tokens:
            raise RuntimeError(f"the engine gave {num_tokens} tokens, not {max_tokens}")
        return Timing(first - t0, (done - first) / max(1, max_tokens - 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo/llama-5m", help="model key under the models root")
    parser.add_argument("--models-root", type=Path, default=REPO / "models")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=20, help="requests per side and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads for every side")
    parser.add_argument("--quiet-wait", type=float, default=30.0,
                        help="seconds a round waits at most for idle cores (0: no wait)")
    parser.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--asyncio-side", action="store_true",
                        help="add a second `shoal up` on asyncio's standard event loop (SHOAL_EVENT_LOOP=asyncio)")
    parser.add_argument("--build", action="store_true", help="build llama-server if it is not built yet")
    parser.add_argument("--cache", type=Path, default=llama_cpp.DEFAULT_CACHE)
    parser.add_argument("--json", type=Path, help="write every request's timings here")
    args = parser.parse_args(argv)
    if args.max_tokens < 2 or args.requests < 1 or args.rounds < 1:
        parser.error("--max-tokens must be >= 2, --requests and --rounds >= 1")
    return args


def start_llama(args: argparse.Namespace, logs: Path) -> llama_cpp.LlamaServer | None:
    """llama-server for the model, or None when it is left out or not built."""
    if args.no_llama:
        return None
    version_dir = llama_cpp.get_version_dir(args.cache, llama_cpp.LLAMA_CPP_PYTHON_VERSION)
    if not args.build and not (version_dir / "build.stamp").exists():
        print(f"llama-server is not built in {version_dir}: left out (--build builds it, ~10 min)", flush=True)
        return None
    llama = llama_cpp.build_server(args.cache)
    gguf = version_dir / "gguf" / (args.model.replace("/", "--") + "-f32.gguf")
    gguf = llama_cpp.convert_model(llama, args.models_root / args.model, gguf, gguf.with_suffix(".log"))
    ctx_tokens = -(-(args.prompt_tokens + args.max_tokens) // 256) * 256
    return llama_cpp.start_server(llama, gguf, logs / "llama-server.log", parallel=1, ctx_tokens=ctx_tokens,
                                  threads=args.threads)


async def run_rounds(args: argparse.Namespace, runners: dict[str, Callable[[str], Awaitable[Timing]]],
                     make_prompt: Callable[[int], str]) -> list[Side]:
    sides = {name: Side(name) for name in runners}
    for run in runners.values():  # warm-up: first requests of a process are slower
        for i in range(3):
            await run(make_prompt(9000 + i))
    number = 0
    for round_index in range(args.rounds):
        prompts = [make_prompt(number + i) for i in range(args.requests)]
        number += args.requests
        for name in get_round_order(list(runners), round_index):
            if args.quiet_wait > 0:
                bench_peers.wait_for_quiet(args.quiet_wait, 0.7)
            load = os.getloadavg()[0]
            timings = [await runners[name](prompt) for prompt in prompts]
            sides[name].rounds.append(timings)
            print(json.dumps({"round": round_index, "side": name, "load1": round(load, 2),
                              "ttft_ms": round(1e3 * statistics.median(t.ttft_s for t in timings), 2),
                              "per_token_ms": round(1e3 * statistics.median(t.per_token_s for t in timings), 3)}),
                  flush=True)
    return list(sides.values())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from shoal.shared.event_loop import EVENT_LOOP_ENV
    from tests.e2e.conftest import start_shoal_up

    os.environ["SHOAL_WORKER_TORCH_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    model_dir = args.models_root / args.model
    maker = wl.make_prompt_maker(AutoTokenizer.from_pretrained(model_dir), (REPO / "cli" / "demo_corpus.txt").read_text())
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as state:
        logs = Path(state) / "logs"
        logs.mkdir()
        shoal = start_shoal_up(args.models_root.resolve(), Path(state) / "shoal", "--log-level", "warning")
        shoal_asyncio = (start_shoal_up(args.models_root.resolve(), Path(state) / "shoal-asyncio", "--log-level",
                                        "warning", env={EVENT_LOOP_ENV: "asyncio"})
                         if args.asyncio_side else None)
        llama = None
        try:
            llama = start_llama(args, logs)
            direct = DirectEngine(model_dir, args.model)

            async def run_all() -> list[Side]:
                timeout = aiohttp.ClientTimeout(total=bench_peers.REQUEST_TIMEOUT_S)
                # A new connection per request, as bench_peers.py's runs (and llama-server closes
                # a streamed response's connection, which a pooled session would reuse).
                connector = aiohttp.TCPConnector(force_close=True)
                async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
                    runners: dict[str, Callable[[str], Awaitable[Timing]]] = {
                        "engine": lambda p: direct.time_request(p, args.max_tokens),
                        "gateway": lambda p: time_http_stream(session, shoal.base_url, args.model, p, args.max_tokens),
                    }
                    if shoal_asyncio is not None:
                        runners["gateway, asyncio loop"] = lambda p: time_http_stream(
                            session, shoal_asyncio.base_url, args.model, p, args.max_tokens)
                    if llama is not None:
                        runners["llama.cpp"] = lambda p: time_http_stream(session, llama.base_url, args.model, p,
                                                                          args.max_tokens)
                    try:
                        return await run_rounds(args, runners, lambda n: maker.make(args.prompt_tokens, n))
                    finally:
                        await direct.engine.close()

            sides = asyncio.run(run_all())
        finally:
            if llama is not None:
                llama.stop()
            shoal.stop()
            if shoal_asyncio is not None:
                shoal_asyncio.stop()
    loads.append(os.getloadavg()[0])
    print(f"\n{args.model}, ~{args.prompt_tokens}-token prompts, {args.max_tokens} output tokens, C = 1, "
          f"{args.threads} thread(s), {args.rounds} rounds x {args.requests} requests per side; "
          f"load average {loads[0]:.2f} -> {loads[1]:.2f}")
    print(render_table(sides, "llama.cpp" if llama is not None else "engine"))
    if args.json:
        args.json.write_text(json.dumps({s.name: [[t.__dict__ for t in r] for r in s.rounds] for s in sides}))


if __name__ == "__main__":
    main()
