"""``/v1/chat/completions`` as applications built on the official ``openai`` client send it back:
assistant messages carrying OpenAI's own fields (``refusal``, ``audio``, ``annotations``, the
deprecated ``function_call``), refusal content parts and the deprecated ``function`` role are
OpenAI's protocol, not extensions: accepted (also with ``--strict-request-fields``) and shown to
the chat template as what the assistant said.
"""

from __future__ import annotations

import openai
import pytest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
SHORT = {"temperature": 0, "max_tokens": 4}
REFUSAL = "I cannot help with that request."


def rendered(server, messages: list[dict], **kwargs) -> str:
    """The prompt text a chat completion of ``messages`` sees (``/tokenize``, then ``/detokenize``)."""
    tokens = server.tokenize(messages=messages, **kwargs)["tokens"]
    with server.http() as http:
        return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def sent_back_turns(server, model_name: str) -> list:
    """A tool-call turn, answered, as clients send it back: the answer's message in the three ways
    the openai client's users append it (the object, ``model_dump()``, ``model_dump(exclude_none=True)``)."""
    client = server.openai()
    reply = client.chat.completions.create(
        model=model_name, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=40
    )
    message = reply.choices[0].message
    assert message.tool_calls, reply
    results = [{"role": "tool", "tool_call_id": call.id, "content": "12 C"} for call in message.tool_calls]
    return [
        [*QUESTION, sent, *results]
        for sent in (message, message.model_dump(), message.model_dump(exclude_none=True))
    ]


REFUSALS = [
    # OpenAI's assistant message: refusal field, no content
    [
        *QUESTION,
        {"role": "assistant", "content": None, "refusal": REFUSAL},
        {"role": "user", "content": "Ok."},
    ],
    # ... and as a refusal content part
    [
        *QUESTION,
        {"role": "assistant", "content": [{"type": "refusal", "refusal": REFUSAL}]},
        {"role": "user", "content": "Ok."},
    ],
]


@pytest.mark.parametrize("messages", REFUSALS, ids=["refusal-field", "refusal-part"])
def test_an_assistant_refusal_is_shown_to_the_model(server, model_name, messages):
    reply = server.openai().chat.completions.create(model=model_name, messages=messages, **SHORT)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert f"<|im_start|>assistant\n{REFUSAL}<|im_end|>" in rendered(server, messages)


def test_refusal_parts_only_in_assistant_messages(server, model_name):
    with server.http() as http:
        bad_user = [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
        response = http.post("/v1/chat/completions", json={"model": model_name, "messages": bad_user})
        error = server.check_error(response, 400)
        assert error["param"] == "messages[0].content" and "'refusal'" in error["message"]
        no_text = [*QUESTION, {"role": "assistant", "content": [{"type": "refusal"}]}]
        response = http.post("/v1/chat/completions", json={"model": model_name, "messages": no_text})
        error = server.check_error(response, 400)
        assert error["param"] == "messages[1].content" and "refusal" in error["message"]


def test_answers_sent_back_as_the_openai_client_gives_them(server, model_name):
    """The next turn of a tool call, with the answer appended as the client gives it (the
    ``model_dump()`` one has ``refusal``, ``audio``, ``annotations`` and ``function_call`` null)."""
    client = server.openai()
    for messages in sent_back_turns(server, model_name):
        reply = client.chat.completions.create(model=model_name, messages=messages, tools=TOOLS, **SHORT)
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.slow  # (its own server; tests/entrypoints/test_request_fields.py checks the same fields unit-level)
def test_strict_request_fields_accepts_openais_own_message_fields(server_factory):
    """``--strict-request-fields`` refuses what is outside OpenAI's protocol, not OpenAI's assistant
    message fields, refusal parts or its deprecated ``function`` role (the server's ``functions``)."""
    strict = server_factory("--strict-request-fields")
    model_name = strict.model_name()
    client = strict.openai()
    for messages in [*sent_back_turns(strict, model_name)]:
        reply = client.chat.completions.create(model=model_name, messages=messages, tools=TOOLS, **SHORT)
        assert reply.choices
    for messages in REFUSALS:
        assert client.chat.completions.create(model=model_name, messages=messages, **SHORT).choices
    audio = [*QUESTION, {"role": "assistant", "content": "Sunny.", "audio": {"id": "audio_1"}}, *QUESTION]
    assert client.chat.completions.create(model=model_name, messages=audio, **SHORT).choices
    legacy = [
        *QUESTION,
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
        {"role": "function", "name": "get_weather", "content": "12 C"},
    ]
    functions = [TOOLS[0]["function"]]
    assert client.chat.completions.create(
        model=model_name, messages=legacy, functions=functions, **SHORT
    ).choices
    # what is not OpenAI's stays a 400 naming it
    for messages, param in [
        ([{"role": "user", "content": "Hi", "refusal": "no"}], "messages[0].refusal"),
        ([*QUESTION, {"role": "assistant", "content": "x", "extra": 1}], "messages[1].extra"),
        ([{"role": "narrator", "content": "Hi"}], "messages[0].role"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model_name, messages=messages, **SHORT)
        assert err.value.body["param"] == param, err.value.body
