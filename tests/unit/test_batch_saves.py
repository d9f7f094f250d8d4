"""A batch's saved answers (services/gateway/batch_saves.py): a part read back gives the
answers as they came, only those that belong to the batch; when a save is due."""

from __future__ import annotations

from shoal.services.gateway.batch_saves import decode_part, encode_part, is_save_due
from shoal.shared.openai_batch import BatchLine, Outcome

LINES = [BatchLine(custom_id=f"r{i}", method="POST", url="/v1/chat/completions", body={"model": "m"})
         for i in range(3)]


def test_a_part_reads_back_as_the_answers_saved() -> None:
    answers = [(0, Outcome("r0", 200, "req-0", {"choices": [{"text": "é\u2028"}]})),
               (2, Outcome("r2", None, None, None, error={"code": "batch_expired", "message": "late"}))]
    assert decode_part(encode_part(answers), LINES) == answers


def test_answers_that_are_not_the_batchs_are_dropped_and_sent_again() -> None:
    parts = [
        encode_part([(1, Outcome("r1", 200, None, {"ok": 1}))]),
        encode_part([(1, Outcome("other", 200, None, {}))]),  # another request's answer at that place
        encode_part([(3, Outcome("r3", 200, None, {}))]),  # past the batch's end
        encode_part([(-1, Outcome("r2", 200, None, {}))]),
        b'{"index": 0, "custom_id": "r0", "status_code": 200, "request_id": null, "body": {}, "pickle": "x"}\n',
        b"not json\n",
    ]
    assert decode_part(b"".join(parts), LINES) == [(1, Outcome("r1", 200, None, {"ok": 1}))]


def test_a_save_is_due_after_its_interval_or_once_enough_answers_wait() -> None:
    assert not is_save_due(0, 1e9), "nothing to save"
    assert not is_save_due(10, 5.0, every_s=30.0, every_answers=500)
    assert is_save_due(1, 30.0, every_s=30.0, every_answers=500)
    assert is_save_due(500, 0.0, every_s=30.0, every_answers=500)

