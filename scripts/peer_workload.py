"""The peer benchmark's requests, results table and docs section: pure functions, unit-tested.

Prompt lengths come from the Azure LLM conversation trace (token counts only); prompt text
is cut from the demo corpus so that it tokenizes to exactly the requested length.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE = Path("/work/shared/data/azure_llm_2023_conv.csv")
LENGTH_WINDOW = 0.125
"""A prompt of "~L tokens" is a trace request whose ContextTokens is within ±12.5% of L."""
CORPUS_STRIDE = 997
"""Tokens between the starts of consecutive prompts in the (cyclic) corpus: a prime, so that
no two prompts of a run start at the same token and neither side's prefix cache can skip a
prefill."""


def read_trace_contexts(path: Path = TRACE) -> list[int]:
    """The trace's ContextTokens column, in trace order."""
    with path.open() as trace:
        return [int(row["ContextTokens"]) for row in csv.DictReader(trace)]


def select_prompt_lengths(contexts: Sequence[int], target: int, count: int,
                          window: float = LENGTH_WINDOW) -> list[int]:
    """The first `count` trace prompt lengths within ±`window` of `target`, in trace order.

    Raises ValueError when the trace holds none; cycles when it holds fewer than `count`.
    """
    if target < 1 or count < 0:
        raise ValueError(f"target must be >= 1 and count >= 0, got {target}, {count}")
    low, high = target * (1 - window), target * (1 + window)
    near = [n for n in contexts if low <= n <= high]
    if not near:
        raise ValueError(f"the trace has no prompt of {low:.0f}..{high:.0f} tokens")
    return [near[i % len(near)] for i in range(count)]


def fit_prompt_lengths(lengths: Sequence[int], max_output_tokens: int, context_tokens: int) -> list[int]:
    """`lengths` clipped so that prompt + output fits `context_tokens` (the model's context)."""
    limit = context_tokens - max_output_tokens
    if limit < 1:
        raise ValueError(f"{max_output_tokens} output tokens leave no room in a {context_tokens}-token context")
    return [min(n, limit) for n in lengths]


class PromptMaker:
    """Text of an exact token length, cut deterministically from a corpus.

    The corpus is tokenized once and read as a cycle; prompt k starts `CORPUS_STRIDE x k`
    tokens in. Decoding a slice of n tokens and encoding the text again can give a
    different count (merges across the cut), so the slice is lengthened or shortened until
    the text encodes to exactly n tokens.
    """

    def __init__(self, corpus_ids: Sequence[int], encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str]) -> None:
        if not corpus_ids:
            raise ValueError("empty corpus")
        self._ids = list(corpus_ids)
        self.num_corpus_tokens = len(self._ids)
        self._encode = encode
        self._decode = decode

    def make(self, num_tokens: int, index: int) -> str:
        """Text that `encode` turns into exactly `num_tokens` tokens: prompt number `index`."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        start = index * CORPUS_STRIDE
        for shift in range(64):  # another start if no slice length works from this one
            num_slice = num_tokens
            seen: set[int] = set()
            while num_slice > 0 and num_slice not in seen:
                seen.add(num_slice)
                text = self._decode(self._slice(start + shift, num_slice))
                num_encoded = len(self._encode(text))
                if num_encoded == num_tokens:
                    return text
                num_slice += num_tokens - num_encoded
        raise ValueError(f"no text of exactly {num_tokens} tokens near corpus offset {start}")

    def _slice(self, start: int, num: int) -> list[int]:
        size = len(self._ids)
        return [self._ids[(start + i) % size] for i in range(num)]


def make_prompt_maker(tokenizer: Any, corpus: str) -> PromptMaker:
    """A `PromptMaker` over `corpus` with a transformers tokenizer's encode and decode."""

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    return PromptMaker(tokenizer.encode(corpus), tokenizer.encode, decode)


@dataclass(frozen=True)
class Workload:
    """One cell of the benchmark: C requests of these prompt lengths, `max_tokens` each."""

    target_length: int
    """The nominal prompt length (64, 512, 2048)."""
    prompt_lengths: tuple[int, ...]
    """Each request's prompt tokens (clipped to the model's context when `clipped`)."""
    max_tokens: int
    clipped: bool = False

    @property
    def concurrency(self) -> int:
        return len(self.prompt_lengths)


def make_workload(contexts: Sequence[int], target: int, concurrency: int, max_tokens: int,
                  context_tokens: int) -> Workload:
    """`concurrency` trace requests of ~`target` prompt tokens, fitted to a `context_tokens` model."""
    lengths = select_prompt_lengths(contexts, target, concurrency)
    fitted = fit_prompt_lengths(lengths, max_tokens, context_tokens)
    return Workload(target, tuple(fitted), max_tokens, clipped=fitted != lengths)


def make_prompts(maker: PromptMaker, workload: Workload, first_index: int) -> list[str]:
    """The texts of one run of `workload`: prompts number `first_index`, `first_index` + 1, ..."""
    return [maker.make(n, first_index + i) for i, n in enumerate(workload.prompt_lengths)]


