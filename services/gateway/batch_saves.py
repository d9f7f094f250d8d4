"""A running batch's answers, saved as it goes so that a runner taking it over (its gateway
stopped, or died) sends only what was not answered yet.

Every `SAVE_EVERY_S`, or once `SAVE_EVERY_ANSWERS` answers wait, the runner saves the answers
that came since its last save as one part: JSON lines ``{"index", "custom_id", ...}`` in the
``shoal_files`` object store, under a name only the batch's record knows
(`batch_store.part_name`); the record counts each run's parts, written by compare-and-swap
with the claim, so a runner that lost the batch saves nothing. A stopping gateway saves what
its runs hold before it lets them go. The parts are deleted once the batch's files are
written; the object store forgets any it left behind after `gateway.files_ttl_s`.

A part is Shoal's own JSON (never unpickled); a line that does not fit the batch (an index
past its end, another request's custom_id) is dropped and that request sent again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
import structlog

from shoal.shared.openai_batch import BatchLine, Outcome

log = structlog.get_logger(__name__)

SAVE_EVERY_S = 30.0
"""A run saves what it answered at least this often (when it answered anything)."""
SAVE_EVERY_ANSWERS = 500
"""... or as soon as this many answers wait to be saved."""


class SavedAnswer(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    index: int
    """The request's place among the batch's requests (from 0)."""
    custom_id: str
    status_code: int | None
    request_id: str | None
    body: Any
    error: dict[str, str] | None = None


def is_save_due(num_unsaved: int, since_save_s: float, *, every_s: float = SAVE_EVERY_S,
                every_answers: int = SAVE_EVERY_ANSWERS) -> bool:
    return num_unsaved > 0 and (since_save_s >= every_s or num_unsaved >= every_answers)


def encode_part(answers: Iterable[tuple[int, Outcome]]) -> bytes:
    encoder = msgspec.json.Encoder()
    return b"".join(
        encoder.encode(SavedAnswer(index=index, custom_id=outcome.custom_id, status_code=outcome.status_code,
                                   request_id=outcome.request_id, body=outcome.body, error=outcome.error)) + b"\n"
        for index, outcome in answers)


def decode_part(data: bytes, lines: list[BatchLine]) -> list[tuple[int, Outcome]]:
    """The answers of a part that belong to the batch of `lines` (the others dropped, logged)."""
    decoder = msgspec.json.Decoder(SavedAnswer)
    found: list[tuple[int, Outcome]] = []
    dropped = 0
    for text in data.splitlines():
        try:
            saved = decoder.decode(text)
        except msgspec.DecodeError:
            dropped += 1
            continue
        if not 0 <= saved.index < len(lines) or lines[saved.index].custom_id != saved.custom_id:
            dropped += 1
            continue
        found.append((saved.index, Outcome(saved.custom_id, saved.status_code, saved.request_id, saved.body,
                                           error=saved.error)))
    if dropped:
        log.warning("batch_saved_answers_dropped", dropped=dropped, detail="not this batch's: sent again")
    return found
