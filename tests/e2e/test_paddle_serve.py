"""``fastdeploy serve --backend paddle``: the openai client, streaming and not, on PaddlePaddle.

Runs where PaddlePaddle is installed (the Paddle CI job, without torch); skipped elsewhere.
The greedy answers equal the torch backend's (``tests/engine/backend_reference_tokens.json``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("paddle") is None, reason="PaddlePaddle is not installed"
)

REFERENCE = json.loads((Path(__file__).parents[1] / "engine" / "backend_reference_tokens.json").read_text())


@pytest.fixture(scope="module")
def paddle_server(tmp_path_factory):
    from conftest import RemoteServer

    srv = RemoteServer(tmp_path_factory.mktemp("paddle") / "server.log", "--backend", "paddle")
    yield srv
    srv.stop()


def test_version_and_log_name_the_backend(paddle_server):
    body = httpx.get(paddle_server.url + "/version").json()
    assert body["backend"] == "paddle" and body["backend_version"].startswith("3.")
    assert "tensor backend: paddle" in paddle_server.log()


def test_openai_client_streaming_and_not(paddle_server):
    client = paddle_server.openai()
    model = client.models.list().data[0].id
    max_tokens = REFERENCE["max_tokens"]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0
    )
    assert chat.choices[0].message.content == REFERENCE["chat_text"]
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == REFERENCE["chat_text"]
    completion = client.completions.create(
        model=model, prompt=REFERENCE["prompt_texts"][1], max_tokens=max_tokens, temperature=0
    )
    assert completion.usage.completion_tokens == max_tokens and completion.choices[0].text.strip()
