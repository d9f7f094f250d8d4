"""Session cache policies replayed on one synthetic multi-turn chat trace (cache level).

    python scripts/bench_sessions.py                      # measure llama-5m's costs here, replay
    python scripts/bench_sessions.py --profile p.json     # a saved cost profile instead
    python scripts/bench_sessions.py --index-only         # eviction index speed only

The trace (seeded; `make_trace`): sessions arrive as a Poisson process; turns per session are
geometric with mean 3.5; each turn's user message and answer lengths are lognormal with
ShareGPT's means, 161 and 338 tokens (the means vLLM's paper reports for ShareGPT, Kwon et
al., SOSP 2023); the time between a session's turns (the user reading and typing) is
lognormal with a median of 60 s and sigma 1, so 98.9% of returns come within 10 minutes; an
optional system prompt is shared by every session; contexts are capped (4096 tokens), the
oldest turns being cut first, which changes the prompt's start and so defeats any cache of it.

Each turn is served at its arrival: the policy says which of the prompt's tokens it still
holds on the GPU, which it copies back from the CPU, and which are recomputed; then it
stores the turn's KV (prompt and answer). Costs come from a cost model fitted by timing the
served model on this machine (`services/worker/engine/cost_profile.py`): a turn costs one
prefill pass over what is recomputed and new, plus its copies back, not overlapped.

Policies, at GPU budgets of 5% to 100% of the trace's working set (the most KV the live
sessions hold at once), tiered ones with a CPU tier of `--cpu-ratio` times that:

* none         no cache: every turn prefills its whole prompt
* vllm-lru     Shoal's block pool: chained block hashes, cached-free blocks evicted LRU
* lmcache-lru  that, plus a CPU tier of blocks by hash, LRU, written through after each turn
* seed         seed 004: (session, chunk, layer) items, value = layer weight x position
               weight x (0.001 ctx + 0.015) / time inactive, lowest first, GPU -> CPU -> dropped
* shoal-gpu    Shoal's engine bookkeeping (`SessionKV`: the `SessionCache` policy over the
               block pool and its prefix cache), no CPU tier
* shoal        the same with the CPU tier
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shoal.services.worker.engine.sequence import Sequence
from shoal.services.worker.engine.session_kv import SessionKV
from shoal.shared.kv_cache.block_pool import BlockPool
from shoal.shared.kv_cache.cost_model import CostModel, CostProfile
from shoal.shared.kv_cache.manager import KVCacheManager, hash_full_blocks
from shoal.shared.kv_cache.session_cache import SessionCache, SessionCacheConfig

BLOCK_SIZE = 16
BLOCKS_PER_CHUNK = 4


# ---------------------------------------------------------------------- the trace


@dataclass(frozen=True)
class TraceConfig:
    num_sessions: int = 500
    arrival_rate: float = 0.5
    """Sessions per second (Poisson)."""
    mean_turns: float = 3.5
    mean_user_tokens: float = 161.0
    mean_answer_tokens: float = 338.0
    length_sigma: float = 1.0
    think_median_s: float = 60.0
    think_sigma: float = 1.0
    system_prompt_tokens: int = 0
    context_cap: int = 4096
    seed: int = 0


@dataclass(frozen=True)
class Turn:
    time: float
    session_id: str
    prompt: list[int]
    answer: list[int]
    num_reusable: int
    """Leading prompt tokens the session's previous turn had (its prompt and answer)."""


def make_trace(config: TraceConfig) -> list[Turn]:
    rng = random.Random(config.seed)
    system = [rng.randrange(5, 1 << 30) for _ in range(config.system_prompt_tokens)]

    def length(mean: float) -> int:
        mu = math.log(mean) - config.length_sigma**2 / 2  # lognormal with this mean
        return max(4, min(2048, round(rng.lognormvariate(mu, config.length_sigma))))

    turns: list[Turn] = []
    arrival = 0.0
    for index in range(config.num_sessions):
        arrival += rng.expovariate(config.arrival_rate)
        num_turns = 1
        while rng.random() > 1 / config.mean_turns:
            num_turns += 1
        history: list[list[int]] = []  # (user + answer) of each earlier turn, oldest first
        previous: list[int] = []
        now = arrival
        for _ in range(num_turns):
            user = [rng.randrange(5, 1 << 30) for _ in range(length(config.mean_user_tokens))]
            answer = [rng.randrange(5, 1 << 30) for _ in range(length(config.mean_answer_tokens))]
            budget = config.context_cap - len(system) - len(answer)
            user = user[: max(1, budget)]
            while history and sum(map(len, history)) + len(user) > budget:
                history.pop(0)  # cut the oldest turn
            prompt = [*system, *itertools.chain.from_iterable(history), *user]
            reusable = 0
            while reusable < min(len(prompt), len(previous)) and prompt[reusable] == previous[reusable]:
                reusable += 1
            turns.append(Turn(now, f"s{index}", prompt, answer, reusable))
            history.append(user + answer)
            previous = prompt + answer
            now += rng.lognormvariate(math.log(config.think_median_s), config.think_sigma)
    turns.sort(key=lambda turn: turn.time)
    return turns


