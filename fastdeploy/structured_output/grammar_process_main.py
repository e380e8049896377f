"""The grammar process (``FD_GRAMMAR_PROCESSES``; started by
:class:`~fastdeploy.structured_output.grammar_processes.GrammarProcessPool`): compiles constraints on
its control pipe in a thread, and each step advances its requests' matchers and fills their rows of
the shared-memory mask on its mask pipe."""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from fastdeploy.structured_output.grammar_messages import (
    ENDED,
    LIVE,
    READY,
    REFUSED,
    CompileReply,
    MaskReply,
    MaskWork,
)


def serve(
    control_fd: int, mask_fd: int, buffer_fds: list[int], tokenizer_info_json: str, rows: int, words: int
) -> None:
    """A grammar process: compiles on its control pipe (in a thread), advances matchers and fills
    mask rows on its mask pipe, until either pipe sends None or closes."""
    import torch
    import xgrammar as xgr

    from fastdeploy import envs
    from fastdeploy.platforms.thread_priority import lower_thread_priority
    from fastdeploy.structured_output.grammar import build_grammar, clean_message, prime_compiler

    control, mask = Connection(control_fd), Connection(mask_fd)
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    cache_mb = envs.FD_XGRAMMAR_CACHE_MB
    compiler = xgr.GrammarCompiler(
        info, max_threads=2, cache_enabled=cache_mb > 0, cache_limit_bytes=cache_mb << 20
    )
    maps = [mmap.mmap(fd, max(rows * words * 4, mmap.PAGESIZE)) for fd in buffer_fds]
    masks = [torch.from_numpy(np.ndarray((rows, words), dtype=np.int32, buffer=m)) for m in maps]
    grammars: OrderedDict[int, Any] = OrderedDict()
    keep = 4 * max(envs.FD_GRAMMAR_CACHE_SIZE, 1)
    lock = threading.Lock()

    def compile_loop() -> None:
        lower_thread_priority(envs.FD_GRAMMAR_COMPILE_NICE)  # (the mask loop keeps its priority)
        for message in _messages(control):
            error = None
            try:
                grammar = build_grammar(message.kind, message.text, reasoning_prefix=message.reasoning_prefix)
                compiled = compiler.compile_grammar(grammar)
                with lock:  # (the engine's cache holds fewer: one evicted there is not asked for again)
                    grammars[message.key_id] = compiled
                    while len(grammars) > keep:
                        grammars.popitem(last=False)
            except Exception as exc:  # an invalid constraint: its requests fail with the message
                error = clean_message(str(exc))
            control.send(CompileReply(message.key_id, error))

    def prime() -> None:
        lower_thread_priority(envs.FD_GRAMMAR_COMPILE_NICE)
        if cache_mb > 0:
            prime_compiler(compiler, envs.FD_GRAMMAR_PRIME_LENGTH)

    control.send(READY)
    threading.Thread(target=compile_loop, name="fd-grammar-compile", daemon=True).start()
    threading.Thread(target=prime, name="fd-grammar-prime", daemon=True).start()
    matchers: dict[int, Any] = {}
    filler = xgr.BatchGrammarMatcher(1)
    for work in _messages(mask):
        try:
            mask.send(_mask_step(work, matchers, grammars, lock, masks[work.buffer], filler, xgr))
        except Exception as exc:  # reported: the engine lifts these rows
            mask.send(MaskReply([], error=f"{type(exc).__name__}: {exc}"))


def _messages(connection: Connection) -> Iterator[Any]:
    """What the engine sends on ``connection``, until it sends None or closes the pipe."""
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        yield message


def _mask_step(
    work: MaskWork,
    matchers: dict[int, Any],
    grammars: dict[int, Any],
    lock: threading.Lock,
    buffer: Any,
    filler: Any,
    xgr: Any,
) -> MaskReply:
    """Make and free matchers, advance each row's matcher past its tokens, fill the live rows.

    (The rows never name a freed handle: the engine frees a grammar only once nothing holds it.)"""
    for new in work.new:
        with lock:
            compiled = grammars.get(new.key_id)
        if compiled is not None:  # (else its rows are refused: the engine lifts their masks)
            matchers[new.handle] = xgr.GrammarMatcher(
                compiled, override_stop_tokens=new.stop_token_ids or None
            )
    for handle in work.freed:  # (after the new ones: a request may end before its first mask)
        matchers.pop(handle, None)
    states, fill_matchers, fill_rows = [], [], []
    for item in work.rows:
        matcher = matchers.get(item.handle)
        if matcher is None:
            states.append(REFUSED)
            continue
        state = LIVE
        for token in item.tokens:
            if not matcher.accept_token(token):
                state = REFUSED
                break
            if matcher.is_terminated():
                state = ENDED
                break
        states.append(state)
        if state == LIVE:
            fill_matchers.append(matcher)
            fill_rows.append(item.row)
    if fill_matchers:
        filler.batch_fill_next_token_bitmask(fill_matchers, buffer, fill_rows)
    return MaskReply(states, matchers=len(matchers))
