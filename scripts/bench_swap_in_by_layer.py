"""A returning turn whose history comes back from the host pool: all layers copied before the
pass, or layer by layer (`SessionSettings.swap_in_by_layer`), in one run.

    python scripts/bench_swap_in_by_layer.py [--model demo/llama-100m] [--history 1024 1920]

For each mode an engine (the demo model, native forward unless `--transformers`) serves
`--rounds` two-turn conversations per history length: a first turn of `--history` tokens
(its KV all goes to the host pool: the session cache may keep nothing in the KV pool), then
a returning turn that adds `--new-tokens` tokens, whose first step copies the history back
and prefills the new tokens. Reported per mode, medians over the rounds: the returning
turn's time to first token (the copies and the prefill step; measured at the engine's
async API) and its exposed swap time (the engine's own figure: how long the pass waited
for the copies). Modes alternate in each round; wall time.

* off       every layer in one copy before the pass (one `ops.swap_blocks` call)
* inline    layer l's copy just before layer l's attention, on the pass's thread
* thread    every layer's copy started on a helper thread at the start of the pass,
            layer l's waited for just before layer l's attention
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoModelForCausalLM, AutoTokenizer

from shoal.services.worker.engine.engine_config import EngineConfig
from shoal.services.worker.engine.paged_engine import PagedEngine
from shoal.services.worker.generation import GenerationRequest
from shoal.shared.kv_cache.cost_model import CostModel
from shoal.shared.kv_cache.session_settings import SessionSettings
from shoal.shared.messages import SamplingParams
from shoal.shared.model_memory import get_model_shape

MODES = ("off", "inline", "thread")
BLOCK_SIZE = 16
# Copying back is always cheaper than recomputing: every CPU chunk is copied, none dropped.
COSTS = CostModel(seconds_per_token=1e-4, seconds_per_token_pair=1e-6, swap_seconds_per_block=1e-7)


def _engine(model: Any, tokenizer: Any, mode: str, host_pool_bytes: int, args: argparse.Namespace) -> PagedEngine:
    sessions = SessionSettings(
        host_pool_bytes=host_pool_bytes,
        gpu_fraction=0.0,
        cost_model=COSTS,
        swap_in_by_layer=mode,  # type: ignore[arg-type]
    )
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_blocks=2 * (max(args.history) + args.new_tokens + 64) // BLOCK_SIZE + 8,
        max_num_batched_tokens=max(args.history) + args.new_tokens + 16,
        enable_prefix_caching=False,  # a demoted block is never taken back by hash
        native_forward=not args.transformers,
        sessions=sessions,
    )
    return PagedEngine(model, tokenizer, config=config)


async def _first_token_seconds(engine: PagedEngine, request_id: str, prompt: list[int], session_id: str) -> float:
    request = GenerationRequest(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                session_id=session_id)
    started = time.perf_counter()
    first = None
    async for _ in engine.generate(request):
        if first is None:
            first = time.perf_counter() - started
    assert first is not None
    return first


async def _run(args: argparse.Namespace) -> None:
    path = Path(args.models_root) / args.model
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    block_bytes = get_model_shape(model.config, next(model.parameters()).dtype).get_kv_bytes_per_block(BLOCK_SIZE)
    host_pool_bytes = (max(args.history) // BLOCK_SIZE + 8) * block_bytes
    engines = {mode: _engine(model, tokenizer, mode, host_pool_bytes, args) for mode in MODES}
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    print(f"{args.model}, forward {engines['off'].forward}, torch threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.2f} at start")
    print("| history tokens | MB copied back | mode | returning-turn TTFT ms | exposed swap ms |")
    print("|---|---|---|---|---|")
    try:
        for history in args.history:
            ttft: dict[str, list[float]] = {mode: [] for mode in MODES}
            exposed: dict[str, list[float]] = {mode: [] for mode in MODES}
            for round_index in range(args.rounds + 1):  # round 0: warm-up, not counted
                order = MODES[round_index % 3 :] + MODES[: round_index % 3]
                prompt = torch.randint(5, vocab, (history,), generator=generator).tolist()
                turn = torch.randint(5, vocab, (args.new_tokens,), generator=generator).tolist()
                for mode in order:
                    engine = engines[mode]
                    session_id = f"{mode}-{history}-{round_index}"
                    await _first_token_seconds(engine, f"{session_id}-1", prompt, session_id)
                    stats = engine.get_stats().sessions
                    assert stats is not None
                    before = stats.exposed_swap_seconds
                    # the answer token is not part of the history: the whole prompt is reused
                    seconds = await _first_token_seconds(engine, f"{session_id}-2", prompt + turn, session_id)
                    after = engine.get_stats().sessions
                    assert after is not None and after.num_cpu_restored_tokens > 0
                    if round_index:
                        ttft[mode].append(seconds)
                        exposed[mode].append(after.exposed_swap_seconds - before)
            megabytes = history // BLOCK_SIZE * block_bytes / 1e6
            for mode in MODES:
                print(f"| {history} | {megabytes:.0f} | {mode} | {statistics.median(ttft[mode]) * 1e3:.1f} | "
                      f"{statistics.median(exposed[mode]) * 1e3:.2f} |", flush=True)
    finally:
        for engine in engines.values():
            await engine.close()
    print(f"load {os.getloadavg()[0]:.2f} at end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo/llama-100m")
    parser.add_argument("--models-root", default=os.environ.get("SHOAL_TEST_MODELS_ROOT", "models"))
    parser.add_argument("--history", type=int, nargs="+", default=[512, 1536])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--transformers", action="store_true", help="the transformers forward, not the native one")
    asyncio.run(_run(parser.parse_args()))


if __name__ == "__main__":
    main()
