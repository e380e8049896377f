"""The start-up heap frozen out of garbage collection in the server processes (platforms/gc_heap.py)."""

from __future__ import annotations

import gc

import pytest

from fastdeploy.platforms.gc_heap import freeze_late_heap, freeze_startup_heap


@pytest.fixture(autouse=True)
def nothing_frozen():
    """Each test starts with nothing frozen (offline engines of earlier tests freeze their heaps)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


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


def test_late_heap_is_frozen_without_a_collection(monkeypatch):
    monkeypatch.setenv("FD_GC_FREEZE", "1")
    garbage = [[] for _ in range(1000)]
    for item in garbage:
        item.append(item)  # cyclic garbage a collection would free
    del garbage, item
    collections = gc.get_stats()[2]["collections"]
    freeze_late_heap()
    assert gc.get_freeze_count() >= 1000
    assert gc.get_stats()[2]["collections"] == collections  # no full collection (no stall)
    monkeypatch.setenv("FD_GC_FREEZE", "0")
    gc.unfreeze()
    freeze_late_heap()
    assert gc.get_freeze_count() == 0


def test_offline_engine_freezes_its_start_up_heap(monkeypatch):
    """The offline LLM runs the engine core and the worker in its process: a full collection of
    that heap (torch, the model, the tokenizer) stalled its engine loop ~100 ms at a time."""
    from fastdeploy import LLM

    monkeypatch.setenv("FD_GC_FREEZE", "1")
    llm = LLM(dtype="float32", max_model_len=64, max_num_seqs=2, num_threads=1)
    try:
        assert gc.get_freeze_count() > 100_000
        assert len(gc.get_objects()) < gc.get_freeze_count() // 4
    finally:
        llm.shutdown()


def test_off_switch_leaves_the_collector_alone(monkeypatch):
    monkeypatch.setenv("FD_GC_FREEZE", "0")
    freeze_startup_heap("test")
    assert gc.get_freeze_count() == 0
