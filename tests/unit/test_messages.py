from __future__ import annotations

import msgspec
import pytest

from shoal.shared import messages as m


def _round_trip_msgpack(value: msgspec.Struct, decoder: msgspec.msgpack.Decoder) -> msgspec.Struct:
    return decoder.decode(m.encode_msgpack(value))


def test_inference_request_round_trips_as_msgpack() -> None:
    request = m.InferenceRequest(
        request_id="r1",
        model="org/model",
        params=m.SamplingParams(max_tokens=7, temperature=0.0, stop=["\n"], seed=3),
        deadline=123.5,
        reply_to="shoal.reply.g.r1",
        messages=[m.ChatMessage("user", "hi")],
        stream=True,
    )
    assert _round_trip_msgpack(request, m.request_decoder) == request


@pytest.mark.parametrize(
    "reply",
    [
        m.TokenChunk("r", 1, 0, "hel", 2, "rep"),
        m.FinalReply("r", 2, 5, "length", 10, 7, "rep"),
        m.ErrorReply("r", 1, 413, "too long", "invalid_request_error", "ctx", "rep"),
    ],
)
def test_replies_round_trip_through_the_tagged_union(reply: msgspec.Struct) -> None:
    assert _round_trip_msgpack(reply, m.reply_decoder) == reply


def test_kv_records_are_json_that_people_can_read() -> None:
    gpu = m.GpuRecord(node_id="n", index=0, total_bytes=100,
                      occupants=[m.Occupant("r", "mdl", 40, "serving", 1.0)])
    raw = m.encode_json(gpu)
    assert b'"occupants"' in raw and b'"total_bytes":100' in raw
    decoded = m.gpu_record_decoder.decode(raw)
    assert decoded == gpu
    assert decoded.reserved_bytes == 40 and decoded.available_bytes == 60


def test_sleeping_occupants_hold_no_gpu_memory() -> None:
    gpu = m.GpuRecord(node_id="n", index=0, total_bytes=100,
                      occupants=[m.Occupant("a", "x", 30, "sleeping", 0.0), m.Occupant("b", "y", 20, "serving", 0.0)])
    assert gpu.reserved_bytes == 20


def test_replica_record_round_trips_with_int_gpu_keys() -> None:
    record = m.ReplicaRecord(replica_id="ab", model="org/m", node_id="n1", gpu_bytes={0: 5, 3: 7})
    decoded = m.replica_record_decoder.decode(m.encode_json(record))
    assert decoded.gpu_bytes == {0: 5, 3: 7}
    assert decoded.name == "ModelActor:org/m:ab"


def test_wire_structs_skip_fields_a_newer_service_added() -> None:
    newer = b'{"replica_id":"a","model":"m","node_id":"n","state":"ready","added_in_v2":{"x":1}}'
    assert m.replica_record_decoder.decode(newer).state == "ready"
    chunk = msgspec.msgpack.encode({"type": "chunk", "request_id": "r", "attempt": 1, "seq": 0, "text": "a",
                                    "future_field": [1, 2]})
    assert m.reply_decoder.decode(chunk) == m.TokenChunk("r", 1, 0, "a")


def test_each_scheduler_verb_takes_only_its_own_command() -> None:
    raw = m.encode_json(m.ScaleModel("org/m", 3))
    assert m.scheduler_command_decoders["scale"].decode(raw) == m.ScaleModel("org/m", 3)
    with pytest.raises(msgspec.ValidationError):
        m.scheduler_command_decoders["remove"].decode(raw)  # a scale sent to the remove verb
    with pytest.raises(msgspec.ValidationError):
        m.scheduler_command_decoders["scale"].decode(b'{"type":"launch_rockets"}')
    assert set(m.scheduler_command_decoders) == set(m.SCHEDULER_COMMANDS)


def test_node_agent_and_worker_verbs_take_only_their_own_command() -> None:
    stop = m.encode_json(m.StopReplica("r1", "evicted"))
    assert m.node_command_decoders["stop"].decode(stop) == m.StopReplica("r1", "evicted")
    for decoder in (*(d for verb, d in m.node_command_decoders.items() if verb != "stop"), m.inspect_model_decoder):
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(stop)


def test_reproducibility_of_sampling() -> None:
    assert m.SamplingParams(temperature=0.0).is_reproducible
    assert m.SamplingParams(temperature=0.7, seed=1).is_reproducible
    assert not m.SamplingParams(temperature=0.7).is_reproducible
