"""Request-body helpers without a server: lone surrogates, error bodies that always encode, tokenizer lanes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from fastdeploy.entrypoints.openai.errors import BadRequestError, NotFoundError
from fastdeploy.entrypoints.openai.request_body import lone_surrogate_path
from fastdeploy.entrypoints.openai.tokenizer_lanes import TokenizerLanes


def test_lone_surrogate_path_names_the_field():
    body = json.loads(
        '{"model": "m", "messages": [{"role": "user", "content": "ok"}, {"content": "\\ud800"}]}'
    )
    assert lone_surrogate_path(body) == "messages[1].content"
    assert lone_surrogate_path(json.loads('{"stop": ["a", "\\udfff b"]}')) == "stop[1]"
    assert lone_surrogate_path(json.loads('{"logit_bias": {"\\ud800": 1}}')) == "logit_bias.\ud800"
    assert lone_surrogate_path(json.loads('"\\ud800"')) == "body"
    # a valid pair is one character, not a lone surrogate
    assert lone_surrogate_path(json.loads('{"prompt": "\\ud83d\\ude00 ok"}')) is None


def test_lone_surrogate_path_handles_deep_nesting_iteratively():
    value = "\ud800"
    for _ in range(50_000):
        value = [value]
    assert lone_surrogate_path(value) == "[0]" * 50_000


def test_error_bodies_always_encode():
    err = NotFoundError("The model `\ud800` does not exist.", param="model\udc00")
    encoded = json.dumps(err.body(), ensure_ascii=False).encode("utf-8")
    assert b"\\\\ud800" in encoded  # shown as an escape, not dropped
    assert BadRequestError("plain").message == "plain"


class _Tokenizer:
    """A stand-in tokenizer: one token, the length of the text."""

    def encode(self, text: str) -> list[int]:
        return [len(text)]


def test_a_long_text_does_not_hold_up_short_ones():
    lanes = TokenizerLanes(long_text_chars=10)
    tokenizer = _Tokenizer()
    release = threading.Event()

    def slow(tok: _Tokenizer) -> list[int]:
        release.wait(10)
        return tok.encode("x" * 100)

    async def scenario() -> tuple[float, list[int], list[int]]:
        long_job = asyncio.ensure_future(lanes.run(tokenizer, slow, size=100))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        short = await lanes.run(tokenizer, lambda tok: tok.encode("hi"), size=2)
        took = time.monotonic() - start
        release.set()
        return took, short, await long_job

    took, short, long_result = asyncio.run(scenario())
    assert short == [2] and long_result == [100]
    assert took < 5, "the short text waited for the long one"
    lanes.shutdown()


def test_long_lane_uses_its_own_tokenizer_copy():
    lanes = TokenizerLanes(long_text_chars=10)
    tokenizer = _Tokenizer()
    seen: list[object] = []

    async def scenario() -> None:
        await lanes.run(tokenizer, seen.append, size=1)
        await lanes.run(tokenizer, seen.append, size=100)
        await lanes.run(tokenizer, seen.append, size=100)

    asyncio.run(scenario())
    assert seen[0] is tokenizer
    assert seen[1] is not tokenizer and isinstance(seen[1], _Tokenizer)
    assert seen[2] is seen[1]  # copied once
    lanes.shutdown()


def test_texts_waiting_for_the_short_lane_are_encoded_in_one_batch():
    """A burst of short texts: the ones that wait while the lane is busy go in one batched call of
    the real tokenizer, with exactly the ids of one-at-a-time encoding, each to its own caller."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(ModelConfig(), resolve_model(ModelConfig()))
    batches: list[int] = []
    original_call = type(tokenizer).__call__

    class Counting(type(tokenizer)):  # counts the batched calls, changes nothing else
        def __call__(self, text, *args, **kwargs):
            if isinstance(text, list):
                batches.append(len(text))
            return original_call(self, text, *args, **kwargs)

    tokenizer.__class__ = Counting
    texts = [f"request {i}: {'word ' * (i % 7)}the end" for i in range(40)]
    lanes = TokenizerLanes()
    busy = threading.Event()

    async def scenario() -> list[list[int]]:
        blocker = asyncio.ensure_future(lanes.run(tokenizer, lambda tok: busy.wait(10), size=1))
        jobs = [
            asyncio.ensure_future(lanes.encode(tokenizer, t, add_special_tokens=i % 2 == 0))
            for i, t in enumerate(texts)
        ]
        await asyncio.sleep(0.05)
        busy.set()
        await blocker
        return await asyncio.gather(*jobs)

    try:
        got = asyncio.run(scenario())
    finally:
        lanes.shutdown()
    expected = [tokenizer.encode(t, add_special_tokens=i % 2 == 0) for i, t in enumerate(texts)]
    assert got == expected
    assert sorted(batches) == [20, 20]  # one batch per add_special_tokens flag


def test_a_failing_text_fails_alone_and_a_lone_text_is_encoded_at_once():
    class Picky(_Tokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            if text == "bad":
                raise ValueError("cannot encode this")
            return super().encode(text)

    lanes = TokenizerLanes()

    async def scenario():
        good, bad = lanes.encode(Picky(), "good", True), lanes.encode(Picky(), "bad", True)
        return await asyncio.gather(good, bad, return_exceptions=True)

    try:
        good, bad = asyncio.run(scenario())
        assert good == [4] and isinstance(bad, ValueError)
        assert asyncio.run(lanes.encode(Picky(), "x" * 30, True)) == [30]
    finally:
        lanes.shutdown()
