"""engine/heap.py: no collections during startup, none of the startup heap after."""

from __future__ import annotations

import gc

from engine.heap import freeze_startup_heap, pause_collection


def test_collection_paused_for_startup_resumes_once_the_heap_is_frozen():
    assert gc.isenabled()
    pause_collection()
    assert not gc.isenabled()
    survivor = [object()]
    freeze_startup_heap()
    assert gc.isenabled()
    assert all(o is not survivor for o in gc.get_objects())  # frozen: never walked again


def test_a_collector_turned_off_by_someone_else_stays_off():
    gc.disable()
    try:
        pause_collection()
        freeze_startup_heap()
        assert not gc.isenabled()
    finally:
        gc.enable()
