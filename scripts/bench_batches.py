"""The Batch API against ``shoal run-batch`` on the same running Shoal, in the same run: the same
chat lines, 8 requests at a time each (the gateway's default `batch_concurrency`, run-batch's
``--concurrency 8``), timed from the upload to the output file in hand (Batch API) and from the
command's start to its exit (run-batch).

    python scripts/bench_batches.py --base-url http://127.0.0.1:8000 --requests 100 --rounds 2

Results in docs/benchmarks.md ("Batches").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

MODEL = "demo/qwen2-25m"
FINAL = ("completed", "failed", "cancelled", "expired")


def _lines(count: int) -> list[str]:
    return [json.dumps({"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Hello {n}"}],
                                 "max_tokens": 32, "ignore_eos": True}}) for n in range(count)]


def time_batch_api(client: OpenAI, lines: list[str]) -> float:
    started = time.monotonic()
    source = client.files.create(file=("bench.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in FINAL:
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    if batch.status != "completed" or batch.request_counts is None or batch.request_counts.failed:
        raise SystemExit(f"the batch did not answer every line: {batch}")
    answers = client.files.content(batch.output_file_id or "").text
    if len(answers.splitlines()) != len(lines):
        raise SystemExit("the output file does not hold every answer")
    return time.monotonic() - started


def time_run_batch(base_url: str, lines: list[str]) -> float:
    with tempfile.TemporaryDirectory() as folder:
        source, output = Path(folder) / "bench.jsonl", Path(folder) / "out.jsonl"
        source.write_text("\n".join(lines) + "\n")
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "shoal.cli.main", "run-batch", "-i", str(source), "-o",
                               str(output), "--url", base_url, "--concurrency", "8"], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise SystemExit(f"run-batch failed: {done.stderr[-500:]}")
        return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url + "/v1", api_key="unused")
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "warm up"}], max_tokens=2)
    lines = _lines(args.requests)
    for round_number in range(args.rounds):
        api_s, cli_s = time_batch_api(client, lines), time_run_batch(args.base_url, lines)
        print(f"round {round_number}: {args.requests} chats, Batch API {api_s:.1f} s, run-batch {cli_s:.1f} s, "
              f"ratio {api_s / cli_s:.2f}")


if __name__ == "__main__":
    main()
