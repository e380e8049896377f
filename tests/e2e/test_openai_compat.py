"""Compatibility with what OpenAI clients expect, found by vLLM's and SGLang's server suites (issue 20):
one choice per stream chunk, ``client.models.retrieve``, legacy ``logprobs: 0``, OpenAI request fields
accepted, vLLM's extensions (``continuous_usage_stats``, ``continue_final_message``, chat ``echo``,
``return_token_ids``), no broken character at a ``max_tokens`` cut, and ``/v1/models`` ``root``.

All against the shared server with the official ``openai`` client (extensions go in ``extra_body``).
"""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 6}
FULL_LENGTH = {"ignore_eos": True}
"""extra_body making a greedy answer exactly ``max_tokens`` long."""
EMOJI_START = 15107
"""The default model's token " ðŁ": a space and the first two bytes of a four-byte emoji (" 🦊" starts with it)."""


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer, to render chat templates the way ``transformers`` does."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

    config = ModelConfig()
    return load_tokenizer(config, resolve_model(config))


def wait_for_log(server, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} not in the server log:\n{server.log()}"
        time.sleep(0.1)


# ---- one choice per chunk -------------------------------------------------------------------


def test_completion_stream_sends_one_choice_per_chunk(client, model_name):
    for prompt, n in ((PROMPT, 3), ([PROMPT, "Hello, my name is"], 2)):
        stream = client.completions.create(
            model=model_name, prompt=prompt, n=n, max_tokens=6, temperature=1.0, seed=1, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        assert [len(c.choices) for c in chunks[:-1]] == [1] * (len(chunks) - 1)
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        num_choices = n * (len(prompt) if isinstance(prompt, list) else 1)
        finished = {c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason is not None}
        assert finished == set(range(num_choices))


def test_chat_stream_sends_one_choice_per_chunk(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=CHAT, n=3, max_tokens=6, temperature=1.0, seed=1, stream=True
    )
    chunks = list(stream)
    assert all(len(c.choices) == 1 for c in chunks)
    texts: dict[int, str] = {}
    for c in chunks:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + (c.choices[0].delta.content or "")
    assert sorted(texts) == [0, 1, 2] and all(texts.values())


# ---- /v1/models ---------------------------------------------------------------------------------


def test_models_retrieve(server, client, model_name):
    card = client.models.retrieve(model_name)
    assert card.id == model_name and card.object == "model"
    listed = client.models.list().data[0]
    assert card.model_dump(exclude={"created"}) == listed.model_dump(exclude={"created"})
    assert card.root and card.max_model_len == server.max_model_len
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert "no-such-model" in info.value.message
    assert info.value.body["code"] == "model_not_found"
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.retrieve(model_name)


def test_models_root_is_the_model_path(client):
    """Without --model the shared server runs the embedded default model: root is its .gguf file."""
    from fastdeploy.model_executor.model_loader.default_model import default_model_path

    root = client.models.list().data[0].root
    assert root == default_model_path() and os.path.isfile(root)


# ---- logprobs: 0 ------------------------------------------------------------------------------


def test_completion_logprobs_zero_returns_the_sampled_tokens(client, model_name):
    lp = (
        client.completions.create(
            model=model_name, prompt=PROMPT, logprobs=0, extra_body=FULL_LENGTH, **GREEDY
        )
        .choices[0]
        .logprobs
    )
    assert len(lp.top_logprobs) == len(lp.tokens) == GREEDY["max_tokens"]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {token: pytest.approx(logprob)}


# ---- request fields -----------------------------------------------------------------------------


def test_openai_request_fields_are_accepted(server, client, model_name):
    expected = client.chat.completions.create(model=model_name, messages=CHAT, **GREEDY)
    response = client.chat.completions.create(
        model=model_name,
        messages=CHAT,
        parallel_tool_calls=True,
        metadata={"team": "search"},
        service_tier="flex",
        reasoning_effort="low",
        store=True,
        user="user-1",
        prediction={"type": "content", "content": "Paris"},
        modalities=["text"],
        web_search_options={},
        verbosity="low",
        prompt_cache_key="france",
        safety_identifier="hash-1",
        **GREEDY,
    )
    assert response.choices[0].message.content == expected.choices[0].message.content
    completion = client.completions.create(model=model_name, prompt=PROMPT, user="user-1", **GREEDY)
    assert completion.choices[0].text
    wait_for_log(server, "The request field 'store' is accepted but ignored")


# ---- extensions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats(client, model_name, endpoint):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "chat":
        stream = client.chat.completions.create(
            model=model_name, messages=CHAT, n=2, stream=True, stream_options=options, extra_body=FULL_LENGTH,
            **GREEDY,
        )  # fmt: skip
    else:
        stream = client.completions.create(
            model=model_name, prompt=PROMPT, n=2, stream=True, stream_options=options, extra_body=FULL_LENGTH,
            **GREEDY,
        )  # fmt: skip
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 2 * GREEDY["max_tokens"]
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    if endpoint == "chat":  # the role chunks come before any token (vLLM's test: strictly rising after)
        roles = [c for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
        assert len(roles) == 2 and all(c.usage.completion_tokens == 0 for c in roles)


def test_continue_final_message_with_echo(server, client, model_name, tokenizer):
    start = "The capital of France is"
    messages = [*CHAT, {"role": "assistant", "content": start}]
    extra = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    reply = client.chat.completions.create(model=model_name, messages=messages, extra_body=extra, **GREEDY)
    # the prompt is transformers' rendering with continue_final_message: it ends inside the message
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert rendered.endswith(start)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(ids)
    continuation = client.completions.create(model=model_name, prompt=ids, **GREEDY).choices[0].text
    assert reply.choices[0].message.content == start + continuation  # echo: the message it continues first

    stream = client.chat.completions.create(
        model=model_name, messages=messages, extra_body=extra, stream=True, **GREEDY
    )
    deltas = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert deltas[0] == start and "".join(deltas) == reply.choices[0].message.content

    # continue_final_message alone: no generation prompt (SGLang's reading); both set true: vLLM's 400
    alone = client.chat.completions.create(
        model=model_name,
        messages=messages,
        extra_body={"continue_final_message": True, "echo": True},
        **GREEDY,
    )
    assert alone.choices[0].message.content == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_name,
            messages=messages,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
            max_tokens=2,
        )
    assert info.value.body["param"] == "continue_final_message"


def test_add_generation_prompt_false_and_echo_of_a_new_answer(client, model_name, tokenizer):
    plain = client.chat.completions.create(model=model_name, messages=CHAT, **GREEDY)
    echoed = client.chat.completions.create(
        model=model_name, messages=CHAT, extra_body={"echo": True}, **GREEDY
    )
    assert echoed.choices[0].message.content == plain.choices[0].message.content  # nothing to continue
    bare = client.chat.completions.create(
        model=model_name, messages=CHAT, extra_body={"add_generation_prompt": False}, **GREEDY
    )
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    assert bare.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert bare.usage.prompt_tokens < plain.usage.prompt_tokens


def test_return_token_ids(server, client, model_name):
    extra = {"return_token_ids": True, **FULL_LENGTH}
    prompt_ids = server.tokenize(PROMPT)["tokens"]
    choice = client.completions.create(model=model_name, prompt=PROMPT, extra_body=extra, **GREEDY).choices[0]
    assert choice.prompt_token_ids == prompt_ids
    assert len(choice.token_ids) == GREEDY["max_tokens"]
    with server.http() as http:
        assert http.post("/detokenize", json={"tokens": choice.token_ids}).json()["prompt"] == choice.text

    chunks = list(
        client.completions.create(model=model_name, prompt=PROMPT, extra_body=extra, stream=True, **GREEDY)
    )
    assert chunks[0].choices[0].prompt_token_ids == prompt_ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])] == choice.token_ids

    reply = client.chat.completions.create(model=model_name, messages=CHAT, extra_body=extra, **GREEDY)
    assert reply.prompt_token_ids == server.tokenize(messages=CHAT)["tokens"]
    assert len(reply.choices[0].token_ids) == reply.usage.completion_tokens
    stream = client.chat.completions.create(
        model=model_name, messages=CHAT, extra_body=extra, stream=True, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].prompt_token_ids == reply.prompt_token_ids
    assert [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])] == reply.choices[
        0
    ].token_ids

    plain = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY).choices[0].model_dump()
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


