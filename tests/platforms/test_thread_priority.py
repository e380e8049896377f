"""lower_thread_priority: only the calling thread's nice value rises, threads it starts inherit it."""

from __future__ import annotations

import os
import threading

import pytest

from fastdeploy.platforms.thread_priority import lower_thread_priority, nice_is_permitted, thread_nice


@pytest.fixture(autouse=True)
def _nice_allowed():
    """Skip off Linux (per-thread nice is its) and where the sandbox forbids even lowering a thread's
    own priority."""
    if not nice_is_permitted():
        pytest.skip("per-thread nice needs Linux, where setpriority is permitted")


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn()))
    thread.start()
    thread.join()
    return box["value"]


def test_only_the_calling_thread_and_its_children_are_lowered():
    main_before = thread_nice()

    def lowered():
        before = thread_nice()
        changed = lower_thread_priority(3)
        child = _in_thread(thread_nice)
        return before, changed, thread_nice(), child

    before, changed, after, child = _in_thread(lowered)
    assert changed
    assert after == min(19, before + 3)
    assert child == after  # a thread started afterwards inherits it
    assert thread_nice() == main_before  # the caller of the thread is untouched


def test_zero_changes_nothing():
    def same():
        before = thread_nice()
        return before, lower_thread_priority(0), thread_nice()

    before, changed, after = _in_thread(same)
    assert not changed and after == before


def test_never_past_19():
    def lowest():
        lower_thread_priority(50)
        return thread_nice()

    assert _in_thread(lowest) == 19
    assert os.getpriority(os.PRIO_PROCESS, 0) <= 19
