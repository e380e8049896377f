"""A second server, started as a ``vllm serve`` command line starts one (vLLM's own server tests
pass these flags), with async scheduling on: its greedy answers equal the default server's
(the overlapped runner across the worker process); underscores in flag names, ``--hf-overrides``,
``--max-logprobs -1`` (a request's -1 is the whole vocabulary), ``--enable-server-load-tracking``
(``GET /load``), ``--enable-tokenizer-info-endpoint`` (``GET /tokenizer_info``) and
``--enable-prompt-tokens-details``; and the default ``--max-logprobs`` bound (20) on the shared
server. (One server for all: each start costs the suite ~20 s.)"""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.e2e.conftest import RemoteServer

VOCAB = 49152  # SmolLM2's vocabulary (the default model)


@pytest.fixture(scope="module")
def flagged_server(tmp_path_factory):
    srv = RemoteServer(
        tmp_path_factory.mktemp("flagged") / "server.log",
        "--async-scheduling", "--max_num_seqs", "8", "--max-logprobs", "-1", "--enable-server-load-tracking",
        "--enable-prompt-tokens-details", "--hf-overrides", "{}", "--enable-tokenizer-info-endpoint",
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def test_minus_one_logprobs_are_the_whole_vocabulary(flagged_server):
    client = flagged_server.openai()
    name = flagged_server.model_name()
    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=-1,
    )
    top = chat.choices[0].logprobs.content[0].top_logprobs
    assert len(top) == VOCAB
    assert top[0].logprob == max(t.logprob for t in top) and all(t.logprob <= 0 for t in top)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0
    completion = client.completions.create(  # (token ids as keys: texts of tokens repeat)
        model=name, prompt="Hello", max_tokens=1, temperature=0, logprobs=-1,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert len(completion.choices[0].logprobs.top_logprobs[0]) == VOCAB


def test_load_counts_the_requests_in_flight(flagged_server):
    http = flagged_server.http()
    assert http.get("/load").json() == {"server_load": 0}
    client = flagged_server.openai()
    stream = client.completions.create(
        model=flagged_server.model_name(), prompt="Once upon a time", max_tokens=64, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)  # the request is being answered
    others = [threading.Thread(target=lambda: http.get("/health")) for _ in range(3)]  # (not counted)
    for t in others:
        t.start()
    assert http.get("/load").json() == {"server_load": 1}
    for t in others:
        t.join()
    for _ in chunks:
        pass
    deadline = time.monotonic() + 10  # (the server finishes the stream just after its last byte)
    while http.get("/load").json() != {"server_load": 0} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.get("/load").json() == {"server_load": 0}


def test_the_default_bound_is_20(server, model_name):
    client = server.openai()
    messages = [{"role": "user", "content": "Hi"}]
    ok = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=1, logprobs=True, top_logprobs=20
    )
    assert len(ok.choices[0].logprobs.content[0].top_logprobs) == 20
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=1, logprobs=True, top_logprobs=21
        )
    assert info.value.body["param"] == "top_logprobs" and "--max-logprobs" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=1, logprobs=-1)
    assert info.value.body["param"] == "logprobs"
    assert client.completions.create(model=model_name, prompt="Hi", max_tokens=1).choices[0].text is not None


def test_tokenizer_info(flagged_server, server):
    info = flagged_server.http().get("/tokenizer_info").json()
    assert info["tokenizer_class"] and isinstance(info["tokenizer_class"], str)
    assert (info["bos_token"], info["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert "{% for message in messages %}" in info["chat_template"]
    assert info["added_tokens_decoder"]["0"]["content"] == "<|endoftext|>"
    assert info["model_max_length"] >= flagged_server.max_model_len
    assert "name_or_path" not in info  # (where the server's files are is not the tokenizer's)
    assert server.http().get("/tokenizer_info").status_code == 404  # off by default


def test_async_scheduling_server_matches_the_default_server(server, flagged_server, model_name):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    overlapped = flagged_server
    for prompt in prompts:
        body = {"model": model_name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        plain = server.openai().completions.create(**body)
        overlap = overlapped.openai().completions.create(**body)
        assert overlap.choices[0].text == plain.choices[0].text
        assert overlap.choices[0].finish_reason == plain.choices[0].finish_reason
        assert overlap.usage.completion_tokens == plain.usage.completion_tokens
    body = {"model": model_name, "prompt": prompts[0], "max_tokens": 12, "temperature": 0}
    streamed = "".join(c.choices[0].text for c in overlapped.openai().completions.create(**body, stream=True))
    assert streamed == server.openai().completions.create(**body).choices[0].text