# ---- no broken character at a max_tokens cut ----------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_max_tokens_cut_inside_a_character_sends_no_broken_character(client, model_name, stream):
    # the bias makes the model's one token " ðŁ", which is half a character
    args = {"model": model_name, "prompt": PROMPT, "max_tokens": 1, "logit_bias": {str(EMOJI_START): 100}}
    if stream:
        chunks = list(client.completions.create(**args, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(**args).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert finish == "length"
    assert text == " "  # the complete part (the space) is kept, the incomplete tail dropped

    reply = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=1, logit_bias={str(EMOJI_START): 100}
    )
    assert reply.choices[0].message.content == " "


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_token_is_a_chunk_even_without_text(client, model_name, chat):
    """A step whose token has no text (here the special token 0, left out of the text) is still a
    chunk, as vLLM sends it: clients such as ``vllm bench serve`` count and time tokens by chunks.
    A chat stream's role chunk comes with the first token, not before it."""
    args = {"model": model_name, "max_tokens": 4, "logit_bias": {"0": 100}, "extra_body": FULL_LENGTH}
    if chat:
        chunks = list(client.chat.completions.create(messages=CHAT, stream=True, **args))
        assert chunks[0].choices[0].delta.role == "assistant"
        chunks = chunks[1:]
        texts = [c.choices[0].delta.content for c in chunks]
    else:
        chunks = list(client.completions.create(prompt=PROMPT, stream=True, **args))
        texts = [c.choices[0].text for c in chunks]
    assert texts == [""] * 4
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, "length"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, client, model_name):
    """vLLM's ``truncate_prompt_tokens``: a prompt longer than the context is cut to its last N tokens
    (the answer is the answer to those N); -1 keeps the last ``max_model_len``; too many is a 400."""
    long = [504, 3458, 314, 4649, 325] * (server.max_model_len // 5 + 10)
    kept = long[-40:]
    cut = client.completions.create(
        model=model_name,
        prompt=long,
        extra_body={"truncate_prompt_tokens": 40, "return_token_ids": True},
        **GREEDY,
    )
    whole = client.completions.create(model=model_name, prompt=kept, **GREEDY)
    assert cut.usage.prompt_tokens == 40 and cut.choices[0].text == whole.choices[0].text
    assert cut.choices[0].prompt_token_ids == kept
    right = client.completions.create(  # vLLM's truncation_side: right keeps the first N
        model=model_name,
        prompt=long,
        extra_body={"truncate_prompt_tokens": 40, "truncation_side": "right", "return_token_ids": True},
        max_tokens=1,
    )
    assert right.choices[0].prompt_token_ids == long[:40]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=model_name, prompt=long, extra_body={"truncate_prompt_tokens": 4, "truncation_side": "up"}
        )
    assert info.value.body["param"] == "truncation_side"
    chat = client.chat.completions.create(
        model=model_name, messages=CHAT, extra_body={"truncate_prompt_tokens": 5}, **GREEDY
    )
    assert chat.usage.prompt_tokens == 5
    for value, param in (
        (server.max_model_len + 1, "truncate_prompt_tokens"),
        (0, "truncate_prompt_tokens"),
        (-1, "prompt"),
    ):
        with pytest.raises(openai.BadRequestError) as info:  # (-1: the whole context, no room left)
            client.completions.create(
                model=model_name, prompt=long, extra_body={"truncate_prompt_tokens": value}, **GREEDY
            )
        assert info.value.body["param"] == param, (value, info.value.body)


