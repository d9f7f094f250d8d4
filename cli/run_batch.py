"""``shoal run-batch``: a file of requests in OpenAI's batch format, answered by a running
gateway, as ``vllm run-batch`` answers one offline.

Each input line is ``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {...}}`` (any of the gateway's POST inference routes); each output line is OpenAI's
batch output, in the input's order: ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error": null}``. A request the gateway refused is a line with its
status and error body; one that never got an answer (the gateway unreachable the whole
retry budget) has ``"response": null`` and ``error``.

The whole file is read and checked first: a bad line (not JSON, a missing or repeated
``custom_id``, another method or route, ``"stream": true``) stops the run before any request
is sent, naming each bad line. Requests run `--concurrency` at a time; a 429 or 503 (a full
queue, a model being placed) and a dropped connection are retried after the gateway's
``Retry-After`` (or a growing backoff), for up to `--max-retry-wait-s` per request: a batch
waits for capacity rather than failing. Lines are written as soon as every line before them
is, so an interrupted run leaves a prefix of its output, and ``--resume`` sends only the
requests that prefix did not answer (their lines then come after it). A request still refused
with a 429 or 503, or never answered, when its budget ran out counts as unanswered: the exit
status is 1 and ``--resume`` sends it again. At most `WINDOW_PER_WORKER` × `--concurrency`
answers wait in memory for a slow line before them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import aiohttp
import msgspec

from shoal.shared.openai_batch import RETRIED_STATUSES, BadBatch, BatchLine, Outcome, Sender, read_batch

WINDOW_PER_WORKER = 16
DEFAULT_URL = "http://127.0.0.1:8000"


def finished_ids(lines: Iterable[str]) -> set[str]:
    """The custom_ids an earlier run's output answered (not a torn last line, not a request
    still refused for want of capacity or never answered)."""
    done = set()
    for text in lines:
        with contextlib.suppress(msgspec.DecodeError, AttributeError, KeyError, TypeError):
            record = msgspec.json.decode(text)
            response = record.get("response")
            if response is not None and response["status_code"] not in RETRIED_STATUSES:
                done.add(record["custom_id"])
    return done



class OrderedWriter:
    """Writes each request's line once every line before it is written; `window` bounds how
    far past the first unwritten line requests may be sent (and answers held)."""

    def __init__(self, out: IO[str], window: int) -> None:
        self._out = out
        self._pending: dict[int, Outcome] = {}
        self._next = 0
        self._window = window
        self._advanced = asyncio.Condition()

    async def wait_for_room(self, index: int) -> None:
        async with self._advanced:
            await self._advanced.wait_for(lambda: index < self._next + self._window)

    async def put(self, index: int, outcome: Outcome) -> None:
        self._pending[index] = outcome
        while self._next in self._pending:
            self._out.write(json.dumps(self._pending.pop(self._next).record()) + "\n")
            self._next += 1
        self._out.flush()
        async with self._advanced:
            self._advanced.notify_all()


@dataclass
class Summary:
    statuses: dict[str, int] = field(default_factory=dict)
    """Lines by status (or, for one with no answer, its error's code)."""
    total_tokens: int = 0
    unanswered: int = 0

    def count(self, outcome: Outcome) -> None:
        key = str(outcome.status_code) if outcome.status_code is not None else (outcome.error or {}).get("code", "?")
        self.statuses[key] = self.statuses.get(key, 0) + 1
        self.total_tokens += outcome.total_tokens()
        self.unanswered += not outcome.answered

    @property
    def done(self) -> int:
        return sum(self.statuses.values())

    def line(self) -> str:
        counts = ", ".join(f"{count} × {status}" for status, count in sorted(self.statuses.items()))
        return f"{self.done} done ({counts or 'none'}), {self.total_tokens} tokens"


async def run(batch: list[BatchLine], out: IO[str], *, base_url: str, api_key: str, concurrency: int,
              max_retry_wait_s: float, timeout_s: float, progress: IO[str]) -> Summary:
    """Every request of `batch` answered and written to `out` in order; the counts."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    writer, summary = OrderedWriter(out, WINDOW_PER_WORKER * concurrency), Summary()
    started = last_report = time.monotonic()
    indexes = iter(range(len(batch)))  # shared by the workers: each takes the next line
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        sender = Sender(session, base_url.rstrip("/"), headers, max_retry_wait_s, timeout_s)

        async def worker() -> None:
            nonlocal last_report
            for index in indexes:
                await writer.wait_for_room(index)
                outcome = await sender.send(batch[index])
                await writer.put(index, outcome)
                summary.count(outcome)
                if time.monotonic() - last_report >= 5.0:
                    last_report = time.monotonic()
                    print(f"run-batch: {summary.done}/{len(batch)} after {last_report - started:.0f} s",
                          file=progress)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    print(f"run-batch: {summary.line()} in {time.monotonic() - started:.1f} s, {sender.retries} retries",
          file=progress)
    return summary


def add_run_batch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="the batch: JSONL in OpenAI's batch format ('-': "
                                                                   "standard input)")
    parser.add_argument("-o", "--output-file", required=True, help="the answers, JSONL in OpenAI's batch output "
                                                                    "format, in the input's order ('-': standard output)")
    parser.add_argument("--url", default=os.environ.get("SHOAL_URL", DEFAULT_URL),
                        help=f"the gateway (default $SHOAL_URL or {DEFAULT_URL}); the key comes from $SHOAL_API_KEY "
                             "or $OPENAI_API_KEY")
    parser.add_argument("--concurrency", type=_positive_int, default=16, help="requests at once (default 16)")
    parser.add_argument("--max-retry-wait-s", type=float, default=600.0,
                        help="how long one request may wait on 429, 503 or a dropped connection (default 600)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="one attempt's limit (default 600)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the output file's answered lines and send only the other requests")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_batch(args: argparse.Namespace) -> int:
    """0: every request answered (refusals included, each in its line); 1: some were not (a
    429 or 503 to the end of its budget, a timeout, no connection); 2: the input is not a
    batch or an argument is wrong (nothing sent)."""
    try:
        with _opened(args.input_file, "r") as source:
            batch = read_batch(source)
    except (BadBatch, OSError, UnicodeDecodeError) as exc:
        print(f"shoal run-batch: {args.input_file}: {exc}", file=sys.stderr)
        return 2
    if not _is_http_url(args.url):
        print(f"shoal run-batch: --url {args.url!r} is not a gateway address (http://host:port)", file=sys.stderr)
        return 2
    if args.resume and args.output_file == "-":
        print("shoal run-batch: --resume reads the answers already written: name an output file, not '-'",
              file=sys.stderr)
        return 2
    mode = "w"
    if args.resume and Path(args.output_file).is_file():
        done = finished_ids(Path(args.output_file).read_text().splitlines(keepends=True))
        _drop_torn_lines(Path(args.output_file), done)
        batch = [line for line in batch if line.custom_id not in done]
        mode = "a"
        print(f"run-batch: {len(done)} answered before, {len(batch)} to send", file=sys.stderr)
    api_key = os.environ.get("SHOAL_API_KEY") or os.environ.get("OPENAI_API_KEY", "")
    with _opened(args.output_file, mode) as out:
        summary = asyncio.run(run(batch, out, base_url=args.url, api_key=api_key, concurrency=args.concurrency,
                                  max_retry_wait_s=args.max_retry_wait_s, timeout_s=args.timeout_s,
                                  progress=sys.stderr))
    return 1 if summary.unanswered else 0


def _is_http_url(text: str) -> bool:
    parts = urllib.parse.urlsplit(text)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _drop_torn_lines(path: Path, done: set[str]) -> None:
    """Keep only the output's answered lines (a run killed mid-write leaves a torn last one;
    the unanswered are sent again)."""
    kept = [text for text in path.read_text().splitlines(keepends=True) if finished_ids([text]) & done]
    path.write_text("".join(text if text.endswith("\n") else text + "\n" for text in kept))


@contextlib.contextmanager
def _opened(name: str, mode: str) -> Iterator[IO[str]]:
    if name == "-":
        yield sys.stdin if mode == "r" else sys.stdout
        return
    with open(name, mode, encoding="utf-8") as stream:
        yield stream
