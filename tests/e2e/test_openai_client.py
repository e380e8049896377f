"""The official ``openai`` client, sync and async, against a live ``fastdeploy serve``.

Greedy (temperature 0) requests make outputs comparable: a streamed answer must
equal the non-streamed one, and ``n=2`` greedy choices must both equal it.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

import fastdeploy

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 16
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}


def completion_text(client: openai.OpenAI, model: str, **kwargs) -> str:
    response = client.completions.create(model=model, prompt=PROMPT, **{**GREEDY, **kwargs})
    return response.choices[0].text


def collect_completion_stream(stream) -> tuple[dict[int, str], dict[int, str | None], list]:
    """Texts and finish reasons by choice index, plus the usage chunks, of a completions stream."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage_chunks = []
    for chunk in stream:
        if chunk.usage is not None:
            usage_chunks.append(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage_chunks


# ---- completions -------------------------------------------------------------------------


def test_completion_non_streaming(server, model_name):
    client = server.openai()
    response = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY)
    assert response.object == "text_completion"
    assert response.model == model_name
    assert len(response.choices) == 1
    choice = response.choices[0]
    assert choice.index == 0
    assert choice.text.strip()
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens == server.tokenize(PROMPT)["count"]
    assert 0 < usage.completion_tokens <= MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if choice.finish_reason == "length":
        assert usage.completion_tokens == MAX_TOKENS


def test_completion_stream_equals_non_stream_with_usage(server, model_name):
    client = server.openai()
    expected = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY)
    stream = client.completions.create(
        model=model_name, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    texts, finish, usage_chunks = collect_completion_stream(stream)
    assert texts == {0: expected.choices[0].text}
    assert finish == {0: expected.choices[0].finish_reason}
    # exactly one usage chunk: the last one, with no choices and the same counts
    assert len(usage_chunks) == 1
    assert usage_chunks[0].choices == []
    assert usage_chunks[0].usage.prompt_tokens == expected.usage.prompt_tokens
    assert usage_chunks[0].usage.completion_tokens == expected.usage.completion_tokens
    assert usage_chunks[0].usage.total_tokens == expected.usage.total_tokens


def test_completion_stream_without_include_usage_has_no_usage(server, model_name):
    stream = server.openai().completions.create(model=model_name, prompt=PROMPT, stream=True, **GREEDY)
    texts, _, usage_chunks = collect_completion_stream(stream)
    assert texts[0]
    assert usage_chunks == []


def test_completion_stream_ends_with_done(server, model_name):
    body = {"model": model_name, "prompt": PROMPT, "stream": True, **GREEDY}
    with server.http() as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = server.sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    assert all(isinstance(e, dict) and e["object"] == "text_completion" for e in events[:-1])


def test_completion_n2(server, model_name):
    client = server.openai()
    greedy = completion_text(client, model_name)
    response = client.completions.create(model=model_name, prompt=PROMPT, n=2, **GREEDY)
    assert sorted(c.index for c in response.choices) == [0, 1]
    # greedy choices are all the greedy answer
    assert [c.text for c in response.choices] == [greedy, greedy]
    single = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY).usage
    assert response.usage.prompt_tokens == single.prompt_tokens
    assert response.usage.completion_tokens == 2 * single.completion_tokens

    # sampled: two choices, each its own text, streamed with both indices
    stream = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        n=2,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finish, usage_chunks = collect_completion_stream(stream)
    assert sorted(texts) == [0, 1]
    assert sorted(finish) == [0, 1]
    assert len(usage_chunks) == 1 and usage_chunks[0].usage.completion_tokens > 0


def test_completion_several_prompts(server, model_name):
    client = server.openai()
    other = "The largest planet in the solar system is"
    response = client.completions.create(model=model_name, prompt=[PROMPT, other], **GREEDY)
    assert [c.index for c in sorted(response.choices, key=lambda c: c.index)] == [0, 1]
    by_index = {c.index: c.text for c in response.choices}
    assert by_index[0] == completion_text(client, model_name)
    assert by_index[1] == client.completions.create(model=model_name, prompt=other, **GREEDY).choices[0].text


# ---- chat ----------------------------------------------------------------------------------


