"""`profile_decode.py --mode worker`: decode through `shoal up` as shipped, with NATS and the gateway.

For each model and C: C requests of exactly `--prompt-tokens` tokens (demo corpus text) and
`--max-tokens` output tokens, sent together through the gateway (streamed), `--runs` times.
Measured: CPU seconds of each process (/proc: the worker, `shoal up`'s own process with the
gateway, scheduler and node agent, nats-server, this client) per output token, and py-spy
samples of the worker (``--idle --threads``, non-blocking) sorted into what each thread did.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_peers  # scripts/, next to this file
import peer_workload as wl

REPO = Path(__file__).resolve().parents[1]
TICKS_PER_S = os.sysconf("SC_CLK_TCK")

# Where a worker sample goes: the first rule (in order) whose pattern a frame of the stack
# contains, frames read from the leaf up. Patterns are "function (file" prefixes of py-spy's
# frames.
STEP_RULES: tuple[tuple[str, str], ...] = (
    ("wait (threading.py", "step thread: idle (waiting for work)"),
    ("kernels/cpu", "forward: attention"),
    ("engine/attention.py", "forward: attention"),
    ("packed_linear.py", "forward: matmul"),
    ("apply_rotary_pos_emb", "forward: rotary"),
    ("rotate_half", "forward: rotary"),
    ("execute (", "forward: other (norms, activation, residual, module calls)"),
    ("plan_attention", "metadata"),
    ("prepare (", "metadata"),
    ("sample (", "sampling"),
    ("push (", "detokenization"),
    ("_emit (", "outputs"),
    ("send (", "hand-off to the event loop"),
    ("schedule (", "scheduling"),
    ("update (", "scheduling"),
)
LOOP_RULES: tuple[tuple[str, str], ...] = (
    ("select (selectors.py", "event loop: idle (select)"),
    ("nats/", "event loop: NATS client"),
    ("msgspec", "event loop: msgspec"),
    ("shoal/services/worker", "event loop: worker service"),
    ("services/worker", "event loop: worker service"),
    ("deliver", "event loop: worker service"),
    ("asyncio", "event loop: asyncio"),
)


def classify(frames: list[str]) -> str:
    """One py-spy stack (root first) -> a category (see STEP_RULES, LOOP_RULES)."""
    joined = ";".join(frames)
    if "concurrent/futures/thread.py" in joined and "_run_steps" not in joined:
        return "other threads (idle)" if frames and "_worker (" in frames[-1] else "other threads"
    if "_run_steps" in joined:
        rules, default = STEP_RULES, "step thread: other"
    elif "run_forever" in joined or "_run_once" in joined or "asyncio" in joined:
        rules, default = LOOP_RULES, "event loop: other"
    else:
        return "other threads (idle)" if frames and "wait" in frames[-1] else "other threads"
    for frame in reversed(frames):
        for pattern, category in rules:
            if pattern in frame:
                return category
    return default


def read_raw_samples(path: Path) -> collections.Counter[str]:
    """py-spy's raw (collapsed) output -> samples per category."""
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, num = line.rpartition(" ")
        if stack and num.isdigit():
            counts[classify(stack.split(";"))] += int(num)
    return counts


def get_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime


def find_pids(needle: str, *more: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline and all(m in cmdline for m in more):
            found.append(int(entry.name))
    return found


def worker_mode(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO))
    from tests.e2e.conftest import start_shoal_up

    os.environ["SHOAL_WORKER_TORCH_THREADS"] = str(args.threads)
    py_spy = Path(sys.executable).parent / "py-spy"
    results = []
    with tempfile.TemporaryDirectory(prefix="profile-worker-") as state:
        shoal = start_shoal_up(args.models_root.resolve(), Path(state) / "shoal", "--log-level", "warning")
        try:
            for model in args.models.split(","):
                tokenizer = AutoTokenizer.from_pretrained(args.models_root / model)
                maker = wl.make_prompt_maker(tokenizer, (REPO / "cli" / "demo_corpus.txt").read_text())
                numbers = wl.PromptNumbers(maker.num_corpus_tokens)
                asyncio.run(bench_peers.complete_once(shoal.base_url, model, maker.make(16, numbers.take(1)), 4))
                # the worker's command line names its NATS URL (this `shoal up`'s) and its model
                (worker,) = find_pids("shoal.services.worker", shoal.nats_url + " ", f'"key":"{model}"')
                (nats,) = find_pids("nats-server", state)
                pids = {"worker": worker, "shoal up (gateway, scheduler, node agent)": shoal.process.pid,
                        "nats-server": nats, "client (this script)": os.getpid()}
                for c in (int(x) for x in args.concurrency.split(",")):
                    workload = wl.Workload(args.prompt_tokens, (args.prompt_tokens,) * c, args.max_tokens)
                    warm = wl.make_prompts(maker, workload, numbers.take(c))
                    asyncio.run(bench_peers.run_side(shoal.base_url, model, warm, workload))
                    spy_dir = args.spy_dir or Path(state)
                    spy_dir.mkdir(parents=True, exist_ok=True)
                    samples = spy_dir / f"py-spy-{model.replace('/', '-')}-c{c}.txt"
                    spy = subprocess.Popen([str(py_spy), "record", "--pid", str(worker), "--rate", "200", "--idle",
                                            "--threads", "--nonblocking", "--format", "raw", "-o", str(samples)],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1.0)
                    before = {name: get_cpu_seconds(pid) for name, pid in pids.items()}
                    started = time.perf_counter()
                    num_tokens = 0
                    for _ in range(args.runs):
                        prompts = wl.make_prompts(maker, workload, numbers.take(c))
                        result = asyncio.run(bench_peers.run_side(shoal.base_url, model, prompts, workload))
                        num_tokens += sum(result.num_output_tokens)
                    wall = time.perf_counter() - started
                    after = {name: get_cpu_seconds(pid) for name, pid in pids.items()}
                    spy.send_signal(signal.SIGINT)
                    spy.wait(timeout=60)
                    counts = read_raw_samples(samples) if samples.exists() else collections.Counter()
                    total = sum(counts.values()) or 1
                    result_row = {
                        "model": model, "c": c, "tokens_per_s": round(num_tokens / wall, 1),
                        "cpu_ms_per_token": {name: round(1000 * (after[name] - before[name]) / num_tokens, 3)
                                             for name in pids},
                        "wall_ms_per_token": round(1000 * wall / num_tokens, 3),
                        "worker_samples": {k: round(100 * v / total, 1) for k, v in counts.most_common()},
                        "num_samples": total,
                    }
                    print(json.dumps(result_row), flush=True)
                    results.append(result_row)
        finally:
            shoal.stop()
    return results
