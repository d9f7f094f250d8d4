"""Chat sessions through `shoal up`: KV kept between turns, an edited history, session affinity
over two replicas, a replica evicted under a session, the admin API.

Greedy chat turns carry a session id (the ``X-Session-Id`` header or the body's
``session_id``); the same request without one is answered from scratch, and the two answers
must be equal. The replicas' own counters (`shoal_worker_session_*`, through the gateway's
/metrics) say whether a turn reused its session's KV; the gateway's
`shoal_gateway_session_turns_total` says where it sent it. Workers publish stats every half
second here (a setting, through the environment).
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from transformers import AutoTokenizer

from tests.e2e.conftest import ShoalUp, module_shoal_up
from tests.integration.gateway_harness import parse_samples

pytestmark = pytest.mark.e2e

SMALL = "demo/llama-5m"
MEDIUM = "demo/qwen2-25m"
ENV = {"SHOAL_WORKER_STATS_INTERVAL_S": "0.5", "SHOAL_WORKER_SESSIONS_HOST_POOL_BYTES": "16MiB"}
SYSTEM = ("You are a patient guide to the coast. Answer in plain words, name the places you mention, "
          "and keep every answer short enough to read aloud on a windy pier.")
QUESTIONS = (
    "Where do the fishing boats leave from in the early morning, and what do they bring back?",
    "Which path along the cliffs is safe to walk when the tide comes in fast?",
    "What did the old lighthouse keeper write in the log on the night of the storm?",
    "How far is the village with the blue doors from the harbour, walking slowly?",
    "Which birds nest on the rocks below the fort, and when do they leave again?",
)
T = TypeVar("T")


@pytest.fixture(scope="module")
def shoal(demo_models_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShoalUp]:
    yield from module_shoal_up(demo_models_root, tmp_path_factory, env=ENV)


def call(method: str, url: str, body: object | None = None, headers: dict[str, str] | None = None,
         ) -> tuple[int, Any, dict[str, str]]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=240) as response:
            return response.status, json.loads(response.read() or b"null"), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null"), dict(exc.headers)


def wait_for(predicate: Callable[[], T | None], what: str, timeout_s: float = 60.0) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def chat(shoal: ShoalUp, model: str, messages: list[dict[str, str]], *, session_id: str | None = None,
         in_header: bool = True) -> tuple[str, str]:
    """(answer, replica) of one greedy turn."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True}
    headers = {}
    if session_id is not None and in_header:
        headers["X-Session-Id"] = session_id
    elif session_id is not None:
        body["session_id"] = session_id
    status, payload, response_headers = call("POST", shoal.v1 + "/chat/completions", body, headers)
    assert status == 200, payload
    return payload["choices"][0]["message"]["content"], response_headers["X-Shoal-Replica"]