@pytest.mark.parametrize("chat", [False, True])
def test_return_tokens_as_token_ids(client, model_name, chat):
    """vLLM's ``return_tokens_as_token_ids``: every logprobs token is ``token_id:N``, N the sampled id."""
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    if chat:
        reply = client.chat.completions.create(
            model=model_name, messages=CHAT, logprobs=True, top_logprobs=2, extra_body=extra, **GREEDY
        )
        entries = reply.choices[0].logprobs.content
        tokens = [e.token for e in entries]
        tops = [t.token for e in entries for t in e.top_logprobs]
    else:
        reply = client.completions.create(
            model=model_name, prompt=PROMPT, logprobs=2, extra_body=extra, **GREEDY
        )
        tokens = reply.choices[0].logprobs.tokens
        tops = [t for entry in reply.choices[0].logprobs.top_logprobs for t in entry]
    assert tokens == [f"token_id:{t}" for t in reply.choices[0].token_ids]
    assert tops and all(t.startswith("token_id:") and t[9:].isdigit() for t in tops)


def test_ping_answers_like_health(server):
    for method in ("GET", "POST"):
        assert httpx.request(method, server.url + "/ping", timeout=10).status_code == 200  # no API key needed


def test_sglangs_paths_health_generate_and_v1_tokenize(server):
    """SGLang's launcher polls ``/health_generate`` (no key, as ``/health``); its tests call
    ``/v1/tokenize`` and ``/v1/detokenize`` and match ``non-negative`` in the 400 of a negative id."""
    assert httpx.get(server.url + "/health_generate", timeout=10).status_code == 200
    body = {"prompt": "Hello there"}
    plain = httpx.post(server.url + "/tokenize", json=body, headers=server.headers, timeout=30)
    aliased = httpx.post(server.url + "/v1/tokenize", json=body, headers=server.headers, timeout=30)
    assert aliased.status_code == 200 and aliased.json()["tokens"] == plain.json()["tokens"]
    text = httpx.post(
        server.url + "/v1/detokenize", json={"tokens": plain.json()["tokens"]}, headers=server.headers
    )
    assert text.status_code == 200 and text.json()["prompt"].endswith("Hello there")
    bad = httpx.post(
        server.url + "/v1/detokenize", json={"tokens": [1, -5]}, headers=server.headers, timeout=30
    )
    assert bad.status_code == 400 and "non-negative" in bad.json()["error"]["message"], bad.text
    assert (
        httpx.post(server.url + "/v1/tokenize", json=body, timeout=30).status_code == 401
    )  # the key applies


