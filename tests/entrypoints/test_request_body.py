"""Request-body helpers without a server: lone surrogates, error bodies that always encode, tokenizer lanes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from fastdeploy.config import ServerConfig
from fastdeploy.entrypoints.openai.api_server import build_app
from fastdeploy.entrypoints.openai.errors import BadRequestError, NotFoundError
from fastdeploy.entrypoints.openai.request_body import MAX_JSON_DEPTH, json_depth, lone_surrogate_path
from fastdeploy.entrypoints.openai.serving_engine import _text_chars
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


def test_json_depth_is_iterative():
    assert json_depth(1) == 0 and json_depth([]) == 1 and json_depth({"a": [{"b": 1}]}) == 3
    value: object = 1
    for _ in range(50_000):
        value = {"a": [value]}
    assert json_depth(value) == 100_000
    assert _text_chars(value) == 0  # (counting a chat's characters recursed: a 500 past ~500 levels)
    assert _text_chars([{"a": "xy", "b": ["z", {"c": "w"}]}, 5]) == 4


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    "path, body",
    [
        # a body the decoder takes but the code after it (dataclasses.asdict of the engine
        # request, the response store) recursed too deep on: once a 500
        ("/v1/completions", '{"prompt": "hi", "structured_outputs": {"json": {"x": %s}}}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "x": %s}]}'),
        ("/v1/responses", '{"input": [{"role": "user", "content": "hi", "x": %s}]}'),
        ("/generate", '{"text": "hi", "sampling_params": {"json_schema": {"x": %s}}}'),
    ],
)
def test_bodies_nested_too_deep_are_400(path, body):
    from tests.entrypoints.test_tool_calling import ScriptedEngine

    with TestClient(build_app(ScriptedEngine(["ok"]), ["m"], ServerConfig())) as client:
        headers = {"Content-Type": "application/json"}
        response = client.post(path, content=body % _nested(900), headers=headers)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_json" and "nested too deeply" in error["message"]
        # an integer past Python's 4300-digit limit is invalid JSON too (it was a 500)
        response = client.post(path, content=body % ("9" * 5000), headers=headers)
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
        # a depth within the limit is left to the route
        response = client.post(path, content=body % _nested(MAX_JSON_DEPTH - 10), headers=headers)
        assert (response.json().get("error") or {}).get("code") != "invalid_json", response.text


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
