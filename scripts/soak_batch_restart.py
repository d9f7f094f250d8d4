"""A Batch API batch across a restart of ``shoal up``: upload N chats, stop Shoal (SIGTERM) once
a share of them is answered, start it again on the same state dir, and count what the new
gateway sent: only the requests with no saved answer (batch_saves.py), not the whole batch.

    python scripts/soak_batch_restart.py --requests 200 --stop-at 0.4

Prints the batch's end, how many answers the first run saved, how many requests the second
sent (its ``shoal_gateway_batch_requests_total``), and whether the output holds every line
once, in order. Results in docs/reliability.md ("A batch across a restart").
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from openai import OpenAI

MODEL = "demo/llama-5m"
FINAL = ("completed", "failed", "cancelled", "expired")
UP_TIMEOUT_S = 180.0


def start_shoal(state_dir: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    log = log_path.open("wb")
    process = subprocess.Popen([sys.executable, "-m", "shoal.cli.main", "up", "--state-dir", str(state_dir),
                                "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while "Shoal is up" not in log_path.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"shoal up did not start; see {log_path}")
        time.sleep(0.5)
    return process


def stop_shoal(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)


def batch_requests_sent(base_url: str) -> int:
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    return int(sum(float(value) for value in
                   re.findall(r'^shoal_gateway_batch_requests_total\{[^}]*\} ([0-9.e+]+)$', text, re.M)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--stop-at", type=float, default=0.4, help="share of the batch answered when Shoal stops")
    parser.add_argument("--port", type=int, default=8021)
    args = parser.parse_args()
    base_url = f"http://127.0.0.1:{args.port}"
    client = OpenAI(base_url=base_url + "/v1", api_key="none")
    lines = [json.dumps({"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {n}"}],
                                  "max_tokens": 64, "ignore_eos": True}}) for n in range(args.requests)]
    with tempfile.TemporaryDirectory() as folder:
        state_dir, log_path = Path(folder) / "state", Path(folder) / "first.log"
        shoal = start_shoal(state_dir, args.port, log_path)
        try:
            source = client.files.create(file=("restart.jsonl", "\n".join(lines).encode()), purpose="batch")
            batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            while (batch := client.batches.retrieve(batch.id)).request_counts is None or \
                    batch.request_counts.completed < args.stop_at * args.requests:
                time.sleep(0.2)
            answered_before = batch.request_counts.completed
            stop_shoal(shoal)
            saved = sum(int(n) for n in re.findall(r"batch_answers_saved\s+answers=(\d+)",
                                                   log_path.read_text(errors="replace")))
            shoal = start_shoal(state_dir, args.port, Path(folder) / "second.log")
            while (batch := client.batches.retrieve(batch.id)).status not in FINAL:
                time.sleep(0.5)
            sent_after = batch_requests_sent(base_url)
            output = [json.loads(line) for line in client.files.content(batch.output_file_id or "").text.splitlines()]
        finally:
            stop_shoal(shoal)
    in_order = [record["custom_id"] for record in output] == [f"r{n}" for n in range(args.requests)]
    print(f"batch {batch.status}: {len(output)} of {args.requests} lines in the output, in order: {in_order}")
    print(f"answered when Shoal stopped (last progress write): {answered_before}; answers saved: {saved}")
    print(f"requests the restarted gateway sent: {sent_after} (the whole batch: {args.requests}); "
          f"asked again: {sent_after - (args.requests - saved)}")


if __name__ == "__main__":
    main()
