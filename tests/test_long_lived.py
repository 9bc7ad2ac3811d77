"""mesh/core/long_lived.py: a serving process freezes what its start-up built, after collecting its garbage."""
from __future__ import annotations

import gc
import weakref

from mesh.core.long_lived import freeze_long_lived


class Node:
    """An object that can sit in a reference cycle (only the cyclic collector frees one)."""

    def __init__(self) -> None:
        self.me = self


def test_freeze_collects_the_start_ups_garbage_first_and_freezes_what_lives():
    dead, alive = Node(), Node()
    dead_ref = weakref.ref(dead)
    del dead
    try:
        frozen = freeze_long_lived()
        assert dead_ref() is None  # collected before the freeze
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # frozen: out of every generation the collector walks
    finally:
        gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())


def test_a_cycle_frozen_without_the_collection_is_never_freed():
    dead = Node()
    dead_ref = weakref.ref(dead)
    del dead
    try:
        freeze_long_lived(collect=False)
        gc.collect()
        assert dead_ref() is not None  # why the default collects first
    finally:
        gc.unfreeze()
    gc.collect()
    assert dead_ref() is None
