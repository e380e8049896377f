"""``/v1/responses`` end to end with the official ``openai`` client against a live server.

A Responses request is the chat request it amounts to, so its greedy text must equal the chat
endpoint's for the same conversation: with ``instructions``, across turns chained by
``previous_response_id`` and across a tool call and its result. The stream's events add up to
the whole response (the client's own stream helper rebuilds it), forced tool calls and
``text_format`` outputs validate, stored responses can be read, listed and deleted, and what
cannot be served is a 400 naming the field.
"""

from __future__ import annotations

import json
import time
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

GREEDY = {"temperature": 0, "max_output_tokens": 24}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city.", "parameters": WEATHER}
]


class City(BaseModel):
    name: str = Field(max_length=12)
    country: Literal["France", "Italy", "Japan"]
    capital: bool


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def chat_text(client, model: str, messages: list[dict], **kwargs) -> str:
    reply = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=24, **kwargs
    )
    return reply.choices[0].message.content


def test_text_equals_the_chat_answer_and_is_stored(client, model_name):
    response = client.responses.create(
        model=model_name,
        input="Name a color.",
        instructions="Answer in one word.",
        metadata={"k": "v"},
        **GREEDY,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.output_text
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a color."},
    ]
    assert response.output_text == chat_text(client, model_name, messages)
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.instructions == "Answer in one word." and response.metadata == {"k": "v"}
    assert response.store
    assert (response.temperature, response.top_p) == (0, 1)  # the sampling used, never null

    stored = client.responses.retrieve(response.id)
    assert stored.model_dump() == response.model_dump()
    items = client.responses.input_items.list(response.id).data
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", "Name a color.")]
    client.responses.delete(response.id)
    gone = "Response with id .* not found."  # (vLLM's suite matches this)
    with pytest.raises(openai.NotFoundError, match=gone):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError, match=gone):
        client.responses.delete(response.id)


def test_previous_response_id_continues_the_conversation(client, model_name):
    first = client.responses.create(model=model_name, input="My name is Ada.", **GREEDY)
    second = client.responses.create(
        model=model_name, input="What is my name?", previous_response_id=first.id, **GREEDY
    )
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.output_text == chat_text(client, model_name, messages)
    # the same conversation sent as input items gives the same answer
    items = [
        {"role": "user", "content": "My name is Ada."},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": first.output_text}],
        },
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
    ]
    third = client.responses.create(model=model_name, input=items, store=False, **GREEDY)
    assert third.output_text == second.output_text and not third.store
    with pytest.raises(openai.NotFoundError) as info:  # not stored: nothing to continue
        client.responses.create(model=model_name, input="Hi", previous_response_id=third.id, **GREEDY)
    assert info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "previous_response_not_found"


def test_stream_events_add_up_to_the_whole_response(client, model_name):
    whole = client.responses.create(model=model_name, input="Tell me a fact.", store=False, **GREEDY)
    events = list(
        client.responses.create(model=model_name, input="Tell me a fact.", stream=True, store=False, **GREEDY)
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert types[-1] == {"completed": "response.completed", "incomplete": "response.incomplete"}[whole.status]
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in final.output]
    assert final.usage.output_tokens == whole.usage.output_tokens

    # the client's stream helper rebuilds the response from the events
    with client.responses.stream(
        model=model_name, input="Say OK.", temperature=0, max_output_tokens=200
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        rebuilt = stream.get_final_response()
    assert rebuilt.status == "completed" and "".join(deltas) == rebuilt.output_text


def test_text_format_parses_into_a_pydantic_model(client, model_name):
    parsed = client.responses.parse(
        model=model_name,
        input="Describe Paris as JSON.",
        text_format=City,
        temperature=0,
        max_output_tokens=80,
    )
    assert isinstance(parsed.output_parsed, City)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n"],
    }
    for prompt in ("Pick a number.", "Give me JSON."):
        response = client.responses.create(
            model=model_name,
            input=prompt,
            text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
            temperature=0,
            max_output_tokens=40,
            store=False,
        )
        jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_then_its_result(client, model_name, stream):
    """``tool_choice: required`` gives a valid call; its output, sent back with ``previous_response_id``,
    gets the same answer as the same conversation on the chat endpoint."""
    kwargs = {"model": model_name, "input": "What is the weather in Paris?", "tools": TOOLS, "temperature": 0}
    if stream:
        with client.responses.stream(tool_choice="required", max_output_tokens=60, **kwargs) as events:
            arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            response = events.get_final_response()
    else:
        response = client.responses.create(tool_choice="required", max_output_tokens=60, **kwargs)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    if stream:
        assert arguments == call.arguments

    answer = client.responses.create(
        model=model_name,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C"}],
        tools=TOOLS,
        **GREEDY,
    )
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 25 C"},
    ]
    tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    assert answer.output_text == chat_text(client, model_name, messages, tools=tools)


def test_logprobs_come_with_the_text(client, model_name):
    response = client.responses.create(
        model=model_name,
        input="Hi",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        store=False,
        **GREEDY,
    )
    part = response.output[0].content[0]
    assert len(part.logprobs) == response.usage.output_tokens
    assert "".join(lp.token for lp in part.logprobs).startswith(part.text)  # (then the stop token's)
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)


