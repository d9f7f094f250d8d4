"""Chat sessions served live: returning-turn TTFT and throughput through one real worker
(issue 12's benchmark 2), for three engines on the same conversations, in one run:

* none      no session cache, no prefix cache: every turn prefills its whole history
* prefix    today's prefix cache (block hashes, LRU of freed blocks), no session cache
* tiered    the session cache (GPU / CPU / dropped tiers) over the prefix cache

each at KV pool sizes (``--kv-tokens``) below and above the conversations' working set.

Everything is the real serving path: an embedded nats-server, an in-process gateway, and for
each (engine, pool size) a fresh ``shoal worker`` process started with a `WorkerLaunch`
(virtual GPU: tensors on the CPU), its KV pool capped by the model's ``kv_cache_tokens``.
Clients stream ``POST /v1/chat/completions`` (greedy, ``ignore_eos``) and time the first SSE
data line (time to first token, at the client). The conversations (seeded): `--sessions`
sessions of `--turns` turns; each turn adds a user message of `--user-words` random words
(about 1.3 tokens each) and the model's `--answer-tokens`-token answer to the history,
after a shared system prompt; turns of all sessions interleave (each session's next turn
waits for its answer), at most `--concurrency` requests at once. The working set is the
KV of every session's history, which grows to about sessions x (system + turns x
(user + answer)) tokens. Answers must be equal across engines (greedy, and every engine is
exact): the script checks it.

    python scripts/bench_sessions_live.py [--model demo/llama-5m] [--kv-tokens 4096 32768]
        [--sessions 16] [--turns 6] [--concurrency 4] [--out results.json]

Reports, per engine and pool size: returning-turn (turns 2..) TTFT p50 and p99, first-turn
TTFT p50, generated tokens per second over the run, and the worker's own counters (session
hits, tokens reused / recomputed, prefix cache hit rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from nats.aio.msg import Msg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shoal.services.gateway.app import start_gateway  # noqa: E402
from shoal.services.worker.launch import WorkerLaunch, encode_launch  # noqa: E402
from shoal.shared import subjects  # noqa: E402
from shoal.shared.bus import Bus, connect  # noqa: E402
from shoal.shared.config import GatewayConfig, LoggingConfig, SessionConfig, WorkerConfig  # noqa: E402
from shoal.shared.logs import configure_logging  # noqa: E402
from shoal.shared.messages import ModelSpec, ReplicaRecord, WorkerStats, worker_stats_decoder  # noqa: E402
from shoal.shared.nats_server import EmbeddedNatsServer  # noqa: E402
from tests.e2e.conftest import free_port  # noqa: E402

ENGINES = ("none", "prefix", "tiered")
WORDS = ["harbour", "boat", "tide", "cliff", "lighthouse", "keeper", "storm", "gull", "net", "rope", "anchor", "sail", "wave", "shore", "rock", "fort", "village", "door", "blue", "green", "path", "dune", "sand", "shell", "crab", "fish", "morning", "evening", "night", "wind", "rain", "fog", "bell", "market", "bread", "salt", "stone", "wall", "bridge", "river", "mill", "field", "sheep", "hill", "road", "cart", "lamp", "window", "letter"]
SYSTEM = ("You are a patient guide to the coast. Answer in plain words, name the places you mention, "
          "and keep every answer short enough to read aloud on a windy pier.")
ALLOCATION_BYTES = 4 << 30
"""The virtual GPU bytes each worker is given: more than any pool here, so the pool is what
the model's `kv_cache_tokens` allows."""


@dataclass
class Turn:
    session: int
    index: int
    ttft_s: float
    seconds: float
    num_tokens: int
    answer: str


