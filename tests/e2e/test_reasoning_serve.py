"""``--reasoning-parser qwen3`` end to end, with the official ``openai`` client.

The default model (SmolLM2) does not think on its own, so the assistant turn is
prefilled (``continue_final_message``) with a pattern of ``<think>x</think>y``
lines that ends inside an open ``<think>``: the answer starts in the reasoning
(the prompt opened it) and the model, copying the pattern, closes it with a
``</think>`` of its own, split over several tokens. Greedy decoding makes the
raw text fixed; it is read back through ``return_token_ids`` and ``/detokenize``
and must split exactly at its first ``</think>``, whole and streamed alike. Under a JSON schema the
reasoning stays the same and only the answer after it follows the schema.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

PATTERN = "<think>ping</think>pong\n" * 6 + "<think>"
MESSAGES = [
    {"role": "user", "content": "Continue the pattern."},
    {"role": "assistant", "content": PATTERN},
]
PREFILL = {"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True}


def expected_split(raw: str) -> tuple[str | None, str | None]:
    """The qwen3 split of an answer that starts inside the reasoning, written out independently."""
    if "</think>" not in raw:
        return raw or None, None
    reasoning, _, content = raw.partition("</think>")
    return reasoning or None, content.lstrip() or None


def test_reasoning_parser_end_to_end(server_factory):
    server = server_factory(
        "--reasoning-parser", "qwen3", "--root-path", "/llm", "--disable-uvicorn-access-log"
    )
    client = server.openai()
    model = server.model_name()
    # (this server also runs under a reverse proxy's prefix: routes answer with and without it)
    with server.http() as http:
        assert http.get("/llm/v1/models").json()["data"][0]["id"] == model
        assert http.get("/v1/models").status_code == 200 and http.get("/other/v1/models").status_code == 404
    assert '"GET /llm/v1/models HTTP/1.1" 200' not in server.log(100_000)  # (and no access log)

    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=24, temperature=0, extra_body=PREFILL
    )
    choice = reply.choices[0]
    with server.http() as http:
        raw = http.post("/detokenize", json={"tokens": choice.token_ids}).json()["prompt"]
    assert "</think>" in raw, raw  # the model copied the pattern: the split is exercised
    reasoning, content = expected_split(raw)
    assert reasoning and content, raw
    assert choice.message.reasoning_content == choice.message.reasoning == reasoning
    assert choice.message.content == content
    assert "</think>" not in reasoning
    # usage counts the reasoning's tokens (here its text re-tokenized: the tags are several tokens)
    with server.http() as http:
        counted = http.post("/tokenize", json={"prompt": reasoning, "add_special_tokens": False}).json()[
            "count"
        ]
    assert reply.usage.completion_tokens_details.reasoning_tokens == counted > 0
    # vLLM's include_reasoning: false drops the reasoning and keeps the answer
    hidden = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=24, temperature=0,
        extra_body={**PREFILL, "include_reasoning": False},
    ).choices[0].message  # fmt: skip
    assert getattr(hidden, "reasoning_content", None) is None and hidden.content == content

    # streamed: reasoning deltas first, then content deltas, joining to the same split
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=24, temperature=0, stream=True, extra_body=PREFILL
    )
    kinds, streamed_reasoning, streamed_content = [], [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            assert delta.reasoning == delta.reasoning_content
            streamed_reasoning.append(delta.reasoning_content)
            kinds.append("r")
        if delta.content:
            streamed_content.append(delta.content)
            kinds.append("c")
    assert "".join(streamed_reasoning) == (reasoning or "")
    assert "".join(streamed_content) == content
    assert "".join(kinds).lstrip("r").strip("c") == ""  # never reasoning after content

    # a JSON schema constrains the answer after the reasoning, which stays as free as without it
    schema = {
        "type": "object",
        "properties": {"word": {"type": "string", "enum": ["ping", "pong"]}},
        "required": ["word"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=48, temperature=0, stream=stream,
            extra_body={**PREFILL, "response_format": response_format},
        )  # fmt: skip
        if stream:
            pieces = [c.choices[0].delta for c in reply if c.choices]
            got_reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in pieces)
            got_content = "".join(d.content or "" for d in pieces)
        else:
            got_reasoning, got_content = (
                reply.choices[0].message.reasoning_content,
                reply.choices[0].message.content,
            )
        assert got_reasoning == reasoning
        jsonschema.validate(json.loads(got_content), schema)

    # cut by max_tokens inside the reasoning: all of it is reasoning, content null
    short = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=1, temperature=0, extra_body=PREFILL
    ).choices[0]
    assert short.finish_reason == "length"
    assert short.message.content is None and short.message.reasoning_content

    # a prompt whose reasoning is closed: the answer is all content
    closed = [MESSAGES[0], {"role": "assistant", "content": PATTERN + "</think>"}]
    answer = client.chat.completions.create(
        model=model, messages=closed, max_tokens=4, temperature=0, extra_body=PREFILL
    ).choices[0]
    assert answer.message.content and getattr(answer.message, "reasoning_content", None) is None

    # chat_template_kwargs: accepted as an object (this template ignores it), a 400 otherwise
    ok = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert ok.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"chat_template_kwargs": [1]},
        )
    assert err.value.body["param"] == "chat_template_kwargs"