class PromptNumbers:
    """Hands out prompt numbers never used before in a run, so that no two runs share a prompt.

    Prompt k starts CORPUS_STRIDE x k tokens into the cyclic corpus: numbers below the
    corpus length (in tokens) give distinct starts.
    """

    def __init__(self, corpus_tokens: int) -> None:
        self._next = 0
        self._limit = corpus_tokens

    def take(self, count: int) -> int:
        first = self._next
        self._next += count
        if self._next > self._limit:
            raise ValueError(f"more than {self._limit} prompts in one run would repeat a corpus start")
        return first


# --- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    """One side's run of one workload: every request's timings from t0 (all sent at t0)."""

    seconds: float
    """Until the last request completed."""
    ttft_s: tuple[float, ...]
    num_output_tokens: tuple[int, ...]

    @property
    def tokens_per_s(self) -> float:
        return sum(self.num_output_tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def ttft_mean_ms(self) -> float:
        return 1000 * statistics.fmean(self.ttft_s) if self.ttft_s else 0.0


def best_run(runs: Sequence[RunResult]) -> RunResult:
    """The run with the most output tokens/s."""
    if not runs:
        raise ValueError("no runs")
    return max(runs, key=lambda r: r.tokens_per_s)


@dataclass
class Row:
    """One line of the table: the best of each side's runs of one cell."""

    model: str
    workload: Workload
    shoal: RunResult | None
    llama: RunResult | None
    parallel: int
    """llama-server's --parallel."""
    notes: list[str] = field(default_factory=list)
    num_rounds: int = 0
    num_busy_rounds: int = 0
    """Rounds in which a run started while other processes held the cores."""
    num_shoal_preemptions: int | None = None
    """Requests Shoal's engine preempted during the cell (its own counter, from /metrics)."""

    @property
    def ratio(self) -> float | None:
        if self.shoal is None or self.llama is None or self.llama.tokens_per_s == 0:
            return None
        return self.shoal.tokens_per_s / self.llama.tokens_per_s


def _fmt_rate(run: RunResult | None) -> str:
    return "—" if run is None else f"{run.tokens_per_s:,.1f}"


def _fmt_ttft(run: RunResult | None) -> str:
    return "—" if run is None else f"{run.ttft_mean_ms:,.0f}"


def _fmt_prompt(workload: Workload) -> str:
    lengths = workload.prompt_lengths
    mean = statistics.fmean(lengths)
    label = f"~{workload.target_length:,} ({mean:,.0f}"
    if min(lengths) != max(lengths):
        label += f"; {min(lengths):,}–{max(lengths):,}"
    label += ")"
    return label + (" clipped" if workload.clipped else "")


def render_table(rows: Sequence[Row]) -> str:
    """The markdown table: one line per (model, prompt length, C)."""
    lines = [
        "| model | prompt tokens (mean; range) | C | Shoal tok/s | llama.cpp tok/s | Shoal / llama.cpp "
        "| TTFT Shoal ms | TTFT llama.cpp ms | llama.cpp --parallel | rounds (busy) | Shoal preemptions |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        ratio = row.ratio
        lines.append(
            f"| {row.model} | {_fmt_prompt(row.workload)} | {row.workload.concurrency} | "
            f"{_fmt_rate(row.shoal)} | {_fmt_rate(row.llama)} | "
            f"{'—' if ratio is None else f'**{ratio:.2f}**'} | {_fmt_ttft(row.shoal)} | "
            f"{_fmt_ttft(row.llama)} | {row.parallel} | {row.num_rounds} ({row.num_busy_rounds}) | "
            f"{'—' if row.num_shoal_preemptions is None else row.num_shoal_preemptions} |"
        )
    return "\n".join(lines)


def sum_metric(exposition: str, name: str, model: str) -> float:
    """The sum over series of Prometheus metric `name` whose ``model`` label is `model`, from a
    text exposition (a gateway's /metrics)."""
    total = 0.0
    label = f'model="{model}"'
    for line in exposition.splitlines():
        if line.startswith(name + "{") and label in line.split("}", 1)[0]:
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- docs ---------------------------------------------------------------------------------------

BEGIN_MARKER = "<!-- bench_peers:begin (written by scripts/bench_peers.py; edits inside are replaced) -->"
END_MARKER = "<!-- bench_peers:end -->"


def replace_section(document: str, section: str) -> str:
    """`document` with the text between the bench_peers markers replaced by `section`.

    Without markers the section is appended (markers included). Raises ValueError when the
    markers are unbalanced or out of order, rather than guess what to overwrite.
    """
    num_begin, num_end = document.count(BEGIN_MARKER), document.count(END_MARKER)
    block = f"{BEGIN_MARKER}\n{section.strip()}\n{END_MARKER}"
    if num_begin == 0 and num_end == 0:
        return document.rstrip("\n") + "\n\n" + block + "\n"
    if num_begin != 1 or num_end != 1:
        raise ValueError(f"expected one begin and one end marker, found {num_begin} and {num_end}")
    start, end = document.index(BEGIN_MARKER), document.index(END_MARKER)
    if end < start:
        raise ValueError("the end marker comes before the begin marker")
    return document[:start] + block + document[end + len(END_MARKER):]
