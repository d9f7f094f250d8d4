"""Start-up objects leave the collector's generations; what comes after is collected as before."""

from __future__ import annotations

import gc
import weakref

from shoal.shared.gc_freeze import freeze_startup_objects


class _Node:
    """Something that can sit in a reference cycle."""

    partner: _Node | None = None


def test_start_up_objects_are_frozen_and_later_garbage_is_still_collected() -> None:
    try:
        kept = _Node()
        kept.partner = kept  # a cycle that stays alive: the collector would walk it every time
        num_frozen = freeze_startup_objects()
        # Frozen objects that other threads of this process drop since leave the permanent
        # generation (the count fell by 2 in a CI run): it never grows without another freeze.
        assert 0 < gc.get_freeze_count() <= num_frozen
        assert not any(o is kept for o in gc.get_objects())  # not in any generation now

        garbage = _Node()
        garbage.partner = garbage
        ref = weakref.ref(garbage)
        del garbage
        gc.collect()
        assert ref() is None  # made after the freeze: collected as before
        assert kept.partner is kept
    finally:
        gc.unfreeze()
