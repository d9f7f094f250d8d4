"""Keeps Python's cyclic garbage collector off what a process built at start.

A worker holds ~390,000 objects that the collector tracks once torch, transformers and its
model are loaded; a full collection walks all of them, ~190 ms on the development VM, and
request traffic triggers one every so often (a collection runs when enough new objects
outlive the young generations). Such pauses showed up as a round of llama-5m requests at
C = 8 with a 400-500 ms time to first token instead of ~40 ms (docs/engine.md, "Threads").
Moving the start-up objects to the collector's permanent generation (`gc.freeze`) leaves it
only the objects made since: a full collection then takes well under a millisecond.

Freeze after loading, before building what is thrown away later (a worker's engine is rebuilt
on a wake onto another allocation): a frozen object that becomes cyclic garbage is never collected.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect what start-up left behind, then freeze the rest; returns how many objects
    the collector no longer scans."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
