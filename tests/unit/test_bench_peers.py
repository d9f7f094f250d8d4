"""The peer benchmark's testable parts: requests from the trace, prompt text, table, docs section, arguments.

The benchmark itself (a C++ build, two servers) is not run here; see docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.local_http import Handler
from tests.local_http import serve as serve_routes

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_peers  # noqa: E402
import peer_llama_cpp  # noqa: E402
import peer_workload as wl  # noqa: E402

# --- trace and lengths ---------------------------------------------------------------------------


def write_trace(path: Path, contexts: list[int]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{i:02d}.0,{c},10" for i, c in enumerate(contexts)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_trace_contexts_keeps_trace_order(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.csv", [374, 396, 12, 2048])
    assert wl.read_trace_contexts(trace) == [374, 396, 12, 2048]


def test_select_prompt_lengths_takes_the_first_in_window_in_trace_order() -> None:
    contexts = [10, 60, 500, 64, 72, 73, 56, 55, 70]
    # ±12.5% of 64 is 56..72: 73 and 55 fall out, both ends are in
    assert wl.select_prompt_lengths(contexts, 64, 4) == [60, 64, 72, 56]
    assert wl.select_prompt_lengths(contexts, 64, 1) == [60]
    assert wl.select_prompt_lengths(contexts, 500, 2) == [500, 500]  # cycles when the trace has too few


def test_select_prompt_lengths_rejects_what_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="no prompt of"):
        wl.select_prompt_lengths([10, 20], 512, 4)
    with pytest.raises(ValueError):
        wl.select_prompt_lengths([10], 0, 4)


def test_lengths_from_the_real_trace_are_near_their_target() -> None:
    if not wl.TRACE.exists():
        pytest.skip(f"{wl.TRACE} is not on this machine")
    contexts = wl.read_trace_contexts()
    for target in (64, 512, 2048):
        lengths = wl.select_prompt_lengths(contexts, target, 32)
        assert len(lengths) == 32
        assert all(0.875 * target <= n <= 1.125 * target for n in lengths)


def test_fit_prompt_lengths_leaves_room_for_the_output() -> None:
    assert wl.fit_prompt_lengths([100, 1900, 2300], 128, 2048) == [100, 1900, 1920]
    with pytest.raises(ValueError, match="no room"):
        wl.fit_prompt_lengths([10], 128, 128)


def test_make_workload_marks_clipped_cells() -> None:
    contexts = [2000, 2100, 1900, 64]
    clipped = wl.make_workload(contexts, 2048, 3, 128, 2048)
    assert clipped.prompt_lengths == (1920, 1920, 1900)
    assert clipped.clipped and clipped.concurrency == 3 and clipped.max_tokens == 128
    fits = wl.make_workload(contexts, 64, 2, 128, 2048)
    assert fits.prompt_lengths == (64, 64) and not fits.clipped


# --- prompt text ---------------------------------------------------------------------------------


class PairTokenizer:
    """Characters are tokens, except that "ab" is one token: decode(slice) can re-encode shorter."""

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                ids.append(1000)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join("ab" if t == 1000 else chr(t) for t in ids)


def test_prompt_maker_hits_exact_lengths_when_a_cut_changes_the_count() -> None:
    tokenizer = PairTokenizer()
    corpus = [ord("a"), ord("b"), *tokenizer.encode("xab"), ord("a")] * 50  # "a", "b" apart merge when joined
    maker = wl.PromptMaker(corpus, tokenizer.encode, tokenizer.decode)
    for num_tokens in (1, 2, 3, 7, 64, 300):
        for index in range(5):
            text = maker.make(num_tokens, index)
            assert len(tokenizer.encode(text)) == num_tokens
    assert maker.make(20, 3) == maker.make(20, 3)  # deterministic


def test_prompt_maker_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        wl.PromptMaker([], str.split, " ".join)  # type: ignore[arg-type]
    maker = wl.PromptMaker([1, 2, 3], lambda s: [ord(c) for c in s], lambda ids: "".join(map(chr, ids)))
    with pytest.raises(ValueError):
        maker.make(0, 0)


def test_prompts_from_the_demo_corpus_tokenize_to_their_length(demo_models_root: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / "demo" / "llama-5m")
    maker = wl.make_prompt_maker(tokenizer, (SCRIPTS.parent / "cli" / "demo_corpus.txt").read_text())
    assert maker.num_corpus_tokens > 5_000
    workload = wl.Workload(64, (64, 72, 56, 1920), 128)
    numbers = wl.PromptNumbers(maker.num_corpus_tokens)
    first_index = numbers.take(4)
    first = wl.make_prompts(maker, workload, first_index)
    assert [len(tokenizer.encode(p)) for p in first] == [64, 72, 56, 1920]
    assert first == wl.make_prompts(maker, workload, first_index)  # deterministic
    second = wl.make_prompts(maker, workload, numbers.take(4))
    # every prompt of both runs starts differently: no shared first block for a prefix cache
    starts = [tuple(tokenizer.encode(p)[:16]) for p in first + second]
    assert len(set(starts)) == len(starts)


def test_prompt_numbers_never_repeat_a_corpus_start() -> None:
    numbers = wl.PromptNumbers(10)
    assert [numbers.take(4), numbers.take(1), numbers.take(5)] == [0, 4, 5]
    with pytest.raises(ValueError, match="repeat a corpus start"):
        numbers.take(1)


# --- results and table ----------------------------------------------------------------------------


def run(seconds: float, ttft: tuple[float, ...], tokens: int = 128) -> wl.RunResult:
    return wl.RunResult(seconds, ttft, tuple(tokens for _ in ttft))


def test_run_result_rates_and_best() -> None:
    slow, fast = run(4.0, (0.5, 1.5)), run(2.0, (0.1, 0.3))
    assert slow.tokens_per_s == pytest.approx(64.0)
    assert fast.ttft_mean_ms == pytest.approx(200.0)
    assert wl.best_run([slow, fast, slow]) is fast
    with pytest.raises(ValueError):
        wl.best_run([])


def test_render_table_rows_ratio_and_gaps() -> None:
    workload = wl.Workload(2048, (1920, 1847, 1920), 128, clipped=True)
    rows = [
        wl.Row("demo/llama-5m", wl.Workload(64, (64,), 128), run(1.0, (0.02,)), run(0.5, (0.01,)), parallel=1,
               num_rounds=3, num_busy_rounds=1, num_shoal_preemptions=0),
        wl.Row("demo/llama-100m", workload, None, run(10.0, (1.0, 2.0, 3.0)), parallel=2, notes=["HTTP 504"]),
    ]
    table = wl.render_table(rows).splitlines()
    assert table[0].startswith("| model | prompt tokens")
    assert len(table) == 4
    assert table[2] == "| demo/llama-5m | ~64 (64) | 1 | 128.0 | 256.0 | **0.50** | 20 | 10 | 1 | 3 (1) | 0 |"
    assert table[3] == ("| demo/llama-100m | ~2,048 (1,896; 1,847–1,920) clipped | 3 | — | 38.4 | — | — | "
                        "2,000 | 2 | 0 (0) | — |")
    assert rows[0].ratio == pytest.approx(0.5) and rows[1].ratio is None


def test_sum_metric_adds_the_model_s_series_only() -> None:
    exposition = "\n".join([
        "# HELP shoal_worker_preemptions_total Requests preempted",
        'shoal_worker_preemptions_total{model="demo/llama-5m",replica="a",node="n"} 3.0',
        'shoal_worker_preemptions_total{model="demo/llama-5m",replica="b",node="n"} 4.0',
        'shoal_worker_preemptions_total{model="demo/llama-100m",replica="c",node="n"} 9.0',
        'shoal_worker_preemptions_created{model="demo/llama-5m",replica="a",node="n"} 1.7e9',
    ])
    assert wl.sum_metric(exposition, "shoal_worker_preemptions_total", "demo/llama-5m") == 7.0
    assert wl.sum_metric(exposition, "shoal_worker_preemptions_total", "demo/other") == 0.0


# --- the docs section -------------------------------------------------------------------------------


def test_replace_section_appends_then_replaces_only_between_markers() -> None:
    document = "# Benchmarks\n\nintro\n"
    first = wl.replace_section(document, "table one")
    assert first.startswith(document.rstrip("\n"))
    assert f"{wl.BEGIN_MARKER}\ntable one\n{wl.END_MARKER}" in first
    edited = first.replace("intro", "intro, edited") + "\n## After\n\nkept\n"
    second = wl.replace_section(edited, "table two\n")
    assert "table one" not in second and "table two" in second
    assert "intro, edited" in second and second.endswith("## After\n\nkept\n")
    assert wl.replace_section(second, "table two") == second  # idempotent


def test_replace_section_refuses_broken_markers() -> None:
    with pytest.raises(ValueError, match="one begin and one end"):
        wl.replace_section(f"{wl.BEGIN_MARKER}\nx\n", "new")
    with pytest.raises(ValueError, match="before the begin"):
        wl.replace_section(f"{wl.END_MARKER}\nx\n{wl.BEGIN_MARKER}\n", "new")
    with pytest.raises(ValueError):
        wl.replace_section(f"{wl.BEGIN_MARKER}{wl.END_MARKER}{wl.BEGIN_MARKER}{wl.END_MARKER}", "new")


def test_the_repository_docs_have_one_peer_section() -> None:
    document = (SCRIPTS.parent / "docs" / "benchmarks.md").read_text()
    assert document.count(wl.BEGIN_MARKER) == 1 and document.count(wl.END_MARKER) == 1
    assert "llama.cpp" in wl.replace_section(document, "llama.cpp")


# --- arguments and settings ----------------------------------------------------------------------


def test_parse_args_defaults_are_the_issue_s_grid() -> None:
    args = bench_peers.parse_args([])
    assert args.models == ["demo/llama-5m", "demo/llama-100m"]
    assert args.concurrency == [1, 8, 32] and args.prompt_lengths == [64, 512, 2048]
    assert args.max_tokens == 128 and args.rounds == 2 and args.threads == 2 and args.parallel is None
    assert args.quiet_wait > 0 and 0 < args.quiet_idle < 1 and args.max_extra_rounds == 2


def test_parse_args_subsets() -> None:
    args = bench_peers.parse_args(["--models", "demo/llama-5m", "--concurrency", "8", "--prompt-lengths",
                                   "64,512", "--parallel", "4,8", "--rounds", "1", "--no-docs"])
    assert args.models == ["demo/llama-5m"] and args.concurrency == [8]
    assert args.prompt_lengths == [64, 512] and args.parallel == [4, 8] and args.rounds == 1 and args.no_docs


@pytest.mark.parametrize("argv", [["--concurrency", "0"], ["--concurrency", "a,b"], ["--prompt-lengths", ""],
                                  ["--rounds", "0"], ["--max-tokens", "0"], ["--models", ","]])
def test_parse_args_rejects_bad_values(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_peers.parse_args(argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_parallel_candidates_and_llama_context() -> None:
    assert bench_peers.get_parallel_candidates(32, None) == [32, 16]
    assert bench_peers.get_parallel_candidates(2, None) == [2, 1]
    assert bench_peers.get_parallel_candidates(1, None) == [1]
    assert bench_peers.get_parallel_candidates(32, [8, 32, 8]) == [32, 8]
    workload = wl.Workload(512, (450, 600), 128)
    assert bench_peers.get_llama_ctx_tokens(workload, 4) == 4 * 768  # 728 rounded up to 256s
    assert bench_peers.get_llama_ctx_tokens(wl.Workload(64, (128,), 128), 1) == 256


def test_both_sides_get_the_same_request() -> None:
    body = bench_peers.completion_body("demo/llama-5m", "hello", 128)
    assert body == {"model": "demo/llama-5m", "prompt": "hello", "max_tokens": 128, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def test_llama_server_command(tmp_path: Path) -> None:
    llama = peer_llama_cpp.LlamaCpp("0.3.36", tmp_path, tmp_path / "llama-server")
    argv = peer_llama_cpp.get_server_argv(llama, tmp_path / "m.gguf", 8080, parallel=8, ctx_tokens=2048, threads=2)
    joined = " ".join(argv)
    assert argv[0] == str(tmp_path / "llama-server")
    assert "-t 2 -tb 2" in joined and "--parallel 8" in joined and "-c 2048" in joined and "--port 8080" in joined


# --- conversion workaround ------------------------------------------------------------------------


def test_demo_tokenizer_is_named_qwen2_for_llama_cpp(demo_models_root: Path) -> None:
    for model in ("llama-5m", "llama-100m"):
        assert peer_llama_cpp.get_pre_tokenizer_name(demo_models_root / "demo" / model) == "qwen2"


def test_unknown_split_regex_is_refused(tmp_path: Path) -> None:
    spec = {"pre_tokenizer": {"type": "Split", "pattern": {"Regex": r"\w+"}, "behavior": "Isolated"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(RuntimeError, match="no pre-tokenizer split regex"):
        peer_llama_cpp.get_pre_tokenizer_name(tmp_path)


def test_converter_test_text_is_read_without_running_the_converter(tmp_path: Path) -> None:
    (tmp_path / "conversion").mkdir()
    (tmp_path / "conversion" / "base.py").write_text(
        "raise SystemExit('never run')\n"
        "class TextModel:\n    def get_vocab_base_pre(self, tokenizer):\n        chktxt = 'a \\n b'\n"
    )
    assert peer_llama_cpp.read_converter_test_text(tmp_path) == "a \n b"
    (tmp_path / "conversion" / "base.py").write_text("x = 1\n")
    with pytest.raises(RuntimeError, match="no chktxt"):
        peer_llama_cpp.read_converter_test_text(tmp_path)


def test_tokenizer_hash_is_the_converter_s_formula() -> None:
    import hashlib

    tokenizer = PairTokenizer()
    expected = hashlib.sha256(str(tokenizer.encode("abc")).encode()).hexdigest()
    assert peer_llama_cpp.get_tokenizer_hash(tokenizer, "abc") == expected


# --- reading a streamed completion (a real socket) ---------------------------------------------------


async def serve(handler: Handler) -> tuple[web.AppRunner, str]:
    return await serve_routes({"/v1/completions": handler})


async def test_stream_completion_reads_text_ttft_and_usage() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"text":"","index":0}]}\n\n')
        await asyncio.sleep(0.05)
        for word in ("Hello", " world"):
            await response.write(f"data: {json.dumps({'choices': [{'text': word, 'index': 0}]})}\n\n".encode())
        final = {"choices": [{"text": "", "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 5, "completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        return response

    runner, url = await serve(handler)
    try:
        workload = wl.Workload(64, (5, 5), 2)
        result = await bench_peers.run_side(url, "m", ["a", "b"], workload)
        assert result.num_output_tokens == (2, 2)
        assert all(0.04 < t <= result.seconds for t in result.ttft_s)  # the empty first event is not text
        async with aiohttp.ClientSession() as session:
            answer = await bench_peers.stream_completion(
                session, url + "/v1/completions", bench_peers.completion_body("m", "a", 3), 0.0)
        assert answer.text == "Hello world" and answer.finish_reason == "length"
        assert (answer.num_prompt_tokens, answer.num_output_tokens) == (5, 3)
        with pytest.raises(bench_peers.CellFailed, match="prompt tokens, not 64"):
            await bench_peers.run_side(url, "m", ["a"], wl.Workload(64, (64,), 2))
    finally:
        await runner.cleanup()


async def test_run_side_fails_on_errors_and_short_answers() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["prompt"] == "too long":
            return web.json_response({"error": {"message": "prompt too long"}}, status=413)
        response = web.StreamResponse()
        await response.prepare(request)
        final = {"choices": [{"text": "x", "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        await response.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        return response

    runner, url = await serve(handler)
    try:
        with pytest.raises(bench_peers.CellFailed, match="HTTP 413"):
            await bench_peers.run_side(url, "m", ["too long"], wl.Workload(64, (1,), 1))
        with pytest.raises(bench_peers.CellFailed, match="1 output tokens"):
            await bench_peers.run_side(url, "m", ["ok"], wl.Workload(64, (1,), 128))
    finally:
        await runner.cleanup()


def test_quiet_wait_measures_the_idle_share_and_gives_up_in_time() -> None:
    idle, total = bench_peers.read_cpu_times()
    assert 0 <= idle <= total
    begun = time.monotonic()
    share = bench_peers.wait_for_quiet(max_wait_s=0.0, min_idle=1.01, sample_s=0.05)  # never quiet enough
    assert 0.0 <= share <= 1.0
    assert time.monotonic() - begun < 1.0
    assert bench_peers.wait_for_quiet(max_wait_s=5.0, min_idle=0.0, sample_s=0.05) >= 0.0  # at once


# --- the worker profile's sorting of py-spy samples ---------------------------------------------


def test_py_spy_samples_are_sorted_by_thread_and_work(tmp_path: Path) -> None:
    import profile_worker

    step = "thread (1): shoal-engine;_bootstrap (threading.py:1002);PagedEngine._run_steps (paged_engine.py:355)"
    loop = "thread (2): MainThread;_run_module_as_main (<frozen runpy>:198);BaseEventLoop.run_forever (asyncio/base_events.py:608)"
    raw = tmp_path / "samples.txt"
    raw.write_text("\n".join([
        f"{step};PagedEngine._step (paged_engine.py:380);ModelRunner.execute (model_runner.py:140);"
        "_make_forward.<locals>.forward (services/worker/engine/packed_linear.py:129) 7",
        f"{step};PagedEngine._step (paged_engine.py:380);ModelRunner.execute (model_runner.py:140);"
        "run_attention (kernels/cpu.py:540) 2",
        f"{step};PagedEngine._step (paged_engine.py:366);Condition.wait (threading.py:331) 5",
        f"{step};PagedEngine._emit (paged_engine.py:399);TextStream.push (services/worker/generation.py:110) 1",
        f"{loop};BaseEventLoop._run_once (asyncio/base_events.py:1884);EpollSelector.select (selectors.py:468) 9",
        f"{loop};BaseEventLoop._run_once (asyncio/base_events.py:1922);Client.publish (nats/aio/client.py:900) 3",
        "thread (3): pool;_bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:81) 4",
        "garbage line without a count",
    ]) + "\n")
    counts = profile_worker.read_raw_samples(raw)
    assert counts == {
        "forward: matmul": 7, "forward: attention": 2, "step thread: idle (waiting for work)": 5,
        "detokenization": 1, "event loop: idle (select)": 9, "event loop: NATS client": 3,
        "other threads (idle)": 4,
    }
