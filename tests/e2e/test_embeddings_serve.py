"""``/v1/embeddings`` through a live ``fastdeploy serve`` and the official ``openai`` client.

Two tiny random embedding models saved with ``transformers`` (with the default model's
tokenizer): a bare ``Qwen3Model`` declaring Matryoshka dimensions (pooling runner by its
architecture: last token, normalised) and a ``LlamaModel`` packaged as sentence-transformers
with mean pooling and no Normalize module. The server's vectors must equal (cosine > 0.999)
``transformers``' pooled final hidden states, for batches of text and token-id inputs, float and
base64 encodings, with prompts longer than the step's token budget (chunked prefill) and sent
twice (prefix cache). Errors are 400s naming the field.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest

from tests.e2e.conftest import API_KEY, RemoteServer
from tests.embedding_models import cosine, reference_vectors, save_embedding_model

TEXTS = [
    "Hello, my name is",
    "The capital of France is Paris, and the capital of Germany is Berlin; " * 3,
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]
SERVE = ("--max-model-len", "256", "--max-num-batched-tokens", "32", "--block-size", "4")


@pytest.fixture(scope="module")
def last_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-embedding")
    reference = save_embedding_model(folder, "qwen3", config_extra={"matryoshka_dimensions": [16, 32]})
    server = RemoteServer(folder / "server.log", "--model", str(folder), *SERVE, api_key=API_KEY)
    try:
        yield server, reference
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mean_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-embedding")
    reference = save_embedding_model(
        folder, "llama", sentence_transformers="pooling_mode_mean_tokens", seed=3
    )
    server = RemoteServer(folder / "server.log", "--model", str(folder), *SERVE, api_key=API_KEY)
    try:
        yield server, reference
    finally:
        server.stop()


def token_ids(server: RemoteServer, text: str) -> list[int]:
    return server.tokenize(text)["tokens"]


def test_last_token_normalized_batch_equals_transformers(last_model):
    server, reference = last_model
    client = server.openai()
    prompts = [token_ids(server, t) for t in TEXTS]
    assert len(prompts[1]) > 32  # longer than one step's token budget: chunked prefill
    expected = reference_vectors(reference, prompts, "last", normalize=True)
    for _ in range(2):  # again: the prompts' blocks come from the prefix cache
        result = client.embeddings.create(model=server.model_name(), input=TEXTS, encoding_format="float")
        assert [d.index for d in result.data] == [0, 1, 2]
        for data, ref in zip(result.data, expected):
            assert len(data.embedding) == 64
            assert cosine(data.embedding, ref) > 0.999
            assert abs(np.linalg.norm(data.embedding) - 1) < 1e-5
        assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, prompts))
        assert result.object == "list" and result.model == server.model_name()
    # token ids (one list, and a list of lists) give the same vectors
    one = client.embeddings.create(model=server.model_name(), input=prompts[0], encoding_format="float")
    assert cosine(one.data[0].embedding, expected[0]) > 0.999
    many = client.embeddings.create(model=server.model_name(), input=prompts, encoding_format="float")
    for data, ref in zip(many.data, expected):
        assert cosine(data.embedding, ref) > 0.999


def test_base64_decodes_to_the_same_floats(last_model):
    server, _ = last_model
    client = server.openai()
    before = server.metrics()
    floats = client.embeddings.create(model=server.model_name(), input=TEXTS, encoding_format="float")
    # the openai client asks for base64 by default and decodes it
    default = client.embeddings.create(model=server.model_name(), input=TEXTS)
    with server.http() as http:
        raw = http.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}).json()
    for f, d, r in zip(floats.data, default.data, raw["data"]):
        decoded = np.frombuffer(base64.b64decode(r["embedding"]), dtype="<f4")
        # (separate requests: prefix-cache hits may change the last bits)
        np.testing.assert_allclose(decoded, np.asarray(f.embedding, dtype=np.float32), rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.asarray(d.embedding, dtype=np.float32), decoded, rtol=0, atol=1e-6)
    after = server.metrics()  # three requests of three inputs: prompt tokens and latencies counted
    assert (
        after["fastdeploy:prompt_tokens_total"] - before["fastdeploy:prompt_tokens_total"]
        == 3 * floats.usage.prompt_tokens
    )
    ttft = "fastdeploy:time_to_first_token_seconds_count"
    assert after[ttft] - before[ttft] == 9


def test_dimensions_of_a_matryoshka_model(last_model):
    server, reference = last_model
    client = server.openai()
    prompt = token_ids(server, TEXTS[0])
    full = reference_vectors(reference, [prompt], "last", normalize=True)[0]
    result = client.embeddings.create(
        model=server.model_name(), input=TEXTS[0], dimensions=32, encoding_format="float"
    )
    vector = result.data[0].embedding
    assert len(vector) == 32
    assert (
        cosine(vector, full[:32]) > 0.999 and abs(np.linalg.norm(vector) - 1) < 1e-5
    )  # cut, then renormalised
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=server.model_name(), input=TEXTS[0], dimensions=20)
    assert info.value.body["param"] == "dimensions" and "16, 32" in info.value.body["message"]


def test_mean_pooling_unnormalized_from_sentence_transformers_config(mean_model):
    server, reference = mean_model
    client = server.openai()
    prompts = [token_ids(server, t) for t in TEXTS]
    expected = reference_vectors(reference, prompts, "mean", normalize=False)
    for _ in range(2):  # mean pooling reads nothing from the prefix cache: every position is pooled
        result = client.embeddings.create(model=server.model_name(), input=TEXTS, encoding_format="float")
        for data, ref in zip(result.data, expected):
            assert cosine(data.embedding, ref) > 0.999
            np.testing.assert_allclose(data.embedding, ref.numpy(), rtol=1e-3, atol=1e-4)
    with pytest.raises(openai.BadRequestError) as info:  # no Matryoshka declared
        client.embeddings.create(model=server.model_name(), input="hi", dimensions=16)
    assert info.value.body["param"] == "dimensions"
    # vLLM's per-request normalize (it was dropped with a warning: the vectors came back as the model's)
    normed = client.embeddings.create(
        model=server.model_name(), input=TEXTS, encoding_format="float", extra_body={"normalize": True}
    )
    for data, ref in zip(normed.data, expected):
        np.testing.assert_allclose(data.embedding, (ref / ref.norm()).numpy(), rtol=1e-3, atol=1e-5)


def test_per_request_normalize_false_keeps_the_raw_vector(last_model):
    server, reference = last_model
    client = server.openai()
    raw = reference_vectors(reference, [token_ids(server, TEXTS[0])], "last", normalize=False)[0]
    result = client.embeddings.create(
        model=server.model_name(), input=TEXTS[0], encoding_format="float", extra_body={"normalize": False}
    )
    np.testing.assert_allclose(result.data[0].embedding, raw.numpy(), rtol=1e-3, atol=1e-4)
    assert abs(np.linalg.norm(result.data[0].embedding) - 1) > 1e-2  # not unit length


def test_concurrent_requests_batch_together(mean_model):
    server, reference = mean_model
    texts = [f"request number {i}: " + "word " * (3 * i) for i in range(8)]
    expected = reference_vectors(reference, [token_ids(server, t) for t in texts], "mean", normalize=False)

    async def run() -> list:
        client = server.async_openai()
        return await asyncio.gather(
            *(
                client.embeddings.create(model=server.model_name(), input=t, encoding_format="float")
                for t in texts
            )
        )

    for result, ref in zip(asyncio.run(run()), expected):
        assert cosine(result.data[0].embedding, ref) > 0.999


def test_bad_input_is_a_400_naming_the_field(last_model):
    server, _ = last_model
    with server.http() as http:
        cases = [
            ({"input": ""}, "input", None),
            ({"input": []}, "input", None),
            ({"input": [[1, 2], "text"]}, "input", None),
            ({"input": [-1]}, "input", None),
            ({"input": [10**6]}, "input", None),
            ({"input": [1] * 257}, "input", "context_length_exceeded"),
            ({"input": "hi", "encoding_format": "int8"}, "encoding_format", None),
            ({"input": "hi", "dimensions": 0}, "dimensions", None),
            ({}, "input", None),
            ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", None),
            ({"input": "hi", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens", None),
        ]
        for body, param, code in cases:
            error = server.check_error(http.post("/v1/embeddings", json=body), 400)
            assert error["param"] == param, (body, error)
            if code:
                assert error["code"] == code
        ids = list(range(1000, 1256))
        ok = http.post("/v1/embeddings", json={"input": ids, "user": "someone"})  # a full context fits
        assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64
        for keep, expected in [(-1, ids), (10, ids[-10:])]:  # the last N tokens, as vLLM
            body = {
                "input": list(range(900, 1000)) + ids,
                "truncate_prompt_tokens": keep,
                "encoding_format": "float",
            }
            cut = http.post("/v1/embeddings", json=body).json()
            alone = http.post("/v1/embeddings", json={"input": expected, "encoding_format": "float"}).json()
            assert cut["usage"]["prompt_tokens"] == len(expected)
            assert cosine(cut["data"][0]["embedding"], alone["data"][0]["embedding"]) > 0.999
        for path, body in [
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ]:
            error = server.check_error(http.post(path, json=body), 400)
            assert error["code"] == "model_not_supported" and "embeddings" in error["message"]


def test_generation_model_refuses_embeddings(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=server.model_name(), input="hello")
    assert info.value.body["code"] == "model_not_supported"
    assert "generation" in info.value.body["message"]
