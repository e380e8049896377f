"""The start-up heap frozen out of garbage collection in the server processes (platforms/gc_heap.py)."""

from __future__ import annotations

import gc

from fastdeploy.platforms.gc_heap import freeze_startup_heap


def test_freeze_moves_the_heap_out_of_collections(monkeypatch):
    monkeypatch.setenv("FD_GC_FREEZE", "1")
    heap = [{"n": i} for i in range(200_000)]  # a start-up heap of many tracked objects
    try:
        assert len(gc.get_objects()) >= len(heap)
        freeze_startup_heap("test")
        assert gc.get_freeze_count() >= len(heap)
        assert len(gc.get_objects()) < len(heap) // 10  # what collections walk: the heap is not in it
    finally:
        gc.unfreeze()


def test_off_switch_leaves_the_collector_alone(monkeypatch):
    monkeypatch.setenv("FD_GC_FREEZE", "0")
    freeze_startup_heap("test")
    assert gc.get_freeze_count() == 0