def collect_chat_stream(stream) -> tuple[dict[int, str], dict[int, str | None], list, list]:
    """Texts, finish reasons, usage chunks and roles seen, of a chat stream."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage_chunks, roles = [], []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage_chunks.append(chunk)
        for c in chunk.choices:
            if c.delta.role:
                roles.append((c.index, c.delta.role))
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage_chunks, roles


def test_chat_non_streaming(server, model_name):
    response = server.openai().chat.completions.create(model=model_name, messages=CHAT, **GREEDY)
    assert response.object == "chat.completion"
    assert response.model == model_name
    message = response.choices[0].message
    assert message.role == "assistant"
    assert message.content.strip()
    assert response.choices[0].finish_reason in ("stop", "length")
    # the prompt is the chat template's rendering of the messages
    assert response.usage.prompt_tokens == server.tokenize(messages=CHAT)["count"]
    assert 0 < response.usage.completion_tokens <= MAX_TOKENS


def test_chat_stream_equals_non_stream_with_usage(server, model_name):
    client = server.openai()
    expected = client.chat.completions.create(model=model_name, messages=CHAT, **GREEDY)
    stream = client.chat.completions.create(
        model=model_name, messages=CHAT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    texts, finish, usage_chunks, roles = collect_chat_stream(stream)
    assert roles == [(0, "assistant")]
    assert texts == {0: expected.choices[0].message.content}
    assert finish == {0: expected.choices[0].finish_reason}
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    assert usage_chunks[0].usage.prompt_tokens == expected.usage.prompt_tokens
    assert usage_chunks[0].usage.completion_tokens == expected.usage.completion_tokens


def test_chat_n2_streaming(server, model_name):
    client = server.openai()
    expected = client.chat.completions.create(model=model_name, messages=CHAT, **GREEDY)
    stream = client.chat.completions.create(
        model=model_name, messages=CHAT, n=2, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    texts, finish, usage_chunks, roles = collect_chat_stream(stream)
    assert sorted(roles) == [(0, "assistant"), (1, "assistant")]
    assert texts == {0: expected.choices[0].message.content, 1: expected.choices[0].message.content}
    assert sorted(finish) == [0, 1]
    assert usage_chunks[0].usage.completion_tokens == 2 * expected.usage.completion_tokens

    response = client.chat.completions.create(model=model_name, messages=CHAT, n=2, **GREEDY)
    assert [c.message.content for c in response.choices] == [expected.choices[0].message.content] * 2


def test_async_client(server, model_name):
    """AsyncOpenAI: chat and completions, streaming and not, all consistent with each other."""

    async def run() -> None:
        client = server.async_openai()
        try:
            chat = await client.chat.completions.create(model=model_name, messages=CHAT, **GREEDY)
            stream = await client.chat.completions.create(
                model=model_name, messages=CHAT, stream=True, stream_options={"include_usage": True}, **GREEDY
            )
            parts, usage = [], None
            async for chunk in stream:
                usage = chunk.usage or usage
                parts += [c.delta.content or "" for c in chunk.choices]
            assert "".join(parts) == chat.choices[0].message.content
            assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens

            completion = await client.completions.create(model=model_name, prompt=PROMPT, **GREEDY)
            stream = await client.completions.create(model=model_name, prompt=PROMPT, stream=True, **GREEDY)
            text = "".join([c.text async for chunk in stream for c in chunk.choices])
            assert text == completion.choices[0].text

            models = await client.models.list()
            assert model_name in [m.id for m in models.data]
        finally:
            await client.close()

    asyncio.run(run())


# ---- stop strings --------------------------------------------------------------------------


def multi_token_stop_string(server, text: str) -> tuple[int, str]:
    """A stop string taken from the middle of ``text`` (first occurring there) that is several tokens long."""
    for start in range(len(text) // 3, len(text) - 10):
        for length in (12, 10, 8):
            stop = text[start : start + length]
            if (
                len(stop) == length
                and text.find(stop) == start
                and stop.strip()
                and server.tokenize(stop, add_special_tokens=False)["count"] >= 3
            ):
                return start, stop
    pytest.fail(f"no multi-token stop string found in {text!r}")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_stop_string_spanning_tokens_never_leaks(server, model_name, stream):
    client = server.openai()
    args = {"model": model_name, "prompt": PROMPT, "temperature": 0, "max_tokens": 32}
    full = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    start, stop = multi_token_stop_string(server, full)
    expected = full[:start]
    stops = ["never appears in the output \u2603", stop]

    if stream:
        chunks, finish, stop_reason = [], None, None
        for chunk in client.completions.create(
            **args, stop=stops, stream=True, extra_body={"ignore_eos": True}
        ):
            for c in chunk.choices:
                chunks.append(c.text)
                finish = c.finish_reason or finish
                stop_reason = getattr(c, "stop_reason", None) or stop_reason
        text = "".join(chunks)
        # no chunk ever carried text beyond the stop point (nothing leaked, then taken back)
        assert all(expected.startswith("".join(chunks[: i + 1])) for i in range(len(chunks)))
    else:
        choice = client.completions.create(**args, stop=stops, extra_body={"ignore_eos": True}).choices[0]
        text, finish, stop_reason = choice.text, choice.finish_reason, getattr(choice, "stop_reason", None)
    assert text == expected
    assert stop not in text
    assert finish == "stop"
    assert stop_reason == stop


def test_chat_stop_string_streaming(server, model_name):
    client = server.openai()
    full = (
        client.chat.completions.create(model=model_name, messages=CHAT, temperature=0, max_tokens=32)
        .choices[0]
        .message.content
    )
    if len(full) < 20:
        pytest.skip(f"greedy answer too short to cut: {full!r}")
    start, stop = multi_token_stop_string(server, full)
    parts = []
    for chunk in client.chat.completions.create(
        model=model_name, messages=CHAT, temperature=0, max_tokens=32, stop=stop, stream=True
    ):
        parts += [c.delta.content or "" for c in chunk.choices]
    assert "".join(parts) == full[:start]


# ---- multi-byte UTF-8 ----------------------------------------------------------------------

UTF8_CHAT = [{"role": "user", "content": "Write 'hello' in Chinese, then a smiley emoji."}]


def test_multibyte_utf8_stream_has_no_replacement_chars(server, model_name):
    client = server.openai()
    args = {"model": model_name, "messages": UTF8_CHAT, "temperature": 0, "max_tokens": 30}
    expected = client.chat.completions.create(**args).choices[0]
    deltas, finish = [], None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            deltas.append(c.delta.content or "")
            finish = c.finish_reason or finish
    text = "".join(deltas)
    assert text == expected.message.content
    # a generation cut by max_tokens may end inside a character; nothing else may be broken
    body = text.rstrip("\ufffd") if finish == "length" else text
    assert "\ufffd" not in body, deltas
    assert all("\ufffd" not in d for d in deltas[:-1]), deltas
    # the check means something only if characters spanning several tokens were generated
    wide = [ch for ch in body if len(ch.encode()) >= 3]
    assert wide, f"no multi-byte output to check: {text!r}"
    assert any(server.tokenize(ch, add_special_tokens=False)["count"] > 1 for ch in wide), wide


# ---- other endpoints -----------------------------------------------------------------------


def test_models_endpoint(server, model_name):
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [model_name]
    assert models.data[0].object == "model"
    with server.http() as client:
        data = client.get("/v1/models").json()
    assert data["object"] == "list"
    assert data["data"][0]["max_model_len"] == server.max_model_len


@pytest.mark.parametrize("text", ["Hello, world!", "héllo 你好，世界 👍🦊 end", "  leading and trailing  "])
def test_tokenize_detokenize_round_trip(server, text):
    tokens = server.tokenize(text, add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == server.max_model_len
    with server.http() as client:
        response = client.post("/detokenize", json={"tokens": tokens["tokens"]})
    assert response.status_code == 200, response.text
    assert response.json()["prompt"] == text


def test_tokenize_token_strs_and_model(server, model_name):
    with server.http() as client:
        response = client.post(
            "/tokenize", json={"model": model_name, "prompt": "Hello world", "return_token_strs": True}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert len(body["token_strs"]) == body["count"]
        assert client.post("/tokenize", json={"prompt": "Hello world"}).json()["token_strs"] is None  # vLLM's
        server.check_error(client.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)


def test_tokenize_chat_counts_what_a_chat_completion_sees(server, model_name):
    """``/tokenize`` with messages renders them as a chat completion does: continue_final_message,
    tools and chat_template_kwargs included (vLLM's tokenize fields)."""
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Sure,"}]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    for extra in ({"continue_final_message": True}, {"tools": tools}, {}):
        with server.http() as client:
            count = client.post("/tokenize", json={"messages": messages, **extra}).json()["count"]
            reply = client.post(
                "/v1/chat/completions",
                json={"model": model_name, "messages": messages, "max_tokens": 1, **extra},
            ).json()
        assert count == reply["usage"]["prompt_tokens"], extra
    with server.http() as client:
        continued = client.post(
            "/tokenize", json={"messages": messages, "continue_final_message": True}
        ).json()
        plain = client.post("/tokenize", json={"messages": messages}).json()
    assert continued["count"] < plain["count"]  # the final message left open: no end tag, no new header


def test_version(server):
    response = httpx.get(server.url + "/version")
    assert response.status_code == 200
    import torch

    assert response.json() == {
        "version": fastdeploy.__version__,
        "backend": "torch",
        "backend_version": torch.__version__,
    }


def test_health(server):
    assert httpx.get(server.url + "/health").status_code == 200
