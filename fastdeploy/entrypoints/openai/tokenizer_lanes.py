"""Where the API server's tokenizer work runs: off the event loop, and long texts apart from short ones.

Tokenizing takes time in proportion to the text (about half a second per
million characters), and one thread serves the requests in order, so a single
huge prompt would hold up every small one behind it. Two lanes keep them
apart: texts up to :data:`LONG_TEXT_CHARS` run on one thread, longer ones on a
second thread with its own copy of the tokenizer (a Rust tokenizer is never
used from two threads at once). How long a text may be at all is bounded by
the caller (see ``OpenAIServing.check_text_length``), so the long lane's work
per request is bounded too.

Short texts that wait for the short lane are encoded together (:meth:`TokenizerLanes.encode`):
a burst of requests is one batched call, which a Rust tokenizer spreads over its threads (256
prompts of 512 tokens: 297 → 146 ms on 2 cores), where one text at a time made the last
request of a burst of 256 wait a third of a second on the GPU host before reaching the engine
(docs/benchmarks.md). A lone text is encoded at once, as before.
"""

from __future__ import annotations

import asyncio
import copy
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")

LONG_TEXT_CHARS = 32_768
"""Texts longer than this (in characters) are tokenized on the long lane."""


class _WaitingText(NamedTuple):
    """A short text waiting for the short lane, and where its ids go."""

    tokenizer: Any
    text: str
    add_special_tokens: bool
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class TokenizerLanes:
    """Two tokenizer threads: one for short texts, one (with a private tokenizer copy) for long ones."""

    def __init__(self, long_text_chars: int = LONG_TEXT_CHARS):
        self.long_text_chars = long_text_chars
        self._short = ThreadPoolExecutor(1, thread_name_prefix="fd-tokenizer")
        self._long = ThreadPoolExecutor(1, thread_name_prefix="fd-tokenizer-long")
        self._long_copy_of: tuple[Any, Any] | None = None
        """(tokenizer, the long lane's copy of it); touched only on the long lane's thread."""
        self._to_encode: deque[_WaitingText] = deque()
        """Short texts waiting for the short lane (appended by the event loop, taken by the lane)."""

    async def encode(self, tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids of ``text``. A short text joins the others waiting for the short lane, and
        whichever job of theirs runs first encodes them all in one batched call per tokenizer and
        flag (the same ids as one at a time); a long one runs alone on the long lane."""
        if len(text) > self.long_text_chars:
            return list(
                await self.run(
                    tokenizer, lambda tok: tok.encode(text, add_special_tokens=add_special_tokens), len(text)
                )
            )
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._to_encode.append(_WaitingText(tokenizer, text, add_special_tokens, future, loop))
        loop.run_in_executor(self._short, self._encode_waiting)
        return await future

    def _encode_waiting(self) -> None:
        """On the short lane: encode every text waiting (none left: an earlier job took them)."""
        waiting: list[_WaitingText] = []
        while self._to_encode:
            waiting.append(self._to_encode.popleft())
        groups: dict[tuple[int, bool], list[_WaitingText]] = {}
        for item in waiting:
            groups.setdefault((id(item.tokenizer), item.add_special_tokens), []).append(item)
        for items in groups.values():
            for item, result in zip(items, _encode_each(items)):
                try:
                    item.loop.call_soon_threadsafe(_settle, item.future, result)
                except RuntimeError:  # the loop is closed (shutting down): nobody waits
                    pass

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


def _encode_each(items: list[_WaitingText]) -> list[list[int] | BaseException]:
    """The ids of each text (one tokenizer, one flag): one batched call, or, when that fails, each
    text alone, a failing one getting its own error (never raised: every waiter gets an answer)."""
    tokenizer, flag = items[0].tokenizer, items[0].add_special_tokens
    try:
        return _encode_batch(tokenizer, [item.text for item in items], flag)
    except Exception:
        results: list[list[int] | BaseException] = []
        for item in items:
            try:
                results.append(list(tokenizer.encode(item.text, add_special_tokens=flag)))
            except Exception as exc:
                results.append(exc)
        return results


def _encode_batch(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """``tokenizer.encode`` of each text, in one call where the tokenizer takes a batch."""
    if len(texts) > 1 and _takes_batches(tokenizer):
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]
    return [list(tokenizer.encode(text, add_special_tokens=add_special_tokens)) for text in texts]


def _takes_batches(tokenizer: Any) -> bool:
    """Whether ``tokenizer(texts)`` encodes a list of texts as ``encode`` does each (``transformers``'
    tokenizers; a fast one runs the batch on its Rust threads)."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is how tokenizers are loaded
        return False
    return isinstance(tokenizer, PreTrainedTokenizerBase)


def _settle(future: asyncio.Future, result: list[int] | BaseException) -> None:
    """Give a waiting ``encode`` its ids or its error (unless it was cancelled meanwhile)."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
