"""OpenAI's batch format: a file of requests (one JSON object per line), checked whole, and
each request sent to a gateway, asked again while the gateway will answer later (429, 503, a
dropped connection). ``shoal run-batch`` (cli/run_batch.py) and the gateway's Batch API
(services/gateway/batch_runner.py) both send batches this way."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgspec

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/score",
              "/v1/rerank", "/v1/messages")
"""The routes a line may name (OpenAI's batch endpoints, and those Shoal serves beside them)."""
RETRIED_STATUSES = frozenset({429, 503})
"""A full queue or a model not placed yet: the gateway will answer later."""
FIRST_BACKOFF_S = 1.0
MIN_RETRY_DELAY_S = 0.2
"""Even after ``Retry-After: 0``: each retry spends some of the budget, so it runs out."""
MAX_BACKOFF_S = 30.0
MAX_ERRORS_SHOWN = 20

class BatchLine(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class BadBatch(Exception):
    """The input is not a batch: each bad line named (nothing was sent)."""

    def __init__(self, problems: list[tuple[int, str]]) -> None:
        shown = [f"line {number}: {problem}" for number, problem in problems[:MAX_ERRORS_SHOWN]]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        super().__init__(f"{len(problems)} bad line(s), nothing sent:\n  " + "\n  ".join(shown) + more)
        self.problems = problems
        """(line number, what is wrong with it), in the file's order."""


def read_batch(lines: Iterable[str], endpoint: str | None = None) -> list[BatchLine]:
    """Every request of a batch file (blank lines skipped), or BadBatch naming every bad line.
    With `endpoint` (OpenAI's Batch API: one route per batch), every line must name it."""
    batch: list[BatchLine] = []
    problems: list[tuple[int, str]] = []
    first_seen: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            line = msgspec.json.decode(text, type=BatchLine)
        except msgspec.DecodeError as exc:
            problems.append((number, str(exc)))
            continue
        problem = _line_problem(line, first_seen.get(line.custom_id), endpoint)
        if problem:
            problems.append((number, problem))
        first_seen.setdefault(line.custom_id, number)
        batch.append(line)
    if problems:
        raise BadBatch(problems)
    return batch


def _line_problem(line: BatchLine, seen_on: int | None, endpoint: str | None) -> str | None:
    if not line.custom_id:
        return "custom_id is empty"
    if seen_on is not None:
        return f"custom_id {line.custom_id!r} is line {seen_on}'s too (each names one request)"
    if endpoint is not None and line.url != endpoint:
        return f"url {line.url!r} is not the batch's endpoint {endpoint!r}"
    if line.url not in BATCH_URLS:
        return f"url {line.url!r} is not a batch route (one of {', '.join(BATCH_URLS)})"
    if line.body.get("stream"):
        return "stream is not supported in a batch (each answer is written whole)"
    return None


@dataclass
class Outcome:
    """One request's output line, and what the summary counts of it."""

    custom_id: str
    status_code: int | None
    """None: no answer came (`error` says why)."""
    request_id: str | None
    body: Any
    error: dict[str, str] | None = None
    retry_after: str | None = None
    """The gateway's Retry-After header, if it sent one."""

    @property
    def answered(self) -> bool:
        """The gateway gave its answer (a refusal for want of capacity is not one)."""
        return self.status_code is not None and self.status_code not in RETRIED_STATUSES

    def record(self) -> dict[str, Any]:
        response = (None if self.status_code is None else
                    {"status_code": self.status_code, "request_id": self.request_id, "body": self.body})
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": self.custom_id, "response": response,
                "error": self.error}

    def total_tokens(self) -> int:
        usage = self.body.get("usage") if isinstance(self.body, dict) else None
        if not isinstance(usage, dict):
            return 0
        if "total_tokens" in usage:
            return int(usage["total_tokens"] or 0)
        return int(usage.get("input_tokens") or 0) + int(usage.get("output_tokens") or 0)  # Anthropic's


def retry_delay_s(retry_after: str | None, backoff_s: float) -> float:
    """How long to wait before asking again: the gateway's Retry-After (seconds), else `backoff_s`."""
    try:
        return max(MIN_RETRY_DELAY_S, float(retry_after or ""))
    except ValueError:
        return backoff_s


@dataclass
class Sender:
    """Sends one request at a time through `session`, retrying what the gateway will answer later."""

    session: aiohttp.ClientSession
    base_url: str
    headers: dict[str, str]
    max_retry_wait_s: float
    timeout_s: float
    retries: int = field(default=0)

    async def send(self, line: BatchLine) -> Outcome:
        """The gateway's answer to `line`, asked again (within `max_retry_wait_s` of the first
        try) while it is a 429 or 503 or the connection fails; an attempt that runs out its
        `timeout_s` is not repeated (it would only run as long again)."""
        give_up_at = time.monotonic() + self.max_retry_wait_s
        backoff_s = FIRST_BACKOFF_S
        while True:
            refusal: Outcome | None = None
            try:
                answer = await self._post(line)
                if answer.answered:
                    return answer
                refusal = answer
                delay_s, why = retry_delay_s(answer.retry_after, backoff_s), f"status {answer.status_code}"
            except TimeoutError:
                return Outcome(line.custom_id, None, None, None, error={
                    "code": "timeout", "message": f"no answer within the timeout ({self.timeout_s:g} s)"})
            except (aiohttp.ClientError, OSError) as exc:  # no connection, a reply cut off
                delay_s, why = backoff_s, f"{type(exc).__name__}: {exc}".rstrip(": ")
            if time.monotonic() + delay_s > give_up_at:
                return refusal or Outcome(line.custom_id, None, None, None, error={
                    "code": "unreachable", "message": f"no answer within the retry budget "
                                                      f"({self.max_retry_wait_s:g} s; last: {why})"})
            self.retries += 1
            await asyncio.sleep(delay_s)
            backoff_s = min(MAX_BACKOFF_S, backoff_s * 2)

    async def _post(self, line: BatchLine) -> Outcome:
        async with self.session.post(self.base_url + line.url, json=line.body, headers=self.headers,
                                     timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as response:
            raw = await response.read()
            try:
                body = json.loads(raw)
            except ValueError:
                body = {"error": {"message": raw.decode(errors="replace")[:2000], "type": "invalid_response"}}
            return Outcome(line.custom_id, response.status, response.headers.get("x-request-id"), body,
                           retry_after=response.headers.get("Retry-After"))
