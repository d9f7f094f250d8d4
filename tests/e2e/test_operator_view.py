"""The operator's view against a real `shoal up`: workers' metrics on the gateway's /metrics,
progress comments while a stream waits for a cold start, a client leaving during one, and
the dashboard in headless Chromium.

Each test makes its own starting point (it evicts the model it needs cold), so they pass
in any order. Workers publish stats every second and streams get a comment after half a
second of silence here (settings, through the environment), so the tests wait little.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.samples import Sample

from shoal.shared import subjects
from shoal.shared.bus import connect
from shoal.shared.messages import LoadPhase
from tests.browser import LAUNCH_ARGS, VIEWPORT, chromium_executable
from tests.e2e.conftest import ShoalUp, module_shoal_up
from tests.integration.gateway_harness import parse_samples

pytestmark = pytest.mark.e2e

SMALL = "demo/llama-5m"
MEDIUM = "demo/qwen2-25m"
LARGE = "demo/llama-100m"
STATS_INTERVAL_S = 1.0
ENV = {"SHOAL_WORKER_STATS_INTERVAL_S": str(STATS_INTERVAL_S), "SHOAL_GATEWAY_STREAM_KEEPALIVE_S": "0.5"}
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 6
PHASES: tuple[LoadPhase, ...] = ("placing", "starting", "loading_weights", "building_kernels", "warming_up")
T = TypeVar("T")


@pytest.fixture(scope="module")
def shoal(demo_models_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShoalUp]:
    yield from module_shoal_up(demo_models_root, tmp_path_factory, env=ENV)


def call(method: str, url: str, body: object | None = None, timeout_s: float = 240.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def wait_for(check: Callable[[], T | None], what: str, timeout_s: float = 120.0) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def dashboard_state(shoal: ShoalUp) -> dict[str, Any]:
    status, state = call("GET", shoal.base_url + "/ui/api/state")
    assert status == 200, state
    return state


def replicas_of(shoal: ShoalUp, model: str) -> list[dict[str, Any]]:
    return [r for r in dashboard_state(shoal)["replicas"] if r["model"] == model]


def make_cold(shoal: ShoalUp, model: str) -> None:
    """Stop every replica of `model` (scale to 0: an eviction would park them WARM) and wait
    until their records are gone."""
    if replicas_of(shoal, model):
        status, reply = call("POST", f"{shoal.base_url}/admin/models/{model}/scale", {"replicas": 0})
        assert status == 200, reply
    wait_for(lambda: not replicas_of(shoal, model), f"{model} to have no replica")


def complete(shoal: ShoalUp, model: str, max_tokens: int) -> dict[str, Any]:
    status, reply = call("POST", shoal.v1 + "/completions",
                         {"model": model, "prompt": "The fox", "max_tokens": max_tokens, "ignore_eos": True})
    assert status == 200, reply
    return reply


def scrape(shoal: ShoalUp) -> list[Sample]:
    with urllib.request.urlopen(shoal.base_url + "/metrics", timeout=30) as response:
        return parse_samples(response.read().decode())


def worker_samples(shoal: ShoalUp, name: str, model: str) -> list[Sample]:
    return [s for s in scrape(shoal) if s.name == name and s.labels.get("model") == model]


def open_stream(shoal: ShoalUp, model: str, max_tokens: int = 4):  # type: ignore[no-untyped-def]
    body = json.dumps({"model": model, "prompt": "The fox", "max_tokens": max_tokens, "stream": True}).encode()
    request = urllib.request.Request(shoal.v1 + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=240)


def phases_in(comment: str) -> list[LoadPhase]:
    return [phase for phase in PHASES if f" {phase}" in comment]


def test_workers_metrics_reach_the_gateway_per_model_and_replica_and_leave_with_the_replica(shoal: ShoalUp) -> None:
    complete(shoal, SMALL, 5)
    complete(shoal, MEDIUM, 7)
    for _ in range(2):  # the second time its prompt's full KV blocks come from the prefix cache
        status, reply = call("POST", shoal.v1 + "/completions", {"model": SMALL, "prompt": LONG_PROMPT, "max_tokens": 1})
        assert status == 200, reply
    state = dashboard_state(shoal)
    (node,) = [n["node_id"] for n in state["nodes"]]
    expected = {model: (replica["replica_id"], tokens) for model, tokens in ((SMALL, 5), (MEDIUM, 7))
                for replica in replicas_of(shoal, model)}
    assert set(expected) == {SMALL, MEDIUM}, state["replicas"]

    def reported() -> list[Sample] | None:
        samples = [s for s in scrape(shoal) if s.name == "shoal_worker_generation_tokens_total"]
        by_model = {s.labels["model"]: s for s in samples}
        return samples if all(m in by_model and by_model[m].value >= t for m, (_, t) in expected.items()) else None

    samples = wait_for(reported, "both workers' generated tokens on /metrics", timeout_s=30)
    for model, (replica_id, _) in expected.items():
        (sample,) = [s for s in samples if s.labels["model"] == model]
        assert sample.labels == {"model": model, "replica": replica_id, "node": node}
        (ok,) = [s for s in worker_samples(shoal, "shoal_worker_requests_total", model)
                 if s.labels["outcome"] == "ok"]
        assert ok.value >= 1 and ok.labels["replica"] == replica_id
        (blocks,) = worker_samples(shoal, "shoal_worker_kv_cache_blocks", model)
        assert blocks.value > 0
        (prompt,) = worker_samples(shoal, "shoal_worker_prompt_tokens_total", model)
        assert prompt.value >= 2  # "The fox"
        (steps,) = worker_samples(shoal, "shoal_worker_step_duration_seconds_count", model)
        assert steps.value >= 1
    (hits,) = wait_for(lambda: [s for s in worker_samples(shoal, "shoal_worker_prefix_cache_hits_total", SMALL)
                                if s.value > 0], "a prefix cache hit", timeout_s=30)
    (queries,) = worker_samples(shoal, "shoal_worker_prefix_cache_queries_total", SMALL)
    assert queries.value >= hits.value

    make_cold(shoal, MEDIUM)
    wait_for(lambda: not [s for s in scrape(shoal) if s.labels.get("model") == MEDIUM
                          and s.name.startswith("shoal_worker_")], f"{MEDIUM}'s worker metrics to leave /metrics",
             timeout_s=30)
    assert worker_samples(shoal, "shoal_worker_generation_tokens_total", SMALL), "the other replica's stay"


def test_a_stream_waiting_for_a_cold_start_gets_comment_lines_saying_how_far_it_is(shoal: ShoalUp) -> None:
    make_cold(shoal, LARGE)
    comments: list[str] = []
    data: list[str] = []
    with open_stream(shoal, LARGE) as response:
        assert response.status == 200
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith(":") and not data:
                comments.append(line)
            elif line.startswith("data: "):
                data.append(line.removeprefix("data: "))
    # One comment line per keep-alive (0.5 s): a cold start this machine finishes within one
    # (the fork server warm, the weights in the page cache) gets one; a slower one gets more.
    assert comments, "a comment line while the stream waits"
    assert all(f"for {LARGE}" in c and c.startswith(": waiting ") for c in comments), comments
    seen = [phase for comment in comments for phase in phases_in(comment)]
    assert set(seen) & {"starting", "loading_weights", "building_kernels", "warming_up"}, comments
    order = [PHASES.index(phase) for phase in seen]
    assert order == sorted(order), f"phases went backwards: {seen}"
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks), "the stream carried text after the wait"


def test_a_client_leaving_during_a_cold_start_cancels_its_request(shoal: ShoalUp) -> None:
    make_cold(shoal, MEDIUM)
    cancelled_before = _gateway_count(shoal, MEDIUM, "cancelled")
    comments = []
    with open_stream(shoal, MEDIUM) as response:
        for raw in response:
            line = raw.decode()
            assert not line.startswith("data: "), "the replica answered before the client left"
            if line.startswith(":"):
                comments.append(line)
                if "(queued)" in line:
                    break  # published, and its replica still loads: leave now
    assert "(queued)" in comments[-1], comments

    wait_for(lambda: _gateway_count(shoal, MEDIUM, "cancelled") == cancelled_before + 1,
             "the gateway to count the request cancelled", timeout_s=30)
    # The replica it waited for still comes up (placement is not undone), and never runs it.
    (replica,) = wait_for(lambda: [r for r in replicas_of(shoal, MEDIUM) if r["state"] == "ready"] or None,
                          f"{MEDIUM}'s replica to be ready")
    wait_for(lambda: worker_samples(shoal, "shoal_worker_generation_tokens_total", MEDIUM),
             f"{MEDIUM}'s worker stats", timeout_s=30)
    time.sleep(3 * STATS_INTERVAL_S)  # a few more intervals in which it could have taken it
    (tokens,) = worker_samples(shoal, "shoal_worker_generation_tokens_total", MEDIUM)
    assert tokens.labels["replica"] == replica["replica_id"]
    assert tokens.value == 0
    assert worker_samples(shoal, "shoal_worker_requests_total", MEDIUM) == [], "it finished no request"
    assert asyncio.run(_queue_of(shoal, MEDIUM)) == (0, 0), "nothing left in its queue"


def _gateway_count(shoal: ShoalUp, model: str, outcome: str) -> float:
    return sum(s.value for s in scrape(shoal) if s.name == "shoal_gateway_requests_total"
               and s.labels["model"] == model and s.labels["outcome"] == outcome)


async def _queue_of(shoal: ShoalUp, model: str) -> tuple[int, int]:
    """(pending, ack pending) of the model's consumer on SHOAL_REQUESTS."""
    bus = await connect(shoal.nats_url, "test-queue")
    try:
        info = await bus.js.consumer_info(subjects.REQUESTS_STREAM, subjects.consumer_name(model))
        return info.num_pending or 0, info.num_ack_pending or 0
    finally:
        await bus.close()


