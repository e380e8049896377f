"""Sampling and output controls through the HTTP API (the shared e2e server)."""

from __future__ import annotations

import pytest

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def post(server, path: str, body: dict):
    with server.http() as client:
        return client.post(path, json=body)


@pytest.mark.parametrize(
    "path, fields, param",
    [
        (CHAT_PATH, {"presence_penalty": 2.5}, "presence_penalty"),
        (CHAT_PATH, {"frequency_penalty": -2.1}, "frequency_penalty"),
        (COMPLETIONS_PATH, {"repetition_penalty": 0}, "repetition_penalty"),
        (CHAT_PATH, {"logit_bias": {"5": 150}}, "logit_bias"),
        (CHAT_PATH, {"logit_bias": {"999999999": 1}}, "logit_bias"),
        (CHAT_PATH, {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        (CHAT_PATH, {"top_logprobs": 2}, "top_logprobs"),
        (COMPLETIONS_PATH, {"logprobs": 21}, "logprobs"),
        (COMPLETIONS_PATH, {"min_tokens": -1}, "min_tokens"),
        (COMPLETIONS_PATH, {"top_k": -2}, "top_k"),
        (COMPLETIONS_PATH, {"min_p": 1.5}, "min_p"),
        (COMPLETIONS_PATH, {"bad_words": [""]}, "bad_words"),
    ],
)
def test_out_of_range_fields_are_400_naming_the_field(server, path, fields, param):
    body = {
        "max_tokens": 2,
        **fields,
        **({"messages": MESSAGES} if path == CHAT_PATH else {"prompt": PROMPT}),
    }
    error = server.check_error(post(server, path, body), 400)
    assert error["param"] == param, error


def test_chat_logprobs_openai_format(server):
    client = server.openai()
    resp = client.chat.completions.create(
        model=server.model_name(),
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(c.token for c in content) == choice.message.content
    for c in content:
        assert c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 3
        lps = [t.logprob for t in c.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)


def test_chat_logprobs_streamed(server):
    client = server.openai()
    stream = client.chat.completions.create(
        model=server.model_name(),
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        stream=True,
    )
    tokens, text = [], ""
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                tokens += [c.token for c in choice.logprobs.content]
    assert len(tokens) == 5 and "".join(tokens) == text


def test_completion_logprobs_legacy_format(server):
    client = server.openai()
    resp = client.completions.create(
        model=server.model_name(), prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0
    for i, (token, top) in enumerate(zip(lp.tokens, lp.top_logprobs)):
        assert len(top) == 2 and top[token] == pytest.approx(lp.token_logprobs[i])
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])


def test_no_logprobs_unless_asked(server):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert post(server, COMPLETIONS_PATH, body).json()["choices"][0]["logprobs"] is None


def test_penalties_bias_and_bad_words_change_the_output(server):
    client = server.openai()
    name = server.model_name()
    base = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert "Paris" in base
    banned = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"bad_words": ["Paris"]}
    )
    assert "Paris" not in banned.choices[0].text
    token = server.tokenize(" London", add_special_tokens=False)["tokens"][0]
    biased = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(token): 100}
    )
    assert biased.choices[0].text == " London"
    penalised = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=8, temperature=0, presence_penalty=2.0, frequency_penalty=2.0
    )
    assert penalised.choices[0].finish_reason in ("stop", "length")


def test_seeded_sampling_is_reproducible(server):
    client = server.openai()
    kwargs = dict(model=server.model_name(), prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, top_p=0.9)
    assert (
        client.completions.create(**kwargs).choices[0].text
        == client.completions.create(**kwargs).choices[0].text
    )