def test_what_cannot_be_served_is_a_400_naming_the_field(server, model_name):
    cases = [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nope"}}}}, "text.format.schema"),
        ({"input": "x", "max_output_tokens": 10**6}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"instructions": "x"}, "input"),
        ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"input": 5}, "input"),
    ]  # fmt: skip
    with server.http() as http:
        for body, param in cases:
            response = http.post("/v1/responses", json={"model": model_name, **body})
            error = server.check_error(response, 400)
            assert error["param"] == param, (body, error)
        for bad in ("../../etc/passwd", "resp_x", "resp_" + "0" * 32):
            assert http.get(f"/v1/responses/{bad}").status_code == 404
        response = http.post(
            "/v1/responses", json={"model": model_name, "input": "x", "previous_response_id": "resp_1"}
        )
        assert server.check_error(response, 404)["param"] == "previous_response_id"


def test_langchain_on_the_responses_api(server, model_name):
    """LangChain's ``ChatOpenAI(use_responses_api=True)``: chat, stream, ``with_structured_output``
    (both methods) and a ``bind_tools`` round trip, unchanged."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Weather in a city; unit is celsius or fahrenheit."""
        return f"12 degrees {unit} in {city}"

    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1",
        api_key=server.api_key,
        model=model_name,
        temperature=0,
        max_tokens=64,
        use_responses_api=True,
    )
    reply = llm.invoke("Hello!")
    streamed = [chunk for chunk in llm.stream("Hello!")]
    assert reply.text and "".join(chunk.text for chunk in streamed) == reply.text
    for method in ("json_schema", "function_calling"):
        assert isinstance(llm.with_structured_output(City, method=method).invoke("Describe Paris."), City)
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris, in celsius?")
    [call] = ai.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) >= {"city", "unit"}
    messages = [
        HumanMessage("Weather in Paris, in celsius?"),
        ai,
        ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]),
    ]
    answer = llm.bind_tools([get_weather]).invoke(messages)
    assert answer.text or answer.tool_calls


def wait_until_ended(client, response_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_background_response_runs_and_can_be_cancelled(server, client, model_name):
    queued = client.responses.create(model=model_name, input="Name a color.", background=True, **GREEDY)
    assert queued.status == "queued" and queued.background and not queued.output
    early = [item.id for item in client.responses.input_items.list(queued.id).data]
    done = wait_until_ended(client, queued.id)
    assert [
        item.id for item in client.responses.input_items.list(done.id).data
    ] == early  # stored again, same ids
    assert done.status in ("completed", "incomplete") and done.background
    whole = client.responses.create(model=model_name, input="Name a color.", store=False, **GREEDY)
    assert done.output_text == whole.output_text
    assert client.responses.cancel(done.id).status == done.status  # ended: returned as it is

    with pytest.raises(openai.BadRequestError, match="background can only be used when `store` is true"):
        client.responses.create(model=model_name, input="x", background=True, store=False)
    synchronous = client.responses.create(model=model_name, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        client.responses.cancel(synchronous.id)

    long = client.responses.create(
        model=model_name,
        input="Tell a long story.",
        background=True,
        max_output_tokens=1500,
        extra_body={"ignore_eos": True},
    )
    time.sleep(0.5)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(1.0)
    assert client.responses.retrieve(long.id).status == "cancelled"
    m = server.wait_idle(timeout=10)
    assert m["fastdeploy:num_requests_running"] == 0 and m["fastdeploy:kv_cache_usage_perc"] == 0


def test_openai_agents_sdk_runs_on_the_responses_api(server, model_name):
    """The OpenAI Agents SDK (which speaks the Responses API) unchanged: a plain answer, a streamed
    run, a tool loop (call, tool output, answer) and a structured ``output_type``."""
    agents = pytest.importorskip("agents")
    import asyncio

    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(model=model_name, openai_client=server.async_openai())
    settings = agents.ModelSettings(temperature=0, max_tokens=60)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return f"Sunny in {city}"

    async def run() -> None:
        plain = agents.Agent(name="plain", instructions="Be brief.", model=model, model_settings=settings)
        answer = await agents.Runner.run(plain, "Say hello.")
        assert isinstance(answer.final_output, str) and answer.final_output
        streamed = agents.Runner.run_streamed(plain, "Say hello.")
        async for _ in streamed.stream_events():
            pass
        assert streamed.final_output == answer.final_output  # greedy: the same text either way

        forced = settings.resolve(agents.ModelSettings(tool_choice="required"))
        tooled = agents.Agent(name="tools", model=model, tools=[get_weather], model_settings=forced)
        try:
            items = (await agents.Runner.run(tooled, "Weather in Paris?", max_turns=4)).new_items
            ended = True
        except agents.MaxTurnsExceeded as exc:  # a small model may keep calling the tool: still a loop
            items, ended = exc.run_data.new_items, False
        kinds = [type(item).__name__ for item in items]
        assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds
        assert items[1].output.startswith("Sunny in ")
        assert kinds[-1] == "MessageOutputItem" or (not ended and kinds.count("ToolCallOutputItem") >= 2), (
            kinds
        )

        structured = agents.Agent(name="json", model=model, output_type=City, model_settings=settings)
        assert isinstance((await agents.Runner.run(structured, "Describe Paris.")).final_output, City)

    asyncio.run(run())