def test_dashboard_shows_a_new_replica_and_its_gpu_memory_in_chromium(shoal: ShoalUp, tmp_path: Path) -> None:
    executable = chromium_executable()
    from playwright.sync_api import sync_playwright

    make_cold(shoal, SMALL)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(shoal.base_url + "/ui")
            page.wait_for_function("() => document.body.dataset.renderedAt !== undefined")
            rows = page.locator(f'#replicas tbody tr[data-model="{SMALL}"]')
            assert rows.count() == 0
            held_before = _held_bytes(page)
            width_before = _bar_width(page)

            request = threading.Thread(target=complete, args=(shoal, SMALL, 4))
            request.start()
            request.join(timeout=240)
            assert not request.is_alive()

            page.wait_for_selector(f'#replicas tbody tr[data-model="{SMALL}"][data-state="ready"]', timeout=30_000)
            page.wait_for_function(f"() => Array.from(document.querySelectorAll('.gpu')).reduce("
                                   f"(a, g) => a + Number(g.dataset.heldBytes), 0) > {held_before}", timeout=30_000)
            assert _bar_width(page) > width_before, "the GPU bar grew on screen"
            page.wait_for_selector('#events li[data-kind="replica_ready"]', timeout=30_000)
            row = page.locator(f'#replicas tbody tr[data-model="{SMALL}"]')
            assert row.locator(".state").inner_text() == "ready"
            model_row = page.locator(f'#models tbody tr[data-model="{SMALL}"]')
            assert model_row.locator(".replicas").get_attribute("data-serving") == "1"
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            assert (tmp_path / "dashboard.png").stat().st_size > 10_000
            assert errors == []
        finally:
            browser.close()