def get_working_set_blocks(turns: list[Turn]) -> int:
    """The most KV blocks the sessions hold at once between a turn and their next one."""
    last_turn = {turn.session_id: turn.time for turn in turns}
    held: dict[str, int] = {}
    peak = 0
    for turn in turns:
        if turn.time < last_turn[turn.session_id]:
            held[turn.session_id] = (len(turn.prompt) + len(turn.answer) - 1) // BLOCK_SIZE
        else:
            held.pop(turn.session_id, None)
        peak = max(peak, sum(held.values()))
    return peak


# ---------------------------------------------------------------------- policies


@dataclass
class Result:
    cost_seconds: float = 0.0
    num_gpu_tokens: int = 0
    """Reusable prompt tokens found on the GPU."""
    num_cpu_tokens: int = 0
    num_reusable_tokens: int = 0
    num_swap_in_blocks: float = 0
    num_swap_out_blocks: float = 0

    def add(
        self, turn: Turn, costs: CostModel, gpu: int, cpu: int, rebuild_seconds: float, cached: int, swapped: float
    ) -> None:
        """A turn whose first `cached` prompt tokens needed no prefill after `rebuild_seconds`
        of recomputation (`gpu` of them found on the GPU, `cpu` copied back: `swapped` blocks)."""
        self.num_gpu_tokens += min(gpu, turn.num_reusable)
        self.num_cpu_tokens += min(cpu, max(0, turn.num_reusable - gpu))
        self.num_reusable_tokens += turn.num_reusable
        new = len(turn.prompt) - cached
        self.cost_seconds += costs.seconds_per_pass + rebuild_seconds + costs.get_rebuild_seconds(new, cached)
        self.num_swap_in_blocks += swapped
        if swapped:
            self.cost_seconds += costs.swap_seconds_per_call + costs.swap_seconds_per_block * swapped


class NoCache:
    def __init__(self, costs: CostModel) -> None:
        self.costs, self.result = costs, Result()

    def serve(self, turn: Turn) -> None:
        self.result.add(turn, self.costs, 0, 0, 0.0, 0, 0)


