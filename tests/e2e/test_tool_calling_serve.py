"""Tool calling end to end: the official ``openai`` client (and LangChain's ``bind_tools``) against
a live ``fastdeploy serve`` on the default model.

The default model (SmolLM2) has a chat template that does not render tools, so the server writes
them into the prompt in the hermes format and reads answers with the hermes parser. Forced calls
(``tool_choice`` ``"required"`` or a named function) are generated under a JSON-schema grammar,
so even this small model returns arguments that validate against the function's schema.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

GREEDY = {"temperature": 0, "max_tokens": 96}
SHORT = {"temperature": 0, "max_tokens": 24}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time.", "parameters": TIME_PARAMS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def streamed(stream) -> tuple[str | None, list[dict], str | None]:
    """Content, calls (put together by index, as the client's docs show) and finish reason of a stream."""
    content, calls, finish = [], {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content.append(choice.delta.content or "")
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.id.startswith("call_") and piece.type == "function"
                assert piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish


def check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_calls_that_validate(client, model_name, parallel):
    kwargs = dict(model=model_name, messages=QUESTION, tools=TOOLS, tool_choice="required", **GREEDY)
    reply = client.chat.completions.create(parallel_tool_calls=parallel, **kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (len(calls) == 1 or parallel)
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        check_call(call.function.name, call.function.arguments)

    content, streamed_calls, finish = streamed(
        client.chat.completions.create(stream=True, **kwargs, parallel_tool_calls=parallel)
    )
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]


def test_named_function_returns_its_call(client, model_name):
    choice_field = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model=model_name, messages=QUESTION, tools=TOOLS, tool_choice=choice_field, **GREEDY)
    choice = client.chat.completions.create(**kwargs).choices[0]
    [call] = choice.message.tool_calls
    # (finish reason "stop", as OpenAI's and vLLM's for a named function: "tool_calls" is auto / required's)
    assert call.function.name == "get_time" and choice.finish_reason == "stop"
    check_call("get_time", call.function.arguments)
    content, calls, finish = streamed(client.chat.completions.create(stream=True, **kwargs))
    assert content is None and finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]


def test_two_turn_conversation_goes_through_the_chat_template(server, client, model_name):
    call = {
        "id": "call_abc123",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc123", "content": "12 degrees and sunny"},
    ]
    reply = client.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, extra_body={"return_token_ids": True}, **SHORT
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    with server.http() as http:
        prompt = http.post("/detokenize", json={"tokens": reply.prompt_token_ids}).json()["prompt"]
    assert '"name": "get_weather"' in prompt.split("<|im_start|>user")[0]  # the tools, in the system turn
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
        in prompt
    )
    assert "<|im_start|>user\n<tool_response>\n12 degrees and sunny\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_none_gives_plain_content_and_auto_streams_as_it_answers(client, model_name):
    kwargs = dict(model=model_name, messages=QUESTION, tools=TOOLS, **SHORT)
    plain = client.chat.completions.create(tool_choice="none", **kwargs).choices[0]
    assert plain.message.tool_calls is None and plain.message.content
    assert plain.finish_reason in ("stop", "length")
    # auto: whatever the model chose, the stream says the same as the whole answer
    whole = client.chat.completions.create(tool_choice="auto", **kwargs).choices[0]
    content, calls, finish = streamed(
        client.chat.completions.create(stream=True, tool_choice="auto", **kwargs)
    )
    assert content == whole.message.content and finish == whole.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []
    ]


def test_bad_tool_requests_are_400s(client, model_name):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model_name,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_stock_price"}},
        )
    assert err.value.body["param"] == "tool_choice.function.name"
    bad_tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "required": "x"}},
    }
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, messages=QUESTION, tools=[bad_tool])
    assert err.value.body["param"] == "tools[0].function.parameters"


def test_langchain_bind_tools_round_trip(server, model_name):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Weather in a city; unit is celsius or fahrenheit."""
        return f"12 degrees {unit} in {city}"

    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key=server.api_key, model=model_name, temperature=0, max_tokens=64
    )
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris, in celsius?")
    [call] = ai.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) >= {"city", "unit"}
    result = get_weather.invoke(call["args"])
    messages = [
        HumanMessage("Weather in Paris, in celsius?"),
        ai,
        ToolMessage(result, tool_call_id=call["id"]),
    ]
    answer = llm.bind_tools([get_weather]).invoke(messages)
    assert isinstance(answer.content, str) and (answer.content or answer.tool_calls)


def test_auto_with_strict_tools_gives_calls_in_their_schemas(client, model_name):
    """``tool_choice`` auto with ``strict`` tools (the OpenAI Agents SDK's default): the engine runs
    the structural-tag grammar (free text, calls held to their schemas); whatever the model chose,
    the answer is well formed and every call validates, whole and streamed alike."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    prompt = [{"role": "user", "content": "Call get_weather for Paris in celsius."}]
    kwargs = dict(model=model_name, messages=prompt, tools=strict, tool_choice="auto", **GREEDY)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls"), choice
    for call in choice.message.tool_calls or []:
        check_call(call.function.name, call.function.arguments)
    content, calls, finish = streamed(client.chat.completions.create(stream=True, **kwargs))
    assert finish == choice.finish_reason and content == choice.message.content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
    ]


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk_output_type_agent_with_a_required_tool(server, model_name, api):
    """An OpenAI Agents SDK agent with an ``output_type`` whose tool use is required sends a forced
    ``tool_choice`` together with ``response_format`` (``text.format`` on /v1/responses), as OpenAI
    accepts: the call is made (the format shapes a text answer, and this answer is the call)."""
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: str
        sunny: bool

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return f"Sunny in {city}"

    agents.set_tracing_disabled(True)
    model_cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    model = model_cls(model=model_name, openai_client=server.async_openai())
    agent = agents.Agent(
        name="forecast",
        model=model,
        tools=[get_weather],
        output_type=Forecast,
        tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(temperature=0, max_tokens=60, tool_choice="required"),
    )

    async def run() -> None:
        result = await agents.Runner.run(agent, "Weather in Paris?", max_turns=2)
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds
        assert result.final_output.startswith("Sunny in ")

    import asyncio

    asyncio.run(run())


def test_deprecated_functions_through_the_openai_client(client, model_name):
    """The openai client's deprecated ``functions`` / ``function_call``: the call comes back as
    ``message.function_call``, valid against the function's schema, as older clients read it."""
    functions = [tool["function"] for tool in TOOLS]
    kwargs = dict(model=model_name, messages=QUESTION, **GREEDY)
    choice = client.chat.completions.create(
        functions=functions, function_call={"name": "get_time"}, **kwargs
    ).choices[0]
    assert choice.message.tool_calls is None and choice.message.function_call.name == "get_time"
    check_call("get_time", choice.message.function_call.arguments)
    assert choice.finish_reason == "stop"
