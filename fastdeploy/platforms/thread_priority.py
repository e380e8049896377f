"""Lower the CPU priority of the calling thread: background work (grammar compiles) that must not
take cores from the engine loop and the worker when the host's cores are all busy."""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)


def lower_thread_priority(increment: int) -> bool:
    """Raise the calling thread's nice value by ``increment`` (at most to 19); threads it starts
    afterwards inherit it (Linux keeps a nice value per thread; elsewhere ``setpriority`` takes no
    thread id). Returns whether it changed: False for ``increment <= 0``, off Linux, or where the OS
    refuses."""
    if increment <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + increment))
    except OSError as exc:  # (a sandbox may forbid it: the thread keeps its priority)
        logger.debug("could not lower the priority of thread %s: %s", threading.current_thread().name, exc)
        return False
    return True


def thread_nice(native_id: int | None = None) -> int | None:
    """The nice value of a thread (default: the calling one), None off Linux or where the OS does not say."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id() if native_id is None else native_id)
    except OSError:
        return None


def nice_is_permitted() -> bool:
    """Whether this host lets a thread lower its own priority (a throwaway thread tries; False off Linux)."""
    result: list[bool] = []
    probe = threading.Thread(target=lambda: result.append(lower_thread_priority(1)), name="fd-nice-probe")
    probe.start()
    probe.join()
    return bool(result and result[0])