class PrefixLRU:
    """vLLM's GPU prefix cache (Shoal's `BlockPool`), and with `cpu_blocks`, LMCache's CPU tier."""

    def __init__(self, costs: CostModel, gpu_blocks: int, cpu_blocks: int, max_turn_blocks: int) -> None:
        self.costs, self.result = costs, Result()
        self.cpu_blocks = cpu_blocks
        self.cpu: OrderedDict[bytes, None] = OrderedDict()
        # The cache holds `gpu_blocks` between turns: the turn's working space is held back
        # then (allocating it evicts the LRU), and given to the turn while it runs.
        self.max_turn_blocks = max_turn_blocks
        self.kv = KVCacheManager(BlockPool(gpu_blocks + max_turn_blocks, BLOCK_SIZE))
        self.reserve: list[int] = []
        self.kv.pool.try_allocate_n(max_turn_blocks, self.reserve)
        self.turns = itertools.count()

    def serve(self, turn: Turn) -> None:
        self.kv.pool.free_n(self.reserve)
        self.reserve = []
        seq_id = f"t{next(self.turns)}"
        tokens = turn.prompt + turn.answer
        hashes = hash_full_blocks(tokens, BLOCK_SIZE, (len(tokens) - 1) // BLOCK_SIZE)
        num_gpu = self.kv.start_sequence(seq_id, turn.prompt, list(hashes))
        num_cpu = 0
        limit = (len(turn.prompt) - 1) // BLOCK_SIZE
        index = num_gpu // BLOCK_SIZE
        while self.cpu_blocks and index < limit and hashes[index] in self.cpu:
            self.cpu.move_to_end(hashes[index])
            index += 1
            num_cpu += BLOCK_SIZE
        self.result.add(turn, self.costs, num_gpu, num_cpu, 0.0, num_gpu + num_cpu, num_cpu // BLOCK_SIZE)
        allocated = self.kv.try_allocate_slots(seq_id, num_gpu, len(tokens) - 1 - num_gpu)
        assert allocated, "a turn fits its working space"
        self.kv.register_computed_blocks(seq_id, tokens, len(tokens) - 1)
        self.kv.free(seq_id)
        if self.cpu_blocks:  # write-through: every full block of the turn is stored on the CPU
            for block_hash in hashes:
                if block_hash not in self.cpu:
                    self.result.num_swap_out_blocks += 1
                self.cpu[block_hash] = None
                self.cpu.move_to_end(block_hash)
            while len(self.cpu) > self.cpu_blocks:
                self.cpu.popitem(last=False)
        allocated = self.kv.pool.try_allocate_n(self.max_turn_blocks, self.reserve)
        assert allocated, "the working space is always there to take back"


class Seed:
    """Seed 004's per-layer policy: items (session, chunk, layer), values recomputed at every
    eviction, GPU -> CPU -> dropped. A dropped item costs rebuilding its chunk through its
    layer (layers 0..l over the chunk's tokens), which an engine able to do that would pay."""

    ALPHA, BETA, CONST = 0.001, 0.01, 0.005

    def __init__(self, costs: CostModel, gpu_blocks: int, cpu_blocks: int, num_layers: int) -> None:
        self.costs, self.result = costs, Result()
        self.num_layers = num_layers
        self.gpu_units = gpu_blocks * num_layers  # budgets in (block x layer) units
        self.cpu_units = cpu_blocks * num_layers
        # session -> (last accessed, tokens cached, per chunk per layer tier: 0 gpu 1 cpu 2 dropped)
        self.sessions: dict[str, tuple[float, list[int], list[list[int]]]] = {}
        self.used = [0, 0]

    def serve(self, turn: Turn) -> None:
        held = self.sessions.pop(turn.session_id, None)
        gpu = cpu = swapped_units = 0
        rebuild = 0.0
        cached = 0
        if held is not None:
            _, tokens, tiers = held
            match = 0
            limit = min(len(tokens), len(turn.prompt) - 1)
            while match < limit and tokens[match] == turn.prompt[match]:
                match += 1
            num_chunks = match // (BLOCK_SIZE * BLOCKS_PER_CHUNK)
            cached = num_chunks * BLOCK_SIZE * BLOCKS_PER_CHUNK
            chunk_tokens = BLOCK_SIZE * BLOCKS_PER_CHUNK
            for index, layers in enumerate(tiers):
                units = BLOCKS_PER_CHUNK
                for tier in layers:
                    if tier < 2:
                        self.used[tier] -= units
                if index >= num_chunks:
                    continue
                dropped = [layer for layer, tier in enumerate(layers) if tier == 2]
                if dropped:
                    depth = (max(dropped) + 1) / self.num_layers
                    rebuild += depth * self.costs.get_rebuild_seconds(chunk_tokens, index * chunk_tokens)
                # CPU layers above the recomputed ones are copied back
                top = max(dropped) if dropped else -1
                swapped_units += sum(1 for layer, tier in enumerate(layers) if tier == 1 and layer > top)
                if all(tier == 0 for tier in layers):
                    gpu += chunk_tokens
                elif not dropped:
                    cpu += chunk_tokens
        self.result.add(turn, self.costs, gpu, cpu, rebuild, cached, swapped_units * BLOCKS_PER_CHUNK / self.num_layers)
        tokens = turn.prompt + turn.answer
        num_chunks = (len(tokens) - 1) // (BLOCK_SIZE * BLOCKS_PER_CHUNK)
        self.sessions[turn.session_id] = (turn.time, tokens, [[0] * self.num_layers for _ in range(num_chunks)])
        self.used[0] += num_chunks * self.num_layers * BLOCKS_PER_CHUNK
        self._evict(turn.time)

    def _evict(self, now: float) -> None:
        for tier, budget in ((0, self.gpu_units), (1, self.cpu_units)):
            if self.used[tier] <= budget:
                continue
            items = []
            for session_id, (last, _, tiers) in self.sessions.items():
                inactive = max(now - last, 1e-6)  # the seed divides by zero for a chunk touched now
                for index, layers in enumerate(tiers):
                    base = self.ALPHA * index * BLOCK_SIZE * BLOCKS_PER_CHUNK + self.BETA + self.CONST
                    position = (index + 1) / len(tiers)
                    for layer, layer_tier in enumerate(layers):
                        if layer_tier == tier:
                            weight = (self.num_layers - layer) / self.num_layers
                            items.append((weight * position * base / inactive, session_id, index, layer))
            heapq.heapify(items)
            while self.used[tier] > budget and items:
                _, session_id, index, layer = heapq.heappop(items)
                self.sessions[session_id][2][index][layer] = tier + 1
                self.used[tier] -= BLOCKS_PER_CHUNK
                if tier == 0:
                    self.used[1] += BLOCKS_PER_CHUNK
                    self.result.num_swap_out_blocks += BLOCKS_PER_CHUNK / self.num_layers


class Shoal:
    """Shoal's engine bookkeeping, unchanged: `SessionKV` over `SessionCache` (injected clock)
    and the block pool's prefix cache, without the model. Turns run as the engine runs them:
    `try_start` (or the prefix cache, for a session with nothing cached), the turn's blocks,
    `release`."""

    def __init__(self, costs: CostModel, gpu_blocks: int, cpu_blocks: int, max_turn_blocks: int) -> None:
        self.costs, self.result = costs, Result()
        self.now = 0.0
        cache = SessionCache(
            SessionCacheConfig(
                block_size=BLOCK_SIZE,
                blocks_per_chunk=BLOCKS_PER_CHUNK,
                gpu_budget_blocks=gpu_blocks,
                cpu_budget_blocks=cpu_blocks,
                idle_timeout_s=24 * 3600.0,
            ),
            costs,
            lambda: self.now,
        )
        self.kv = KVCacheManager(BlockPool(gpu_blocks + max_turn_blocks, BLOCK_SIZE))
        self.sessions = SessionKV(cache, self.kv, block_bytes=1)  # byte counters in blocks
        self.max_turn_blocks = max_turn_blocks
        self.reserve: list[int] = []
        self.kv.pool.try_allocate_n(max_turn_blocks, self.reserve)
        self.turns = itertools.count()

    def serve(self, turn: Turn) -> None:
        self.now = turn.time
        self.kv.pool.free_n(self.reserve)
        self.reserve = []
        sessions, kv = self.sessions, self.kv
        before = sessions.get_stats()
        seq = Sequence(
            f"t{next(self.turns)}", list(turn.prompt), len(turn.prompt), 1 << 30, 0, session_id=turn.session_id
        )
        started = sessions.try_start(seq, 1 << 30)
        assert started is not False, "a turn fits its working space"
        rebuild = 0.0
        if started:
            after = sessions.get_stats()
            gpu = (after.num_gpu_reused_tokens - before.num_gpu_reused_tokens) + (
                after.num_prefix_cached_tokens - before.num_prefix_cached_tokens
            )
            cpu = after.num_cpu_restored_tokens - before.num_cpu_restored_tokens
            swapped = (after.swap_in_bytes - before.swap_in_bytes) // sessions.block_bytes
            rebuild = self.costs.get_rebuild_seconds(seq.num_hole_tokens, seq.hole_start)
            gpu += seq.hole_start  # leading blocks found in the prefix cache
        else:  # nothing of the session: the prefix cache alone (a shared system prompt)
            computed = kv.try_start_sequence(seq.seq_id, seq.token_ids, 1 << 30, seq.block_hashes)
            assert computed is not None, "a turn fits its working space"
            seq.num_computed_tokens = computed
            gpu, cpu, swapped = computed, 0, 0
        self.result.add(turn, self.costs, gpu, cpu, rebuild, seq.num_computed_tokens, swapped)
        # The turn runs: its hole and new tokens are computed, its answer generated.
        seq.token_ids += turn.answer
        num_computed = len(seq.token_ids) - 1
        while not kv.try_allocate_slots(seq.seq_id, seq.num_computed_tokens, num_computed - seq.num_computed_tokens):
            needed = kv.get_num_new_blocks(seq.seq_id, seq.num_computed_tokens, num_computed - seq.num_computed_tokens)
            assert sessions.reclaim(needed - kv.get_num_free_blocks()), "sessions give way to a running turn"
        seq.hole_start = seq.hole_end = 0
        kv.register_blocks(seq.seq_id, 0, seq.num_computed_tokens // BLOCK_SIZE)
        kv.register_computed_blocks(seq.seq_id, seq.token_ids, num_computed)
        seq.num_computed_tokens = num_computed
        sessions.release(seq, "length")
        sessions.take_swaps()
        sessions.end_step()
        self.result.num_swap_out_blocks = sessions.get_stats().swap_out_bytes // sessions.block_bytes
        while not kv.pool.try_allocate_n(self.max_turn_blocks, self.reserve):
            sessions.reclaim(self.max_turn_blocks - kv.get_num_free_blocks())


# ---------------------------------------------------------------------- the eviction index


def bench_index(num_sessions_list: list[int], num_evictions: int, seed: int = 0) -> list[tuple[int, str, float]]:
    """Microseconds per chunk evicted from a `SessionCache` holding that many sessions."""
    rows = []
    costs = CostModel(seconds_per_token=2e-5, seconds_per_token_pair=1e-8, swap_seconds_per_block=2e-5)
    for num_sessions in num_sessions_list:
        for case, cpu_share in (("demote to CPU", 1.0), ("CPU full: drop", 0.0)):
            rng = random.Random(seed)
            now = Clock()
            sizes = [rng.randint(8, 200) for _ in range(num_sessions)]
            total = sum(sizes)
            cache = SessionCache(
                SessionCacheConfig(
                    block_size=BLOCK_SIZE,
                    blocks_per_chunk=BLOCKS_PER_CHUNK,
                    gpu_budget_blocks=total,
                    cpu_budget_blocks=int(total * cpu_share),
                    idle_timeout_s=1e9,
                ),
                costs,
                now,
            )
            block_ids = itertools.count()
            for index, size in enumerate(sizes):
                now.now = rng.uniform(0, 600)
                cache.check_in(f"s{index}", [next(block_ids) for _ in range(size)])
            now.now = 700.0
            started = time.perf_counter()
            num_freed = 0
            for _ in range(num_evictions):
                freed, _ = cache.reclaim_gpu(1)
                num_freed += freed
            seconds = time.perf_counter() - started
            rows.append((num_sessions, case, seconds / num_evictions * 1e6))
        # What one exact pick costs without the index: a scan of every session's next victim.
        victims = [(rng.uniform(1e-4, 1e-2), rng.uniform(0, 600), index) for index in range(num_sessions)]
        started = time.perf_counter()
        for _ in range(20):
            min(victims, key=lambda victim: (victim[0] / (700.0 - victim[1] + 1.0), victim[1], victim[2]))
        rows.append((num_sessions, "exact scan, for comparison", (time.perf_counter() - started) / 20 * 1e6))
    return rows


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------- main


def make_policy(
    name: str, costs: CostModel, gpu_blocks: int, cpu_blocks: int, max_turn_blocks: int, num_layers: int
) -> NoCache | PrefixLRU | Seed | Shoal:
    if name == "none":
        return NoCache(costs)
    if name == "vllm-lru":
        return PrefixLRU(costs, gpu_blocks, 0, max_turn_blocks)
    if name == "lmcache-lru":
        return PrefixLRU(costs, gpu_blocks, cpu_blocks, max_turn_blocks)
    if name == "seed":
        return Seed(costs, gpu_blocks, cpu_blocks, num_layers)
    if name == "shoal-gpu":
        return Shoal(costs, gpu_blocks, 0, max_turn_blocks)
    if name == "shoal":
        return Shoal(costs, gpu_blocks, cpu_blocks, max_turn_blocks)
    raise SystemExit(f"unknown policy {name!r}")


def measure_costs(models_root: Path, model_key: str) -> tuple[CostProfile, int]:
    """Time the model here as the engine does at start; returns the profile and its layers."""
    from transformers import AutoModelForCausalLM

    from shoal.services.worker.engine.attention import ATTN_IMPLEMENTATION, register_attention
    from shoal.services.worker.engine.cost_profile import get_profile_key, measure_cost_model
    from shoal.services.worker.engine.model_runner import ModelRunner

    register_attention()
    model = AutoModelForCausalLM.from_pretrained(models_root / model_key).eval()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    runner = ModelRunner(model, num_blocks=320, block_size=BLOCK_SIZE, num_host_blocks=128)
    key = get_profile_key(model.config, runner.dtype, runner.device, BLOCK_SIZE)
    profile = measure_cost_model(
        runner,
        320,
        key=key,
        chunk_tokens=BLOCK_SIZE * BLOCKS_PER_CHUNK,
        max_pass_tokens=512,
        max_context_tokens=model.config.max_position_embeddings,
    )
    return profile, model.config.num_hidden_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, help="a saved cost profile (JSON) instead of measuring")
    parser.add_argument("--num-layers", type=int, default=4, help="layers of the profiled model (seed policy)")
    parser.add_argument("--models-root", type=Path, default=Path("/work/main/models"))
    parser.add_argument("--model", default="demo/llama-5m")
    parser.add_argument("--sessions", type=int, default=TraceConfig.num_sessions)
    parser.add_argument("--arrival-rate", type=float, default=TraceConfig.arrival_rate)
    parser.add_argument("--system-prompt-tokens", type=int, default=0)
    parser.add_argument("--cpu-ratio", type=float, default=2.0, help="CPU tier size / GPU budget")
    parser.add_argument("--fractions", default="0.05,0.1,0.2,0.35,0.5,0.75,1.0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="none,vllm-lru,lmcache-lru,seed,shoal-gpu,shoal")
    parser.add_argument("--index-only", action="store_true")
    parser.add_argument("--save-profile", type=Path, help="write the measured cost profile here")
    parser.add_argument("--index-evictions", type=int, default=2000)
    args = parser.parse_args()

    print("## Eviction index: microseconds per chunk evicted (reclaim_gpu(1) in a loop)")
    print("| sessions | case | us per eviction |\n|---|---|---|")
    for num_sessions, case, micros in bench_index([100, 1000, 10000], args.index_evictions, args.seed):
        print(f"| {num_sessions} | {case} | {micros:.1f} |")
    if args.index_only:
        return

    if args.profile:
        profile = CostProfile.from_json(args.profile.read_bytes())
        num_layers = args.num_layers
    else:
        profile, num_layers = measure_costs(args.models_root, args.model)
        if args.save_profile:
            args.save_profile.write_bytes(profile.to_json())
    costs = profile.cost_model
    print(f"\ncost model ({profile.key}): {costs}")
    config = TraceConfig(
        num_sessions=args.sessions,
        arrival_rate=args.arrival_rate,
        system_prompt_tokens=args.system_prompt_tokens,
        seed=args.seed,
    )
    turns = make_trace(config)
    working_set = get_working_set_blocks(turns)
    num_reusable = sum(turn.num_reusable for turn in turns)
    num_prompt = sum(len(turn.prompt) for turn in turns)
    print(
        f"trace: {config}\n{len(turns)} turns, {num_prompt} prompt tokens, {num_reusable} of them "
        f"reusable ({num_reusable / num_prompt:.0%}), working set {working_set} blocks of {BLOCK_SIZE} tokens"
    )
    max_turn_blocks = config.context_cap // BLOCK_SIZE + 1
    policies = args.policies.split(",")
    print(
        "\n| GPU budget | policy | GPU hits | CPU hits | recomputed | prefill saved | swap-in blocks "
        "| swap-out blocks | seconds |\n|---|---|---|---|---|---|---|---|---|"
    )
    for fraction in (float(value) for value in args.fractions.split(",")):
        gpu_blocks = max(1, int(working_set * fraction))
        cpu_blocks = int(gpu_blocks * args.cpu_ratio)
        baseline = None
        for name in policies:
            policy = make_policy(name, costs, gpu_blocks, cpu_blocks, max_turn_blocks, num_layers)
            started = time.perf_counter()
            for turn in turns:
                policy.serve(turn)
            elapsed = time.perf_counter() - started
            result = policy.result
            if baseline is None:
                baseline = NoCache(costs)
                for turn in turns:
                    baseline.serve(turn)
            reusable = max(1, result.num_reusable_tokens)
            recomputed = reusable - result.num_gpu_tokens - result.num_cpu_tokens
            saved = 1 - result.cost_seconds / baseline.result.cost_seconds
            print(
                f"| {fraction:.0%} | {name} | {result.num_gpu_tokens / reusable:.1%} | "
                f"{result.num_cpu_tokens / reusable:.1%} | {recomputed / reusable:.1%} | {saved:.1%} | "
                f"{result.num_swap_in_blocks:.0f} | {result.num_swap_out_blocks:.0f} | {elapsed:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
