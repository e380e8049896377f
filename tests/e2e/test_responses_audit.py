"""``/v1/responses`` against a live server: what an audit with the official ``openai`` client found.

A deleted background response must stay deleted (it is cancelled, not left to run on and store
itself again), and bad requests are 400s that speak the Responses API's shapes and name the exact
field: ``tool_choice`` (flat ``{"type": "function", "name"}``, ``allowed_tools``), content parts
without their text, a ``json_schema`` text format without its ``schema``.
"""

from __future__ import annotations

import time

import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city.", "parameters": WEATHER}
]


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def long_background_response(client, model_name: str, prompt: str):
    """A background response that runs for a while (400 tokens, EOS ignored)."""
    return client.responses.create(
        model=model_name,
        input=prompt,
        background=True,
        max_output_tokens=400,
        extra_body={"ignore_eos": True},
    )


def test_deleting_a_running_background_response_cancels_it(server, client, model_name):
    """Left running, a deleted background response stored itself again when it ended (a 200 on
    ``GET`` after the ``DELETE``'s 200) and kept the engine busy to its last token."""
    queued = long_background_response(client, model_name, "Tell a long story.")
    time.sleep(0.5)
    client.responses.delete(queued.id)
    m = server.wait_idle(timeout=60)
    assert m["fastdeploy:num_requests_running"] == 0 and m["fastdeploy:kv_cache_usage_perc"] == 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # (the run's last save came just after the engine's end)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(queued.id)
        time.sleep(0.2)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(queued.id)


def test_tool_choice_errors_speak_the_responses_shapes(server, model_name):
    """A bad ``tool_choice`` was answered in the chat endpoint's words (``{"type": "function",
    "function": {"name": NAME}}``): a Responses client following that advice got the same 400 again."""
    allowed = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_weather"}],
    }
    cases = [
        ("any", "tool_choice"),
        ({"type": "function"}, "tool_choice.name"),
        ({"type": "function", "function": {"name": "get_weather"}}, "tool_choice.name"),  # chat's shape
        ({**allowed, "mode": "any"}, "tool_choice.mode"),
        ({**allowed, "tools": "get_weather"}, "tool_choice.tools"),
        ({**allowed, "tools": [{"type": "function"}]}, "tool_choice.tools[0]"),
        ({**allowed, "tools": [{"type": "function", "name": "nope"}]}, "tool_choice.tools[0].name"),
    ]
    with server.http() as http:
        for choice, param in cases:
            body = {"model": model_name, "input": "x", "tools": TOOLS, "tool_choice": choice}
            error = server.check_error(http.post("/v1/responses", json=body), 400)
            assert error["param"] == param, (choice, error)
            assert '"function": {"name"' not in error["message"], error  # (chat's shape)
    # the shapes the messages give are served
    client = server.openai()
    for choice in ({"type": "function", "name": "get_weather"}, allowed):
        response = client.responses.create(
            model=model_name, input="Weather in Paris?", tools=TOOLS, tool_choice=choice,
            temperature=0, max_output_tokens=40, store=False,
        )  # fmt: skip
        assert [item.type for item in response.output] == ["function_call"]


def test_input_and_text_format_errors_name_the_missing_field(server, model_name):
    cases = [
        # a text part without its text was "content part type 'input_text' is not supported"
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text"}]}]},
            "input[0].output[0].text",
        ),
        # a json_schema format without its schema was named in chat's words ('json_schema.schema' of
        # 'response_format') with param 'text.format'
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema"),
    ]  # fmt: skip
    with server.http() as http:
        for body, param in cases:
            error = server.check_error(http.post("/v1/responses", json={"model": model_name, **body}), 400)
            assert error["param"] == param, (body, error)
            assert param in error["message"] and "response_format" not in error["message"], error


def test_a_conversation_continued_from_a_cancelled_response_keeps_its_turn(client, model_name):
    """A cancelled background response was stored without its turn: continued with
    ``previous_response_id``, the model never saw that turn's input (vLLM keeps it)."""
    long = long_background_response(client, model_name, "Tell a long story about a dragon.")
    time.sleep(1.0)
    assert client.responses.cancel(long.id).status == "cancelled"
    greedy = {"temperature": 0, "max_output_tokens": 2, "store": False}
    plain = client.responses.create(model=model_name, input="Go on.", **greedy)
    continued = client.responses.create(
        model=model_name, input="Go on.", previous_response_id=long.id, **greedy
    )
    # its user message and the output made before the cancel come before the new input
    assert continued.usage.input_tokens > plain.usage.input_tokens + 8, (continued.usage, plain.usage)


def test_streaming_a_stored_response_is_refused_not_ignored(server, client, model_name):
    """``GET /v1/responses/{id}?stream=true`` (OpenAI streams a background response's events there):
    a 400 naming ``stream``, not the plain JSON a client asking for events would misread."""
    created = client.responses.create(model=model_name, input="Hi", max_output_tokens=4)
    with server.http() as http:
        error = server.check_error(http.get(f"/v1/responses/{created.id}", params={"stream": "true"}), 400)
        assert error["param"] == "stream", error
        assert http.get(f"/v1/responses/{created.id}").json()["id"] == created.id