def test_x_request_id_names_the_answer(client, model_name):
    """A request's X-Request-Id names its answer (vLLM's ``chatcmpl-<id>``); two requests in flight
    under one header both run (the engine's ids stay unique)."""
    import concurrent.futures

    def chat(stream: bool):
        reply = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
            stream=stream, extra_headers={"X-Request-Id": "trace-7"},
        )  # fmt: skip
        if not stream:
            return reply.id, reply.choices[0].message.content
        chunks = list(reply)
        return chunks[0].id, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed, whole = pool.submit(chat, True), pool.submit(chat, False)
        (stream_id, stream_text), (whole_id, whole_text) = streamed.result(), whole.result()
    assert stream_id == whole_id == "chatcmpl-trace-7"
    assert stream_text == whole_text and whole_text
    completion = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=2, extra_headers={"X-Request-Id": "trace-8"}
    )
    assert completion.id == "cmpl-trace-8"


def test_matched_stop(client, model_name, tokenizer):
    """SGLang's ``matched_stop`` in non-streamed choices: the stop string or stop token id that
    ended the choice, the end-of-sequence token id when that did, null for a length finish."""
    free = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY)
    assert free.choices[0].finish_reason == "length" and free.choices[0].matched_stop is None
    word = free.choices[0].text.split()[0]
    cut = client.completions.create(model=model_name, prompt=PROMPT, stop=[word], **GREEDY)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].matched_stop == word
    first = (
        client.completions.create(
            model=model_name, prompt=PROMPT, extra_body={"return_token_ids": True}, **GREEDY
        )
        .choices[0]
        .token_ids[0]
    )
    by_id = client.completions.create(
        model=model_name, prompt=PROMPT, extra_body={"stop_token_ids": [first]}, **GREEDY
    )
    assert by_id.choices[0].matched_stop == first
    eos = tokenizer.eos_token_id
    ended = client.chat.completions.create(
        model=model_name, messages=CHAT, logit_bias={str(eos): 100}, **GREEDY
    )
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].matched_stop == eos


