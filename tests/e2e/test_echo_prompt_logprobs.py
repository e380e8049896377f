"""``echo`` (completions) and ``prompt_logprobs`` (completions and chat) through the shared e2e server."""

from __future__ import annotations

import pytest

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def post(server, path: str, body: dict):
    with server.http() as client:
        return client.post(path, json=body)


def check_prompt_logprobs(prompt_logprobs: list, prompt_ids: list[int], k: int) -> None:
    """vLLM's format: aligned with the prompt, null first, token id (str) → {logprob, rank, decoded_token}."""
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for token, entry in zip(prompt_ids[1:], prompt_logprobs[1:]):
        own = entry[str(token)]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        ranks = sorted(e["rank"] for t, e in entry.items() if e["rank"] <= k)
        assert ranks == list(range(1, k + 1))
        assert len(entry) == k + (own["rank"] > k)


def test_echo_prepends_the_prompt(server):
    client, name = server.openai(), server.model_name()
    plain = client.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0)
    echoed = client.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens


def test_echo_with_logprobs_covers_prompt_and_completion(server):
    client = server.openai()
    resp = client.completions.create(
        model=server.model_name(), prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice, usage = resp.choices[0], resp.usage
    lp = choice.logprobs
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert "".join(lp.tokens) == choice.text and choice.text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    # the two most likely tokens and, always, the prompt token (OpenAI: up to logprobs + 1 entries)
    assert all(2 <= len(top) <= 3 and token in top for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_with_zero_max_tokens_returns_the_prompt(server):
    client, name = server.openai(), server.model_name()
    resp = client.completions.create(model=name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = resp.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 0 and len(choice.logprobs.tokens) == resp.usage.prompt_tokens
    ids = server.tokenize(PROMPT)["tokens"]
    by_ids = client.completions.create(model=name, prompt=ids, max_tokens=0, echo=True)
    assert by_ids.choices[0].text == PROMPT  # token-id prompts echo as their decoded text
    two = client.completions.create(model=name, prompt=[PROMPT, "Hi"], max_tokens=0, echo=True, n=2)
    assert [c.text for c in two.choices] == [PROMPT, PROMPT, "Hi", "Hi"] and two.usage.completion_tokens == 0


def test_a_prompt_filling_the_whole_context_can_be_scored(server):
    """``echo`` with ``max_tokens: 0`` (lm-evaluation-harness's loglikelihood, which fills the
    context up to the model's length) takes a prompt of exactly ``max_model_len`` tokens: nothing is
    generated, so it needs no room for an output token (as vLLM); one token more is a 400, and so is
    the same prompt when a token is to be generated."""
    filler = server.tokenize(" the" * 8)["tokens"][-1:]
    ids = (filler * server.max_model_len)[: server.max_model_len]
    client, name = server.openai(), server.model_name()
    resp = client.completions.create(model=name, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = resp.choices[0].logprobs
    assert resp.usage.prompt_tokens == server.max_model_len and resp.usage.completion_tokens == 0
    assert len(lp.token_logprobs) == server.max_model_len and all(v <= 0 for v in lp.token_logprobs[1:])
    for body in ({"prompt": ids + filler, "max_tokens": 0, "echo": True}, {"prompt": ids, "max_tokens": 1}):
        error = server.check_error(post(server, COMPLETIONS_PATH, {"model": name, **body}), 400)
        assert "context length" in error["message"], error


def test_streamed_echo_sends_the_prompt_first(server):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "stream": True}
    with (
        server.http() as client,
        client.stream("POST", COMPLETIONS_PATH, json={**body, "prompt_logprobs": 1}) as r,
    ):
        events = server.sse_events(r.iter_lines())
    chunks = [e["choices"][0] for e in events if e != "[DONE]" and e["choices"]]
    assert chunks[0]["text"].startswith(PROMPT)
    check_prompt_logprobs(chunks[0]["prompt_logprobs"], server.tokenize(PROMPT)["tokens"], 1)
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    whole = post(server, COMPLETIONS_PATH, {**body, "stream": False}).json()["choices"][0]["text"]
    assert "".join(c["text"] for c in chunks) == whole


def test_prompt_logprobs_in_completions_and_chat(server):
    client, name = server.openai(), server.model_name()
    resp = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    check_prompt_logprobs(resp.choices[0].prompt_logprobs, server.tokenize(PROMPT)["tokens"], 2)
    chat = client.chat.completions.create(
        model=name, messages=MESSAGES, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    chat_ids = server.tokenize(messages=MESSAGES)["tokens"]
    assert chat.usage.prompt_tokens == len(chat_ids)
    check_prompt_logprobs(chat.prompt_logprobs, chat_ids, 0)  # at the response level, as in vLLM
    body = {"messages": MESSAGES, "max_tokens": 2, "stream": True, "prompt_logprobs": 1}
    with server.http() as http, http.stream("POST", CHAT_PATH, json=body) as r:
        events = [e for e in server.sse_events(r.iter_lines()) if e != "[DONE]"]
    with_lps = [i for i, e in enumerate(events) if "prompt_logprobs" in e]
    assert len(with_lps) == 1 and not any(
        c["finish_reason"] for e in events[: with_lps[0]] for c in e["choices"]
    )
    check_prompt_logprobs(events[with_lps[0]]["prompt_logprobs"], chat_ids, 1)
    plain = post(server, COMPLETIONS_PATH, {"prompt": PROMPT, "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None  # present and null, as vLLM's clients read it
    assert (
        client.completions.create(model=name, prompt=PROMPT, max_tokens=1).choices[0].prompt_logprobs is None
    )
    assert client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=1).prompt_logprobs is None


@pytest.mark.parametrize(
    "path, fields, param",
    [
        (COMPLETIONS_PATH, {"prompt_logprobs": -1}, "prompt_logprobs"),
        (COMPLETIONS_PATH, {"prompt_logprobs": 21}, "prompt_logprobs"),
        (CHAT_PATH, {"prompt_logprobs": 1000}, "prompt_logprobs"),
        (CHAT_PATH, {"echo": "yes"}, "echo"),
        (COMPLETIONS_PATH, {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ],
)
def test_bad_values_are_400_naming_the_field(server, path, fields, param):
    body = {
        "max_tokens": 2,
        **fields,
        **({"messages": MESSAGES} if path == CHAT_PATH else {"prompt": PROMPT}),
    }
    error = server.check_error(post(server, path, body), 400)
    assert error["param"] == param, error
