"""Prefill speed of the native forward pass, in process: prompts of a few lengths prefilled
through `NativeForward` (one pass per prompt, over a paged KV pool, as the engine runs it),
with each prefill attention path in the same run, and Hugging Face's eager forward of the
same prompt as the baseline. Prints tokens/s per length and path and each path's ratio to
Hugging Face's.

Paths (``--paths``):

    native   the whole prefill in one C call: causal attention over the paged pool inside the
             forward pass (cpu_prefill_attention.c), whatever the prompt's length; the last
             layer past its K/V write for the last row only (the one whose logits are wanted)
    whole    native, with the last layer computed for every row (as before the tail)
    torch    the forward pass calls back into Python once per layer for the prefill's
             attention (`shoal.kernels.reference.run_attention`, torch's batched products):
             what prefills longer than 128 x 128 query-position pairs ran before
    hf       transformers' forward of the prompt (eager attention), the same weights

``--split`` adds, for the torch path, the share of the pass spent in the attention callback.
``--products`` instead times each model's packed products alone (`PackedLinear.forward`, its
layer shapes, random weights) in GFLOPS by rows: how the GEMM does at decode and prefill sizes.
``--attention`` times the tiled causal attention alone (one layer's heads of each model, one
prompt of each length in a paged cache, random values) on every code path this CPU has and at
1 and ``--threads`` threads, in GFLOPS of the causal products (QK and PV).

    .venv/bin/python scripts/bench_prefill.py --models-root /work/main/models \\
        --models demo/llama-5m,demo/llama-100m --lengths 64,512,1920 --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from shoal.kernels.attention_plan import plan_attention
from shoal.services.worker.engine import native_forward
from shoal.services.worker.engine.attention import PagedBatch
from shoal.services.worker.engine.model_runner import ModelRunner

BLOCK_SIZE = 16
PATHS = ("native", "whole", "torch", "hf")


def parse_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


class Prefiller:
    """One model's native forward over a pool that holds one prompt of up to `max_len`."""

    def __init__(self, model_dir: Path, max_len: int, threads: int) -> None:
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        packed = native_forward.pack_model(model)
        num_blocks = -(-max_len // BLOCK_SIZE)
        policy = native_forward.ThreadPolicy(max_threads=threads, fixed=threads)
        self.runner = ModelRunner(model, num_blocks, BLOCK_SIZE, packed_model=packed, threads=policy)
        self.vocab = model.config.vocab_size

    def prompt(self, length: int) -> list[int]:
        generator = torch.Generator().manual_seed(length)
        return torch.randint(5, self.vocab, (length,), generator=generator).tolist()

    def native_call(self, tokens: list[int]) -> Callable[[], torch.Tensor]:
        length = len(tokens)
        table = list(range(-(-length // BLOCK_SIZE)))
        input_ids, positions = torch.tensor([tokens]), torch.tensor([list(range(length))])
        slots = torch.arange(length)
        native = self.runner.native
        assert native is not None

        def run() -> torch.Tensor:
            plan = plan_attention(self.runner.layer_caches[0][0], [table], [length], [0, length])
            batch = PagedBatch(layer_caches=self.runner.layer_caches, slot_mapping=slots, cpu_plan=plan)
            return native.execute(input_ids, positions, batch, torch.tensor([length - 1]))[0]

        return run

    def hf_call(self, tokens: list[int]) -> Callable[[], torch.Tensor]:
        input_ids = torch.tensor([tokens])

        def run() -> torch.Tensor:
            with torch.inference_mode():
                return self.hf(input_ids, logits_to_keep=1).logits[0, -1]

        return run


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm: buffers, library, caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(prefiller: Prefiller, path: str, length: int, repeats: int) -> tuple[float, torch.Tensor, float]:
    """Best seconds of one prefill, the last row's logits, and the attention callback's share
    of the pass (torch path; 0 otherwise)."""
    tokens = prefiller.prompt(length)
    if path == "hf":
        run = prefiller.hf_call(tokens)
        return best_seconds(run, repeats), run(), 0.0
    limit = native_forward.MAX_NATIVE_PREFILL_SCORES
    native_forward.MAX_NATIVE_PREFILL_SCORES = 0 if path == "torch" else limit
    torch_long = native_forward.NATIVE_LONG_PREFILL
    native_forward.NATIVE_LONG_PREFILL = path != "torch"
    native_forward.LAST_LAYER_WANTED_ROWS_ONLY = path == "native"
    try:
        run = prefiller.native_call(tokens)
        seconds = best_seconds(run, repeats)
        attended = [0.0]
        share = 0.0
        if path == "torch":
            original = native_forward.reference.run_attention

            def timed(*args: object, **kwargs: object) -> None:
                start = time.perf_counter()
                original(*args, **kwargs)  # type: ignore[arg-type]
                attended[0] += time.perf_counter() - start

            native_forward.reference.run_attention = timed  # type: ignore[assignment]
            try:
                start = time.perf_counter()
                run()
                share = attended[0] / (time.perf_counter() - start)
            finally:
                native_forward.reference.run_attention = original  # type: ignore[assignment]
        return seconds, run().clone(), share
    finally:
        native_forward.MAX_NATIVE_PREFILL_SCORES = limit
        native_forward.NATIVE_LONG_PREFILL = torch_long
        native_forward.LAST_LAYER_WANTED_ROWS_ONLY = True


def time_products(model_dir: Path, rows: list[int], repeats: int, dtype: str = "float32") -> None:
    """GFLOPS of the packed products of one layer's shapes of `model_dir`'s model, by rows, with
    `dtype` (float32 or bfloat16) panels."""
    from transformers import AutoConfig

    from shoal.kernels import cpu_kernels
    from shoal.kernels.cpu_model import PackedLinear

    config = AutoConfig.from_pretrained(model_dir)
    kernels = cpu_kernels.try_load()
    assert kernels is not None
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    shapes = [("qkv", qkv, hidden, False), ("o", hidden, config.num_attention_heads * head_dim, False),
              ("gate_up", 2 * inter, hidden, True), ("down", hidden, inter, False)]
    for name, num_out, num_in, silu_mul in shapes:
        packed = PackedLinear(kernels, torch.randn(num_out, num_in), silu_mul=silu_mul,
                              panel_dtype=getattr(torch, dtype))
        cells = []
        for m in rows:
            x = torch.randn(m, num_in)
            calls = max(1, int(2e8 // (m * num_in * num_out)))

            def run(x: torch.Tensor = x, calls: int = calls, packed: PackedLinear = packed) -> None:
                for _ in range(calls):
                    packed.forward(x)

            seconds = best_seconds(run, repeats) / calls
            cells.append(f"{2 * m * num_in * num_out / seconds / 1e9:.0f}")
        print(f"| {model_dir.name} | {dtype} | {name} {num_out} x {num_in} | " + " | ".join(cells) + " |", flush=True)


def time_attention(model_dir: Path, lengths: list[int], threads: int, repeats: int) -> None:
    """GFLOPS of the tiled causal attention (cpu_prefill_attention.c) for one layer of
    `model_dir`'s model, by prompt length, on each code path and thread count."""
    from transformers import AutoConfig

    from shoal.kernels import cpu_kernels
    from shoal.kernels.cpu_model import ISA_NAMES, PrefillPlan, get_gemm_isa

    config = AutoConfig.from_pretrained(model_dir)
    kernels = cpu_kernels.try_load()
    assert kernels is not None
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    generator = torch.Generator().manual_seed(0)
    for num_threads in sorted({1, threads}):
        for isa in range(get_gemm_isa(kernels) + 1):
            cells = []
            for length in lengths:
                num_blocks = -(-length // BLOCK_SIZE)
                key_cache, value_cache = (torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=generator)
                                          for _ in range(2))
                query = torch.randn(length, heads, head_dim, generator=generator)
                out = torch.empty_like(query)
                plan = PrefillPlan.build(kernels, key_cache, [list(range(num_blocks))], [length], [0, length])
                assert plan is not None

                def run(plan: PrefillPlan = plan, out: torch.Tensor = out, query: torch.Tensor = query,
                        key_cache: torch.Tensor = key_cache, value_cache: torch.Tensor = value_cache,
                        isa: int = isa, num_threads: int = num_threads) -> None:
                    plan.run(out, query, key_cache, value_cache, head_dim**-0.5, isa=isa, num_threads=num_threads)

                flops = 4 * heads * head_dim * length * (length + 1) / 2  # QK and PV over the causal half
                cells.append(f"{flops / best_seconds(run, repeats) / 1e9:.0f}")
            print(f"| {model_dir.name} | {ISA_NAMES[isa]} | {num_threads} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-root", type=Path, required=True)
    parser.add_argument("--models", type=parse_list, default=["demo/llama-5m", "demo/llama-100m"])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in parse_list(s)], default=[64, 512, 1920])
    parser.add_argument("--paths", type=parse_list, default=list(PATHS), help="native,whole,torch,hf")
    parser.add_argument("--threads", type=int, default=1, help="threads of the native pass and of torch (1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills per cell, best kept (3)")
    parser.add_argument("--split", action="store_true", help="the torch path's attention share")
    parser.add_argument("--products", type=lambda s: [int(x) for x in parse_list(s)], default=None,
                        help="time the packed products alone at these row counts (e.g. 1,16,64,512,1920)")
    parser.add_argument("--dtype", type=parse_list, default=["float32"],
                        help="--products: the panels' dtypes, each in turn (float32,bfloat16)")
    parser.add_argument("--attention", type=lambda s: [int(x) for x in parse_list(s)], default=None,
                        help="time the tiled causal attention alone at these prompt lengths (e.g. 512,1920)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.attention:
        print("GFLOPS of the tiled causal attention by prompt length: " + ", ".join(map(str, args.attention)))
        print("| model | code path | threads | " + " | ".join(map(str, args.attention)) + " |")
        print("| --- | --- | ---: | " + " | ".join("---:" for _ in args.attention) + " |")
        for key in args.models:
            time_attention(args.models_root / key, args.attention, args.threads, args.repeats)
        return
    if args.products:
        print("GFLOPS of one thread by rows M: " + ", ".join(str(m) for m in args.products))
        for key in args.models:
            for dtype in args.dtype:
                time_products(args.models_root / key, args.products, args.repeats, dtype)
        return
    print(f"threads {args.threads}, best of {args.repeats}; tokens/s (ratio to hf)")
    print("| model | prompt | " + " | ".join(args.paths) + " | max abs logit diff native vs hf |")
    print("| --- | ---: | " + " | ".join("---:" for _ in args.paths) + " | ---: |")
    for key in args.models:
        prefiller = Prefiller(args.models_root / key, max(args.lengths), args.threads)
        for length in args.lengths:
            cells, logits, shares = {}, {}, {}
            for path in args.paths:
                seconds, logits[path], shares[path] = measure(prefiller, path, length, args.repeats)
                cells[path] = length / seconds
            row = []
            for path in args.paths:
                cell = f"{cells[path]:,.0f}"
                if "hf" in cells and path != "hf":
                    cell += f" ({cells[path] / cells['hf']:.2f})"
                if args.split and path == "torch":
                    cell += f" [attention {shares[path]:.0%}]"
                row.append(cell)
            diff = ""
            if "native" in logits and "hf" in logits:
                diff = f"{(logits['native'] - logits['hf']).abs().max().item():.1e}"
            print(f"| {key} | {length} | " + " | ".join(row) + f" | {diff} |", flush=True)


if __name__ == "__main__":
    main()