def test_sagemaker_invocations(server, client, model_name):
    """``POST /invocations`` (SageMaker's route, as vLLM serves it) answers a chat or completion
    body as its own endpoint does; a body that is neither is a 400."""
    chat_body = {"model": model_name, "messages": CHAT, **GREEDY}
    with server.http() as http:
        via = http.post("/invocations", json=chat_body).json()
        direct = http.post("/v1/chat/completions", json=chat_body).json()
        assert via["object"] == "chat.completion" and set(via) == set(direct)
        assert via["choices"][0]["message"] == direct["choices"][0]["message"]
        completion = http.post("/invocations", json={"model": model_name, "prompt": PROMPT, **GREEDY}).json()
        assert completion["object"] == "text_completion" and completion["choices"][0]["text"]
        bad = http.post("/invocations", json={"model": model_name})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_cache_salt_keeps_prefix_caches_apart(client, model_name):
    """vLLM's ``cache_salt``: a salted request reads cached prompt blocks only from requests with
    the same salt (a tenant cannot time another's prompts); an empty salt is a 400."""
    prompt = "Salted prompt. " * 12 + "The end"

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        reply = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same salt shares
    assert cached("tenant-b") == 0
    assert cached(None) == 0  # nor do unsalted requests see salted blocks
    assert cached(None) > 0
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=model_name, prompt=prompt, max_tokens=1, extra_body={"cache_salt": ""}
        )
    assert info.value.body["param"] == "cache_salt"


def test_context_length_errors_use_sglangs_words(server, client, model_name):
    """SGLang's test_request_length_validation.py: a prompt too long for the context (streamed or
    not) is a 400 saying it ``is longer than the model's context length``; a ``max_tokens`` or
    ``max_completion_tokens`` beyond it says ``Requested token count exceeds the model's maximum
    context`` (older SGLang) and ``max_completion_tokens is too large`` (newer)."""
    long_chat = [{"role": "user", "content": "hello " * (server.max_model_len + 100)}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model_name, messages=long_chat, temperature=0, stream=stream)
        assert "is longer than the model's context length" in str(info.value)
        assert "This model's maximum context length is" in str(info.value)
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=model_name,
                messages=[{"role": "user", "content": "hello "}],
                temperature=0,
                **{field: server.max_model_len + 200},
            )
        assert "Requested token count exceeds the model's maximum context" in str(info.value)
        assert "max_completion_tokens is too large" in str(info.value)


def test_no_stop_trim_keeps_the_stop_string(client, model_name):
    """SGLang's ``no_stop_trim``: the matched stop string stays in the text, as with vLLM's
    ``include_stop_str_in_output``."""
    free = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY).choices[0].text
    word = free.split()[1]
    trimmed = client.completions.create(model=model_name, prompt=PROMPT, stop=[word], **GREEDY).choices[0]
    kept = client.completions.create(
        model=model_name, prompt=PROMPT, stop=[word], extra_body={"no_stop_trim": True}, **GREEDY
    ).choices[0]
    assert trimmed.finish_reason == kept.finish_reason == "stop"
    assert kept.text == trimmed.text + word and kept.text.endswith(word)