@dataclass
class Result:
    engine: str
    kv_tokens: int
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    stats: dict[str, object] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        returning = sorted(t.ttft_s for t in self.turns if t.index > 0)
        first = sorted(t.ttft_s for t in self.turns if t.index == 0)
        return {
            "engine": self.engine,
            "kv_tokens": self.kv_tokens,
            "returning_ttft_p50_ms": 1000 * percentile(returning, 0.5),
            "returning_ttft_p99_ms": 1000 * percentile(returning, 0.99),
            "first_ttft_p50_ms": 1000 * percentile(first, 0.5),
            "tokens_per_s": sum(t.num_tokens for t in self.turns) / self.wall_s,
            "turns_per_s": len(self.turns) / self.wall_s,
            **self.stats,
        }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def make_questions(num_sessions: int, num_turns: int, num_words: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [[" ".join(rng.choice(WORDS) for _ in range(num_words)) + "?" for _ in range(num_turns)]
            for _ in range(num_sessions)]


def worker_config(engine: str, host_pool_bytes: int) -> WorkerConfig:
    sessions = SessionConfig(enabled=engine == "tiered", host_pool_bytes=host_pool_bytes)
    return WorkerConfig(prefix_caching=engine != "none", sessions=sessions, stats_interval_s=0.5)


class Bench:
    def __init__(self, args: argparse.Namespace, bus: Bus, base_url: str, work_dir: Path) -> None:
        self.args = args
        self.bus = bus
        self.base_url = base_url
        self.work_dir = work_dir
        self.latest: dict[str, WorkerStats] = {}

    async def on_stats(self, msg: Msg) -> None:
        stats = worker_stats_decoder.decode(msg.data)
        self.latest[stats.replica_id] = stats

    async def start_worker(self, engine: str, kv_tokens: int) -> tuple[str, subprocess.Popen[bytes]]:
        args = self.args
        replica_id = uuid.uuid4().hex
        spec = ModelSpec(key=args.model, path=args.model, kv_cache_tokens=kv_tokens, desired_replicas=1)
        record = ReplicaRecord(replica_id=replica_id, model=args.model, node_id="bench", state="ready",
                               gpu_bytes={0: ALLOCATION_BYTES}, gpu_memory_fraction=0.5)
        await self.bus.models.put(subjects.model_token(args.model), spec)
        await self.bus.replicas.put(subjects.replica_kv_key(args.model, replica_id), record)
        launch = WorkerLaunch(nats_url=args.nats_url, node_id="bench", models_root=str(args.models_root.resolve()),
                              device="cpu", replica=record, model=spec,
                              worker=worker_config(engine, args.host_pool_mib << 20),
                              logging=LoggingConfig(level="warning"))
        log = (self.work_dir / f"worker-{engine}-{kv_tokens}.log").open("wb")
        process = subprocess.Popen([sys.executable, "-m", "shoal.services.worker"], stdin=subprocess.PIPE,
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ""})
        assert process.stdin is not None
        process.stdin.write(encode_launch(launch))
        process.stdin.close()
        deadline = time.monotonic() + 300
        while replica_id not in self.latest:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the {engine} worker did not start; see {log.name}")
            await asyncio.sleep(0.2)
        return replica_id, process

    async def stop_worker(self, replica_id: str, process: subprocess.Popen[bytes]) -> None:
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 60)
        await self.bus.replicas.delete(subjects.replica_kv_key(self.args.model, replica_id))

    async def chat(self, http: aiohttp.ClientSession, messages: list[dict[str, str]], session_id: str | None
                   ) -> tuple[float, float, str, int]:
        """(TTFT, total seconds, answer, completion tokens) of one streamed greedy turn."""
        body = {"model": self.args.model, "messages": messages, "max_tokens": self.args.answer_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if session_id is not None:
            body["session_id"] = session_id
        started = time.perf_counter()
        ttft = None
        text: list[str] = []
        num_tokens = 0
        async with http.post(self.base_url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - started
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    text.append(choice["delta"].get("content") or "")
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
        assert ttft is not None
        return ttft, time.perf_counter() - started, "".join(text), num_tokens

    async def run_conversations(self, engine: str, kv_tokens: int, questions: list[list[str]]) -> Result:
        result = Result(engine, kv_tokens)
        slots = asyncio.Semaphore(self.args.concurrency)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await self.chat(http, [{"role": "user", "content": "warm up"}], None)

            async def session(index: int) -> None:
                messages = [{"role": "system", "content": SYSTEM}]
                session_id = f"{engine}-{kv_tokens}-{index}" if engine == "tiered" else None
                for turn, question in enumerate(questions[index]):
                    messages.append({"role": "user", "content": question})
                    async with slots:
                        ttft, seconds, answer, num_tokens = await self.chat(http, messages, session_id)
                    result.turns.append(Turn(index, turn, ttft, seconds, num_tokens, answer))
                    messages.append({"role": "assistant", "content": answer})

            started = time.perf_counter()
            await asyncio.gather(*(session(i) for i in range(len(questions))))
            result.wall_s = time.perf_counter() - started
        return result

    async def measure(self, engine: str, kv_tokens: int, questions: list[list[str]]) -> Result:
        replica_id, process = await self.start_worker(engine, kv_tokens)
        try:
            before = self.latest[replica_id]
            result = await self.run_conversations(engine, kv_tokens, questions)
            await asyncio.sleep(1.5)  # the worker's stats after the last turn
            result.stats = worker_figures(before, self.latest[replica_id])
        finally:
            await self.stop_worker(replica_id, process)
        print(json.dumps(result.summary()), flush=True)
        return result


def worker_figures(before: WorkerStats, after: WorkerStats) -> dict[str, object]:
    """What the worker says it did during the conversations (the warm-up excluded)."""
    figures: dict[str, object] = {"preemptions": after.num_preemptions - before.num_preemptions}
    if after.kv_cache is not None and before.kv_cache is not None:
        queries = after.kv_cache.num_cache_queries - before.kv_cache.num_cache_queries
        hits = after.kv_cache.num_cache_hits - before.kv_cache.num_cache_hits
        figures["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
        figures["kv_pool_blocks"] = after.kv_cache.num_blocks
    if after.sessions is not None and before.sessions is not None:
        a, b = after.sessions, before.sessions
        figures |= {
            "session_hits": a.num_hits - b.num_hits,
            "session_misses": a.num_misses - b.num_misses,
            "tokens_from_gpu": a.num_gpu_reused_tokens - b.num_gpu_reused_tokens,
            "tokens_from_cpu": a.num_cpu_restored_tokens - b.num_cpu_restored_tokens,
            "tokens_from_prefix_cache": a.num_prefix_cached_tokens - b.num_prefix_cached_tokens,
            "tokens_recomputed": a.num_recomputed_tokens - b.num_recomputed_tokens,
            "swap_in_mib": (a.swap_in_bytes - b.swap_in_bytes) / 2**20,
            "exposed_swap_ms": 1000 * (a.exposed_swap_seconds - b.exposed_swap_seconds),
        }
    return figures


def print_table(results: list[Result]) -> None:
    print("\n| KV pool (tokens) | engine | returning-turn TTFT p50 | p99 | first-turn TTFT p50 | tokens/s | "
          "turns/s | session hits / misses | history tokens reused GPU / CPU / recomputed | prefix-cache hit rate |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for result in results:
        s = result.summary()
        sessions = (f"{s['session_hits']} / {s['session_misses']}" if "session_hits" in s else "-")
        reuse = (f"{s['tokens_from_gpu']} / {s['tokens_from_cpu']} / {s['tokens_recomputed']}"
                 if "session_hits" in s else "-")
        print(f"| {result.kv_tokens} | {result.engine} | {s['returning_ttft_p50_ms']:.1f} ms | "
              f"{s['returning_ttft_p99_ms']:.1f} ms | {s['first_ttft_p50_ms']:.1f} ms | {s['tokens_per_s']:.0f} | "
              f"{s['turns_per_s']:.2f} | {sessions} | {reuse} | {s.get('prefix_cache_hit_rate', 0.0):.2f} |")
    print()
    for kv_tokens in sorted({r.kv_tokens for r in results}):
        medians = {}
        for engine in ENGINES:
            runs = [r.summary() for r in results if r.kv_tokens == kv_tokens and r.engine == engine]
            if runs:
                medians[engine] = {key: statistics.median(float(run[key]) for run in runs)  # type: ignore[arg-type]
                                   for key in ("returning_ttft_p50_ms", "returning_ttft_p99_ms", "tokens_per_s")}
        text = ", ".join(f"{engine}: p50 {m['returning_ttft_p50_ms']:.1f} ms, p99 {m['returning_ttft_p99_ms']:.1f} ms, "
                         f"{m['tokens_per_s']:.0f} tok/s" for engine, m in medians.items())
        print(f"KV pool {kv_tokens} (medians over runs): {text}")
        if "tiered" in medians:
            tiered = medians["tiered"]
            for baseline in ("none", "prefix"):
                if baseline in medians:
                    print(f"  returning-turn TTFT p50 {baseline} / tiered = "
                          f"{medians[baseline]['returning_ttft_p50_ms'] / tiered['returning_ttft_p50_ms']:.2f}x, "
                          f"throughput tiered / {baseline} = {tiered['tokens_per_s'] / medians[baseline]['tokens_per_s']:.2f}x")


async def run(args: argparse.Namespace) -> list[Result]:
    questions = make_questions(args.sessions, args.turns, args.user_words, args.seed)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-sessions-") as tmp:
        server = EmbeddedNatsServer(store_dir=Path(tmp) / "jetstream")
        server.start()
        args.nats_url = server.url
        try:
            bus = await connect(server.url, "bench")
            port = free_port()
            runner = await start_gateway(GatewayConfig(port=port, request_timeout_s=600), server.url)
            log_dir = args.log_dir or Path(tmp)
            log_dir.mkdir(parents=True, exist_ok=True)
            bench = Bench(args, bus, f"http://127.0.0.1:{port}", log_dir)
            await bus.nc.subscribe(subjects.STATS_WILDCARD, cb=bench.on_stats)
            results = []
            try:
                for kv_tokens in args.kv_tokens:
                    for repeat in range(args.repeats):  # alternate the order: drift hits every engine alike
                        for engine in (args.engines if repeat % 2 == 0 else args.engines[::-1]):
                            results.append(await bench.measure(engine, kv_tokens, questions))
            finally:
                await runner.cleanup()
                await bus.close()
        finally:
            server.stop()
    reference = sorted((t.session, t.index, t.answer) for t in results[0].turns)
    for result in results:
        got = sorted((t.session, t.index, t.answer) for t in result.turns)
        assert got == reference, f"{result.engine} answered differently at a {result.kv_tokens}-token pool"
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo/llama-5m")
    parser.add_argument("--models-root", type=Path,
                        default=Path(os.environ.get("SHOAL_TEST_MODELS_ROOT", REPO / "models")))
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--kv-tokens", type=int, nargs="+", default=[4096, 32768],
                        help="KV pool sizes (the model's kv_cache_tokens)")
    parser.add_argument("--host-pool-mib", type=int, default=256, help="the tiered engine's CPU tier")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-words", type=int, default=60)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each engine, in alternating order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write every turn's figures here (JSON)")
    parser.add_argument("--log-dir", type=Path, help="keep the workers' logs here (default: a temporary directory)")
    args = parser.parse_args()
    configure_logging(level="warning")
    results = asyncio.run(run(args))
    print_table(results)
    if args.out:
        args.out.write_text(json.dumps([{"summary": r.summary(), "turns": [asdict(t) for t in r.turns]}
                                        for r in results], indent=1))


if __name__ == "__main__":
    main()
