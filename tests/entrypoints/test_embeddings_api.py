"""The ``/v1/embeddings`` handler over a scripted engine client: input order, encodings, the
Matryoshka cut and renormalisation, and the 400s (no tokenizer, the wrong kind of model).

(The live server and the official client against ``transformers``' vectors are in
tests/e2e/test_embeddings_serve.py.)"""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
from fastapi.testclient import TestClient

from fastdeploy.config import ModelConfig, ServerConfig
from fastdeploy.core.outputs import RequestOutput
from fastdeploy.entrypoints.openai.api_server import build_app
from fastdeploy.transformers_utils.pooling import PoolerConfig


def scripted_engine(pooler: PoolerConfig | None, tokenizer=None) -> SimpleNamespace:
    """An engine whose vector for ids ``[a, b, ...]`` is ``[a, b, 0, 0]`` (hidden size 4)."""
    seen = []

    async def generate(prompt_token_ids, sampling_params, request_id, prompt=None, pooling_params=None):
        seen.append(pooling_params)
        vector = [float(t) for t in prompt_token_ids[:4]] + [0.0] * (4 - min(4, len(prompt_token_ids)))
        yield RequestOutput(request_id, prompt, prompt_token_ids, [], finished=True, embedding=vector)

    async def abort(request_id):
        pass

    return SimpleNamespace(
        is_healthy=True,
        max_model_len=8,
        vocab_size=100,
        tokenizer=tokenizer,
        pooler=pooler,
        arch=SimpleNamespace(hidden_size=4),
        source=SimpleNamespace(path="/models/e"),
        config=SimpleNamespace(model=ModelConfig()),
        generate=generate,
        abort=abort,
        seen=seen,
    )


def post(engine, body):
    with TestClient(build_app(engine, ["e"], ServerConfig())) as client:
        return client.post("/v1/embeddings", json=body)


def test_vectors_in_input_order_with_usage():
    engine = scripted_engine(PoolerConfig("mean", normalize=False))
    body = post(engine, {"input": [[3, 4], [5], [6, 7, 8]], "encoding_format": "float"}).json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["embedding"] for d in body["data"]] == [[3, 4, 0, 0], [5, 0, 0, 0], [6, 7, 8, 0]]
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    assert {p.pooling_type for p in engine.seen} == {"mean"}  # the model's pooling goes with every input


def test_base64_is_float32_little_endian():
    body = post(scripted_engine(PoolerConfig()), {"input": [3, 4], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == [3, 4, 0, 0]


def test_dimensions_cut_then_renormalise():
    engine = scripted_engine(PoolerConfig(normalize=True, is_matryoshka=True))
    body = post(engine, {"input": [3, 4, 5], "dimensions": 2, "encoding_format": "float"}).json()
    np.testing.assert_allclose(body["data"][0]["embedding"], [0.6, 0.8], rtol=1e-6)
    raw = scripted_engine(PoolerConfig(normalize=False, is_matryoshka=True))
    body = post(raw, {"input": [3, 4, 5], "dimensions": 2, "encoding_format": "float"}).json()
    assert body["data"][0]["embedding"] == [3, 4]  # not normalised by the model: only cut
    error = post(engine, {"input": [3], "dimensions": 5}).json()["error"]
    assert error["param"] == "dimensions" and "from 1 to" in error["message"]


def test_refusals():
    no_tokenizer = post(scripted_engine(PoolerConfig()), {"input": "text"})
    assert no_tokenizer.status_code == 400 and no_tokenizer.json()["error"]["param"] == "input"
    generation = post(scripted_engine(None), {"input": [1, 2]})
    assert generation.status_code == 400 and generation.json()["error"]["code"] == "model_not_supported"
    too_long = post(scripted_engine(PoolerConfig()), {"input": list(range(1, 10))})
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    with TestClient(build_app(scripted_engine(PoolerConfig()), ["e"], ServerConfig())) as client:
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_not_supported"