def metric(shoal: ShoalUp, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    with urllib.request.urlopen(shoal.base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(s.value for s in parse_samples(text)
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def session_counts(shoal: ShoalUp, **labels: str) -> dict[str, float]:
    """The session counters of the replicas `labels` select (``replica=...`` or ``model=...``)."""
    return {
        "hit": metric(shoal, "shoal_worker_session_turns_total", result="hit", **labels),
        "miss": metric(shoal, "shoal_worker_session_turns_total", result="miss", **labels),
        "gpu_tokens": metric(shoal, "shoal_worker_session_tokens_total", source="gpu", **labels),
    }


def wait_for_counts(shoal: ShoalUp, hit: float, miss: float, **labels: str) -> dict[str, float]:
    return wait_for(lambda: (c := session_counts(shoal, **labels))["hit"] == hit and c["miss"] == miss and c,
                    f"the stats of {labels} to show {hit} hits and {miss} misses")


def turn_messages(answers: list[str], num_turns: int) -> list[dict[str, str]]:
    """The conversation up to the question of turn `num_turns` (1-based), with the answers so far."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(num_turns):
        messages.append({"role": "user", "content": QUESTIONS[i]})
        if i < num_turns - 1:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def serving(shoal: ShoalUp, model: str) -> list[str]:
    _, cluster, _ = call("GET", shoal.base_url + "/admin/cluster")
    return sorted(r["replica_id"] for r in cluster["replicas"]
                  if r["model"] == model and r.get("level", "HOT") == "HOT" and r.get("state") == "ready")


def test_a_five_turn_conversation_reuses_its_kv_on_turns_two_to_five(shoal: ShoalUp) -> None:
    answers: list[str] = []
    replicas = set()
    gpu_tokens = []
    affinity_before = metric(shoal, "shoal_gateway_session_turns_total", model=SMALL, route="affinity")
    for turn in range(1, 6):
        messages = turn_messages(answers, turn)
        # Both ways of naming the session: the header on odd turns, the body field on even ones.
        answer, replica = chat(shoal, SMALL, messages, session_id="five-turns", in_header=turn % 2 == 1)
        replicas.add(replica)
        counts = wait_for_counts(shoal, hit=turn - 1, miss=1, replica=replica)
        gpu_tokens.append(counts["gpu_tokens"])
        from_scratch, _ = chat(shoal, SMALL, messages)
        assert answer == from_scratch, f"turn {turn} differs from the answer computed without the session"
        answers.append(answer)
    assert len(replicas) == 1
    # Every returning turn found more of its history on the GPU than the turn before.
    assert gpu_tokens[0] == 0 and all(b > a for a, b in itertools.pairwise(gpu_tokens)), gpu_tokens
    assert metric(shoal, "shoal_gateway_session_turns_total", model=SMALL, route="affinity") - affinity_before == 4

    status, listed, _ = call("GET", shoal.base_url + f"/admin/sessions?model={SMALL}")
    assert status == 200, listed
    (session,) = [s for s in listed["sessions"] if s["session_id"] == "five-turns"]
    assert session["replica_id"] in replicas and session["routed"] and session["num_tokens"] >= 64
    assert session["gpu_bytes"] > 0 and not session["active"]


def test_usage_counts_the_prompt_tokens_a_turn_found_cached(shoal: ShoalUp) -> None:
    """``usage.prompt_tokens_details.cached_tokens``: none on a first turn (a history no test
    sent before), its whole blocks on the next turn of its session, and on the same first turn
    sent again without a session (the prefix cache)."""
    block_size = 16  # worker.block_size
    start = session_counts(shoal, model=SMALL)

    def turn(messages: list[dict[str, str]], session_id: str | None = "cached-usage") -> dict[str, Any]:
        body = {"model": SMALL, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "session_id": session_id}
        status, payload, _ = call("POST", shoal.v1 + "/chat/completions", body)
        assert status == 200, payload
        return payload

    first = [{"role": "system", "content": "Counting cached tokens. " + SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    one = turn(first)
    assert one["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    history = one["usage"]["prompt_tokens"] + one["usage"]["completion_tokens"] - 1  # the last token has no K/V yet
    two = turn([*first, one["choices"][0]["message"], {"role": "user", "content": QUESTIONS[1]}])
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert history // block_size * block_size <= cached < two["usage"]["prompt_tokens"], (history, cached)
    assert cached % block_size == 0
    again = turn(first, session_id=None)  # all but its last token cached: whole blocks, one token always computed
    whole_blocks = (one["usage"]["prompt_tokens"] - 1) // block_size * block_size
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == whole_blocks
    # The next test counts session turns from here: its start must include these two.
    wait_for_counts(shoal, hit=start["hit"] + 1, miss=start["miss"] + 1, model=SMALL)


def chat_tokens(models_root: Path, model: str, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(models_root / model)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_an_edited_history_gets_the_answer_computed_from_scratch(shoal: ShoalUp, demo_models_root: Path) -> None:
    start = session_counts(shoal, model=SMALL)
    answers: list[str] = []
    for turn in (1, 2, 3):
        answer, replica = chat(shoal, SMALL, turn_messages(answers, turn), session_id="edited")
        answers.append(answer)
    before = wait_for_counts(shoal, hit=start["hit"] + 2, miss=start["miss"] + 1, model=SMALL)
    edited = turn_messages(answers, 4)
    edited[3]["content"] = "Which path along the dunes is safe when the tide comes in fast?"  # the 2nd question
    answer, edited_replica = chat(shoal, SMALL, edited, session_id="edited")
    from_scratch, _ = chat(shoal, SMALL, edited)
    assert answer == from_scratch
    assert edited_replica == replica
    after = wait_for(lambda: (c := session_counts(shoal, model=SMALL))["hit"] + c["miss"]
                     == before["hit"] + before["miss"] + 1 and c, "the edited turn's stats")
    # It reused only what precedes the edit (the system prompt, the first question and answer).
    reused = after["gpu_tokens"] - before["gpu_tokens"]
    original, changed = (chat_tokens(demo_models_root, SMALL, m) for m in (turn_messages(answers, 4), edited))
    num_common = next(i for i, (a, b) in enumerate(zip(original, changed, strict=False)) if a != b)
    assert 0 < reused <= num_common, (reused, num_common)


def test_two_replicas_keep_each_session_on_its_replica_and_fall_back_when_it_goes(shoal: ShoalUp) -> None:
    status, reply, _ = call("POST", shoal.base_url + f"/admin/models/{MEDIUM}/scale", {"replicas": 2})
    assert status == 200 and reply["ok"], reply
    both = wait_for(lambda: len(r := serving(shoal, MEDIUM)) == 2 and r, "two serving replicas", timeout_s=180)

    # First turns go to the shared queue: start sessions until each replica holds some.
    answers: dict[str, list[str]] = {}
    holder: dict[str, str] = {}
    for i in range(20):
        session_id = f"pair-{i}"
        answer, replica = chat(shoal, MEDIUM, turn_messages([], 1), session_id=session_id)
        answers[session_id], holder[session_id] = [answer], replica
        if len(set(holder.values())) == 2 and i >= 3:
            break
    assert set(holder.values()) == set(both), "first turns should reach both replicas"

    for turn in (2, 3):
        for session_id in answers:
            answer, replica = chat(shoal, MEDIUM, turn_messages(answers[session_id], turn), session_id=session_id)
            assert replica == holder[session_id], f"{session_id} turn {turn} left its replica"
            answers[session_id].append(answer)
    num_returning = 2 * len(answers)
    wait_for(lambda: session_counts(shoal, model=MEDIUM)["hit"] == num_returning,
             f"{num_returning} session hits over the two replicas")

    # Its replica evicted, a session's next turn goes to the other one, which recomputes: same answer.
    session_id = next(iter(answers))
    evicted = holder[session_id]
    (survivor,) = set(both) - {evicted}
    status, reply, _ = call("POST", shoal.base_url + f"/admin/models/{MEDIUM}/evict", {"replica_id": evicted})
    assert status == 200 and reply["ok"], reply
    wait_for(lambda: serving(shoal, MEDIUM) == [survivor], "the eviction")
    def num_fallbacks() -> float:  # an evicted replica is stopped (gone) or parked WARM (asleep)
        return sum(metric(shoal, "shoal_gateway_session_turns_total", model=MEDIUM, route=route)
                   for route in ("gone", "asleep"))

    fallbacks = num_fallbacks()
    messages = turn_messages(answers[session_id], 4)
    answer, replica = chat(shoal, MEDIUM, messages, session_id=session_id)
    assert replica == survivor
    assert answer == chat(shoal, MEDIUM, messages)[0]
    assert num_fallbacks() == fallbacks + 1
    # The final reply moved its route: the next turn has affinity with the survivor, and reuses.
    hits = session_counts(shoal, replica=survivor)["hit"]
    answers[session_id].append(answer)
    _, replica = chat(shoal, MEDIUM, turn_messages(answers[session_id], 5), session_id=session_id)
    assert replica == survivor
    wait_for(lambda: session_counts(shoal, replica=survivor)["hit"] == hits + 1, "the survivor's session hit")


def test_the_admin_api_drops_a_session_and_checks_ids(shoal: ShoalUp) -> None:
    _, replica = chat(shoal, SMALL, turn_messages([], 1), session_id="to-drop")
    status, report, _ = call("DELETE", shoal.base_url + "/admin/sessions/to-drop")
    assert status == 200, report
    assert [d["replica_id"] for d in report["dropped"]] == [replica] and report["routes_removed"] == [SMALL]
    status, listed, _ = call("GET", shoal.base_url + "/admin/sessions")
    assert "to-drop" not in {s["session_id"] for s in listed["sessions"]}
    status, error, _ = call("DELETE", shoal.base_url + "/admin/sessions/to-drop")
    assert status == 404 and error["error"]["param"] == "session_id", error
    status, error, _ = call("DELETE", shoal.base_url + "/admin/sessions/not%20valid")
    assert status == 400 and error["error"]["param"] == "session_id", error

    body = {"model": SMALL, "messages": turn_messages([], 1), "max_tokens": 2}
    status, error, _ = call("POST", shoal.v1 + "/chat/completions", body, {"X-Session-Id": "x" * 129})
    assert status == 400 and error["error"]["param"] == "X-Session-Id", error
    status, error, _ = call("POST", shoal.v1 + "/chat/completions", {**body, "session_id": "a.b"})
    assert status == 400 and error["error"]["param"] == "session_id", error