def _held_bytes(page) -> int:  # type: ignore[no-untyped-def]
    return int(page.evaluate("Array.from(document.querySelectorAll('.gpu'))"
                             ".reduce((a, g) => a + Number(g.dataset.heldBytes), 0)"))


def _bar_width(page) -> float:  # type: ignore[no-untyped-def]
    """Pixels of GPU bars filled, as drawn."""
    return float(page.evaluate("Array.from(document.querySelectorAll('.bar .seg'))"
                               ".reduce((a, s) => a + s.getBoundingClientRect().width, 0)"))


def test_each_log_line_of_shoal_up_names_the_service_it_comes_from(shoal: ShoalUp) -> None:
    """`shoal up` runs the scheduler, the node agent and the gateway in one process: each line
    says which (``up`` would say nothing), also those of the tasks they started since."""
    complete(shoal, "demo/llama-5m", max_tokens=2)
    services: dict[str, set[str]] = {}
    for line in list(shoal.log_lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and "event" in entry:
            services.setdefault(entry["event"], set()).add(entry.get("service", ""))
    expected = {"scheduler_started": "scheduler", "replica_placed": "scheduler", "node_agent_started": "node-agent",
                "gateway_started": "gateway", "request_answered": "gateway"}
    assert {event: services.get(event) for event in expected} == {e: {s} for e, s in expected.items()}
