"""Python's garbage collector in the serving processes: the start-up heap frozen out of its scans.

A server process builds a large heap once (modules, the tokenizer, the FastAPI app, the model's
modules and tensors: ~250k tracked objects in the API server) and then allocates short-lived
objects per request and per token. Each collection of the oldest generation walks the whole
heap: ~150 ms on the CI CPU for the API server's, which is a stall of every stream at that
moment (the p99 of the first token's detokenize under load was ~100 ms on an H200 host).
:func:`freeze_startup_heap` collects once and moves what survives into the permanent
generation (``gc.freeze``), which later collections skip; vLLM does the same.
"""

from __future__ import annotations

import gc
import logging
import time

from fastdeploy import envs

logger = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> None:
    """Collect, then freeze the surviving heap (``FD_GC_FREEZE=0``: leave the collector alone).
    Call once per process, when its start-up is done; ``process`` names it in the log."""
    if not envs.FD_GC_FREEZE:
        return
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info(
        "%s: %d start-up objects frozen out of garbage collection (%.0f ms)",
        process,
        gc.get_freeze_count(),
        (time.perf_counter() - started) * 1e3,
    )


def freeze_late_heap() -> None:
    """Freeze what a part built after start-up to keep for the process's life (the structured-output
    manager's tokenizer and grammar compiler, built at the first constraint), without a collection:
    called from any thread, mid-serving, it must not stall the engine loop. Objects alive at that
    moment that die later are still freed by reference counting; only cyclic garbage among them
    stays (once, bounded by what was live then)."""
    if envs.FD_GC_FREEZE:
        gc.freeze()


def unfreeze_heap() -> None:
    """Undo the freezes when what they kept is shut down (an offline engine, the structured-output
    manager): its objects become collectable again, and native extensions (xgrammar, Triton) do not
    report them as leaked when the interpreter exits."""
    if gc.get_freeze_count():
        gc.unfreeze()
