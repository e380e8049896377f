"""Where the API server's tokenizer work runs: off the event loop, and long texts apart from short ones.

Tokenizing takes time in proportion to the text (about half a second per
million characters), and one thread serves the requests in order, so a single
huge prompt would hold up every small one behind it. Two lanes keep them
apart: texts up to :data:`LONG_TEXT_CHARS` run on one thread, longer ones on a
second thread with its own copy of the tokenizer (a Rust tokenizer is never
used from two threads at once). How long a text may be at all is bounded by
the caller (see ``OpenAIServing.check_text_length``), so the long lane's work
per request is bounded too.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

LONG_TEXT_CHARS = 32_768
"""Texts longer than this (in characters) are tokenized on the long lane."""


class TokenizerLanes:
    """Two tokenizer threads: one for short texts, one (with a private tokenizer copy) for long ones."""

    def __init__(self, long_text_chars: int = LONG_TEXT_CHARS):
        self.long_text_chars = long_text_chars
        self._short = ThreadPoolExecutor(1, thread_name_prefix="fd-tokenizer")
        self._long = ThreadPoolExecutor(1, thread_name_prefix="fd-tokenizer-long")
        self._long_copy_of: tuple[Any, Any] | None = None
        """(tokenizer, the long lane's copy of it); touched only on the long lane's thread."""

    async def run(self, tokenizer: Any, fn: Callable[[Any], T], size: int = 0) -> T:
        """``fn(tokenizer)`` on the lane for a text of ``size`` characters; its result."""
        loop = asyncio.get_running_loop()
        if size <= self.long_text_chars or tokenizer is None:
            return await loop.run_in_executor(self._short, fn, tokenizer)
        return await loop.run_in_executor(self._long, lambda: fn(self._long_copy(tokenizer)))

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the short lane (work that is not sized by one text, e.g. a chat split)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._short, lambda: fn(*args))

    def _long_copy(self, tokenizer: Any) -> Any:
        if self._long_copy_of is None or self._long_copy_of[0] is not tokenizer:
            self._long_copy_of = (tokenizer, copy.deepcopy(tokenizer))
        return self._long_copy_of[1]

    def shutdown(self) -> None:
        """Stop both threads (work already queued finishes)."""
        self._short.shutdown(wait=False, cancel_futures=True)
        self._long.shutdown(wait=False, cancel_futures=True)
