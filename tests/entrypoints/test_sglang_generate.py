"""SGLang's ``/generate`` through the app over a scripted engine: what a careless or hostile body
gets (a 400 naming the problem, never a 500), and the request's shapes (the answers under a real
engine: tests/e2e/test_sglang_native.py)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fastdeploy.config import ServerConfig
from fastdeploy.entrypoints.openai.api_server import build_app
from tests.entrypoints.test_tool_calling import ScriptedEngine


@pytest.fixture
def client():
    with TestClient(build_app(ScriptedEngine(["Hello", " world"]), ["m"], ServerConfig())) as c:
        yield c


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"text": 5},
        {"input_ids": [[]]},
        {"input_ids": []},
        {"text": []},
        {"input_ids": [-1]},
        {"input_ids": [10**9]},
        {"text": "hi", "rid": 5},
        {"text": "hi", "sampling_params": [1, 2]},
        {"text": "hi", "sampling_params": {"temperature": "hot"}},
        {"text": "hi", "sampling_params": {"temperature": [1]}},
        {"text": "hi", "sampling_params": {"n": "2"}},
        {"text": "hi", "sampling_params": {"n": 0}},
        {"text": "hi", "sampling_params": {"n": 129}},  # (n of 10**6 once flooded the engine)
        {"text": "hi", "sampling_params": {"sampling_seed": 2**70}},  # (once a 500 from the IPC)
        {"text": "hi", "sampling_params": {"sampling_seed": 2**63}},
        {"text": "hi", "sampling_params": {"logit_bias": {" 1": 1.0}}},
        {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
        {"text": "hi", "sampling_params": {"stop": {"a": 1}}},
        {"text": "hi", "sampling_params": {"stop": [1]}},
        {"text": "hi", "sampling_params": {"stop_token_ids": ["x"]}},
        {"text": "hi", "sampling_params": {"logit_bias": [1]}},
        {"text": "hi", "sampling_params": {"json_schema": 5}},
        {"text": "hi", "sampling_params": {"regex": "(", "json_schema": "{}"}},
        {"text": "hi", "sampling_params": {"nope": 1}},
        {"text": ["a", "b"], "sampling_params": [{}]},
        {"text": ["a", "b"], "rid": ["only-one"]},
        {"text": "hi", "return_logprob": True, "logprob_start_len": 99},
        {"text": "hi", "top_logprobs_num": -1},
    ],
)
def test_bad_bodies_are_400(client, body):
    response = client.post("/generate", json=body)
    assert response.status_code == 400, (body, response.text)
    assert response.json()["error"]["message"]


@pytest.mark.parametrize("key", ["temperature", "repetition_penalty", "top_p", "presence_penalty"])
@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN"])
def test_non_finite_sampling_params_are_400(client, key, value):
    # (an infinite temperature or repetition_penalty once ran; the OpenAI routes refuse them too)
    body = f'{{"text": "hi", "sampling_params": {{"{key}": {value}}}}}'
    response = client.post("/generate", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, (body, response.text)
    assert response.json()["error"]["param"] == f"sampling_params.{key}"


@pytest.mark.parametrize("body", [[], "x", {"rid": [1]}, {"rid": {"a": 1}}])
def test_bad_abort_bodies_are_400(client, body):
    assert client.post("/abort_request", json=body).status_code == 400


def test_shapes(client):
    one = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}).json()
    assert one["text"] == "Hello world" and one["meta_info"]["finish_reason"]["type"] == "stop"
    batch = client.post("/generate", json={"input_ids": [[1, 2], [3]], "rid": "b"}).json()
    assert [a["meta_info"]["id"] for a in batch] == ["b_0", "b_1"]
    assert [a["meta_info"]["prompt_tokens"] for a in batch] == [2, 1]
    n = client.post("/generate", json={"text": "hi", "rid": "r", "sampling_params": {"n": 2}}).json()
    assert [a["meta_info"]["id"] for a in n] == ["r_0", "r_1"]
    assert client.post("/abort_request", json={"rid": "not-running"}).status_code == 200
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
