"""What JSON output (``response_format``) and log probabilities cost per token.

The worker's engine for one model, in this process (worker defaults, one thread), runs
`--concurrency` greedy requests of `--max-tokens` tokens at once, round by round, four ways,
the order rotated every round so machine noise hits them alike:

* **free**: plain text (EOS ignored), the baseline;
* **json**: a JSON object with one unbounded string (each token masked by llguidance's
  matcher, services/worker/engine/structured.py; EOS ignored too, so a JSON that ends early
  goes on as end-of-sequence tokens, still masked, and every way makes as many tokens);
* **logprobs**: free text with ``logprobs: 5`` (the log-softmax and top 5 of every token);
* **bias**: free text with a 16-token ``logit_bias``;
* **echo**: free text whose prompt is scored too (``echo`` with ``logprobs: 1``: every prompt
  row's logits kept, log-softmaxed and ranked; no prefix-cache reuse).

Reports each way's output tokens per second (median of the rounds) and its ratio to free.
With ``--prompt-tokens N`` each prompt is N tokens (random, distinct per request and round,
so no way gets prefix-cache hits) and the figure counts prompt and output tokens: mostly
prefill.

    python scripts/bench_structured.py [--model demo/qwen2-25m] [--concurrency 8] [--rounds 5]
    python scripts/bench_structured.py --prompt-tokens 512 --max-tokens 1   # scoring prompts
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEMA = json.dumps({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})
WAYS = {
    "free": {},
    "json": {"json_schema": SCHEMA},
    "logprobs": {"logprobs": 5},
    "bias": {"logit_bias": {token_id: 1.0 for token_id in range(100, 116)}},
    "echo": {"echo": True, "prompt_logprobs": 1, "logprobs": 1},
}


async def _round(engine: object, tokenizer: object, way: str, args: argparse.Namespace, round_number: int) -> float:
    """Output tokens (with `--prompt-tokens`: prompt and output tokens) per second of
    `--concurrency` requests run together."""
    from shoal.services.worker.generation import GenerationRequest
    from shoal.shared.messages import SamplingParams

    async def one(i: int) -> int:
        if args.prompt_tokens:
            rng = random.Random(f"{round_number}-{i}-{way}")
            prompt = [rng.randrange(10, len(tokenizer)) for _ in range(args.prompt_tokens)]  # type: ignore[arg-type]
        else:
            prompt = list(tokenizer.encode(f"Request {round_number}-{i} of {way}: write it down."))  # type: ignore[attr-defined]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, **WAYS[way])
        request = GenerationRequest(f"{way}-{round_number}-{i}", prompt, params,
                                    frozenset({tokenizer.eos_token_id}))  # type: ignore[attr-defined]
        async for output in engine.generate(request):  # type: ignore[attr-defined]
            if output.finished:
                return output.num_completion_tokens + (output.num_prompt_tokens if args.prompt_tokens else 0)
        raise RuntimeError("no final output")

    started = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(args.concurrency)))
    return sum(tokens) / (time.perf_counter() - started)


async def run(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shoal.services.worker.engine.factory import build_paged_engine
    from shoal.services.worker.loader import LoadedModel
    from shoal.shared.config import WorkerConfig

    model_dir = Path(args.models_root) / args.model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    max_model_len = int(model.config.max_position_embeddings)
    loaded = LoadedModel(model, tokenizer, torch.device("cpu"), torch.float32, 0, max_model_len, 0)
    engine = build_paged_engine(loaded, WorkerConfig())
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        ways = list(WAYS)
        for way in ways:  # warm each path once (the grammar's tokenizer is built on first use)
            await _round(engine, tokenizer, way, argparse.Namespace(**{**vars(args), "max_tokens": 4}), -1)
        for round_number in range(args.rounds):
            shift = round_number % len(ways)
            for way in ways[shift:] + ways[:shift]:
                rates[way].append(await _round(engine, tokenizer, way, args, round_number))
    finally:
        await engine.close()
    free = statistics.median(rates["free"])
    prompt = f"{args.prompt_tokens}-token prompts" if args.prompt_tokens else "short prompts"
    print(f"\nmodel {args.model}, {args.concurrency} requests at once, {prompt}, {args.max_tokens} tokens each, "
          f"greedy, {args.rounds} rounds (medians)\n")
    print(f"| way | {'prompt + output' if args.prompt_tokens else 'output'} tok/s | vs free |")
    print("| --- | ---: | ---: |")
    for way, values in rates.items():
        rate = statistics.median(values)
        print(f"| {way} | {rate:.0f} | {rate / free:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo/qwen2-25m")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=0, help="random prompts this long (0: short text)")
    parser.add_argument("--models-root", default=str(REPO / "models"))
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
