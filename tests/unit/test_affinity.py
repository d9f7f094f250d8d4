"""Session affinity's rules (services/gateway/affinity.py), case by case, and the session id a
request carries (header or body field), without NATS or HTTP."""

from __future__ import annotations

import msgspec
import pytest

from shoal.services.gateway.affinity import Route, choose_route, must_move
from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import ChatCompletionRequest, CompletionRequest, session_id_of
from shoal.shared import subjects
from shoal.shared.messages import ReplicaRecord, SessionStats, WorkerStats

MODEL = "org/m"


def record(replica_id: str = "r1", **fields: object) -> ReplicaRecord:
    values: dict[str, object] = {"model": MODEL, "node_id": "n1", "state": "ready"} | fields
    return ReplicaRecord(replica_id=replica_id, **values)  # type: ignore[arg-type]


def stats(replica_id: str = "r1", **fields: object) -> WorkerStats:
    values: dict[str, object] = {"node_id": "n1", "at": 1.0, "interval_s": 1.0, "engine": "paged",
                                 "sessions": SessionStats()} | fields
    return WorkerStats(replica_id=replica_id, model=MODEL, **values)  # type: ignore[arg-type]


def route(holder_id: str | None = "r1", holder: ReplicaRecord | None = None, holder_stats: WorkerStats | None = None,
          others: tuple[WorkerStats, ...] = (), session_id: str | None = "s1") -> Route:
    return choose_route(session_id, holder_id, holder if holder is not None else record(), holder_stats, others)


def test_a_request_without_a_session_or_a_known_replica_goes_to_the_shared_queue() -> None:
    assert route(session_id=None) == Route(None, "none")
    assert choose_route("s1", None, None, None, ()) == Route(None, "new")


def test_a_returning_turn_goes_to_its_replica() -> None:
    assert route() == Route("r1", "affinity"), "no stats heard yet: the final reply named it, trust that"
    assert route(holder_stats=stats(num_requests_running=5)) == Route("r1", "affinity")


@pytest.mark.parametrize("holder", [None, record(state="failed"), record(state="stopping"), record("r2")])
def test_a_replica_gone_failed_or_stopping_is_not_sent_turns(holder: ReplicaRecord | None) -> None:
    assert choose_route("s1", "r1", holder, stats(), ()) == Route(None, "gone")


@pytest.mark.parametrize("holder, holder_stats", [
    (record(state="draining"), None),
    (record(level="WARM", state="sleeping"), None),
    (record(state="loading"), None),
    (record(), stats(serving=False)),
])
def test_a_replica_that_does_not_serve_now_is_asleep(holder: ReplicaRecord, holder_stats: WorkerStats | None) -> None:
    assert route(holder=holder, holder_stats=holder_stats) == Route(None, "asleep")


def test_a_replica_without_a_session_cache_gets_no_affinity() -> None:
    assert route(holder_stats=stats(sessions=None)) == Route(None, "no_cache")
    assert route(holder_stats=stats(engine="hf", sessions=None)) == Route(None, "no_cache")


def test_a_saturated_replica_keeps_its_turns_unless_another_has_room() -> None:
    busy = stats(num_requests_waiting=3, num_requests_running=8)
    assert route(holder_stats=busy) == Route("r1", "affinity"), "no other replica"
    assert route(holder_stats=busy, others=(stats("r2", num_requests_waiting=1),)) == Route("r1", "affinity")
    assert route(holder_stats=busy, others=(stats("r2", serving=False),)) == Route("r1", "affinity")
    assert route(holder_stats=busy, others=(stats("r2"),)) == Route(None, "saturated")
    assert route(holder_stats=stats(), others=(stats("r2"),)) == Route("r1", "affinity")
    just_arrived = stats(num_requests_waiting=1)  # nothing running: not yet picked up, not saturated
    assert route(holder_stats=just_arrived, others=(stats("r2"),)) == Route("r1", "affinity")


def test_a_request_is_moved_only_off_a_replica_that_will_never_answer_it() -> None:
    assert must_move(None)
    assert must_move(record(state="failed"))
    assert must_move(record(level="WARM", state="sleeping"))
    # Draining or stopping replicas finish what they started and move the rest themselves.
    assert not must_move(record(state="draining"))
    assert not must_move(record(state="stopping"))
    assert not must_move(record())


# ------------------------------------------------------------------ the session id of a request

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields: object) -> ChatCompletionRequest:
    return msgspec.convert(BODY | fields, ChatCompletionRequest)


@pytest.mark.parametrize("session_id", ["a", "0b7f5c1e-3f6a-4c53-9d55-2c1b1c0e9a11", "01HZX3_k-Q", "x" * 128])
def test_session_ids_from_the_header_or_the_body(session_id: str) -> None:
    assert session_id_of(chat(), session_id) == session_id
    assert session_id_of(chat(session_id=session_id), None) == session_id
    assert session_id_of(chat(session_id=session_id), session_id) == session_id
    completion = msgspec.convert({"model": MODEL, "prompt": "hi", "session_id": session_id}, CompletionRequest)
    assert session_id_of(completion, None) == session_id


def test_no_session_id_and_null_are_absent() -> None:
    assert session_id_of(chat(), None) is None
    assert session_id_of(chat(session_id=None), None) is None


@pytest.mark.parametrize("bad, problem", [
    ("", "empty"), ("x" * 129, "longer than 128"), ("a.b", "only hold"), ("a b", "only hold"),
    ("sessão", "only hold"), ("a/b", "only hold"), ("a\n", "only hold"),
])
def test_bad_session_ids_are_a_400_naming_where_they_came_from(bad: str, problem: str) -> None:
    with pytest.raises(BadRequest, match=problem) as in_body:
        session_id_of(chat(session_id=bad), None)
    assert in_body.value.param == "session_id"
    with pytest.raises(BadRequest, match=problem) as in_header:
        session_id_of(chat(), bad)
    assert in_header.value.param == "X-Session-Id"


def test_a_header_and_a_body_field_that_differ_are_a_400() -> None:
    with pytest.raises(BadRequest, match="differ") as error:
        session_id_of(chat(session_id="a"), "b")
    assert error.value.param == "session_id"


def test_a_session_id_that_is_not_a_string_is_a_400_at_decoding() -> None:
    with pytest.raises(msgspec.ValidationError, match="session_id"):
        chat(session_id=12)


def test_session_names_on_the_wire() -> None:
    assert subjects.replica_infer_subject("org/m", "abc123") == "shoal.infer.org=2Fm.abc123"
    assert subjects.replica_consumer_name("abc123") == "replica-abc123"
    assert subjects.session_route_key("org/m", "s-1") == "org=2Fm.s-1"
    with pytest.raises(subjects.InvalidSessionId):
        subjects.session_route_key("org/m", "s.1")
    with pytest.raises(AssertionError, match="subject token"):
        subjects.replica_infer_subject("org/m", "a.b")
