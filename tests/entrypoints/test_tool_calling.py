"""Tool calling through the chat handler (``build_app`` over a scripted engine): request checks
(400s naming the field), what reaches the chat template and the engine (tools, the forced call's
grammar), and the calls read out of whole and streamed answers.

(The parsers alone are tests/entrypoints/test_tool_parsers.py; the end-to-end side, with the
official client against a live server, is tests/e2e/test_tool_calling_serve.py.)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import jinja2
import pytest
from fastapi.testclient import TestClient

from fastdeploy.config import ModelConfig, ServerConfig
from fastdeploy.core.outputs import CompletionOutput, RequestOutput
from fastdeploy.entrypoints.openai.api_server import build_app
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest
from fastdeploy.entrypoints.openai.tool_template import hermes_conversation

PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NATIVE_TEMPLATE = (  # renders tools and tool calls as a Qwen2.5-style template does
    "{% if tools %}<|tools|>{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}:{{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
HERMES_ANSWER = [
    "Let me look.\n<tool",
    '_call>\n{"name": "get_weather", "arg',
    'uments": {"city": "Pa',
    'ris"}}\n</tool_call>',
]


class ScriptedTokenizer:
    """One id per character; ``chat_template`` is rendered with jinja2 as transformers would."""

    def __init__(self, template: str):
        self.chat_template = template

    def apply_chat_template(self, conversation, add_generation_prompt=True, tokenize=False, **kwargs) -> str:
        env = jinja2.Environment()
        env.filters["tojson"] = lambda v: json.dumps(v)
        template = kwargs.pop("chat_template", None) or self.chat_template  # (as transformers takes it)
        return env.from_string(template).render(
            messages=conversation, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) % 90 + 1 for ch in text]

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0}


class ScriptedEngine:
    """Answers every request with ``pieces`` as its text deltas (finish ``stop``) and records the
    prompts and sampling parameters it was given."""

    def __init__(self, pieces: list[str], template: str = PLAIN_TEMPLATE):
        self.pieces = pieces
        self.prompts: list[str] = []
        self.params: list[Any] = []
        self.is_healthy = True
        self.max_model_len = 4096
        self.vocab_size = 100
        self.tokenizer = ScriptedTokenizer(template)
        self.source = SimpleNamespace(path="/models/m")
        self.config = SimpleNamespace(model=ModelConfig())

    async def generate(
        self, token_ids, params, request_id, prompt=None, **kwargs
    ) -> AsyncIterator[RequestOutput]:
        self.prompts.append(prompt)
        self.params.append(params)
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            outputs = [
                CompletionOutput(index=k, text=piece, token_ids=[7], finish_reason="stop" if last else None)
                for k in range(params.n)
            ]
            yield RequestOutput(request_id, prompt, list(token_ids), outputs, finished=last)

    async def abort(self, request_ids) -> None:
        pass


@pytest.fixture
def client_for():
    opened: list[TestClient] = []

    def make(engine: ScriptedEngine, **server: Any) -> TestClient:
        client = TestClient(build_app(engine, ["m"], ServerConfig(**server)))
        opened.append(client.__enter__())
        return client

    yield make
    for client in opened:
        client.__exit__(None, None, None)


def chat(client: TestClient, **fields) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    return client.post("/v1/chat/completions", json=body)


def stream_choices(client: TestClient, **fields) -> list[dict[str, Any]]:
    response = chat(client, stream=True, **fields)
    assert response.status_code == 200, response.text
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0] for e in events[:-1]]


def joined_calls(choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls of a stream, put together as the openai client does (by index)."""
    calls: dict[int, dict[str, Any]] = {}
    for choice in choices:
        for piece in choice["delta"].get("tool_calls", []):
            if piece["index"] not in calls:
                assert piece["id"].startswith("call_") and piece["type"] == "function", piece
                assert piece["function"]["name"], piece
                calls[piece["index"]] = {"name": piece["function"]["name"], "arguments": ""}
            else:
                assert "id" not in piece and "name" not in piece["function"], piece
            calls[piece["index"]]["arguments"] += piece["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "custom", "function": WEATHER["function"]}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": 5}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [{"role": "tool", "content": "12 C"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_fields_are_400s_naming_the_field(client_for, fields, param):
    response = chat(client_for(ScriptedEngine(["x"])), **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_auto_whole_answer(client_for):
    engine = ScriptedEngine(HERMES_ANSWER)
    body = chat(client_for(engine), tools=[WEATHER]).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me look."
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert engine.params[0].structured_outputs is None
    # the plain template does not render tools: the server described them in the system message
    assert engine.prompts[0].startswith("<|system|># Tools") and '"name": "get_weather"' in engine.prompts[0]


def test_auto_streamed(client_for):
    choices = stream_choices(client_for(ScriptedEngine(HERMES_ANSWER)), tools=[WEATHER, TIME])
    assert joined_calls(choices) == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert "".join(c["delta"].get("content") or "" for c in choices) == "Let me look."
    pieces = [p for c in choices for p in c["delta"].get("tool_calls", [])]
    assert len(pieces) >= 2  # the arguments came in several pieces
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_no_call_in_the_answer(client_for):
    client = client_for(ScriptedEngine(["It is ", "sunny."]))
    choice = chat(client, tools=[WEATHER]).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}


def test_tool_choice_none_reads_no_calls(client_for):
    engine = ScriptedEngine(HERMES_ANSWER)
    choice = chat(client_for(engine), tools=[WEATHER], tool_choice="none").json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "".join(HERMES_ANSWER)}


@pytest.mark.parametrize("template", [PLAIN_TEMPLATE, NATIVE_TEMPLATE])
def test_exclude_tools_when_tool_choice_none(client_for, template):
    """``--exclude-tools-when-tool-choice-none`` (vLLM's): tool_choice none renders no tools; other
    choices, and the default, still render them."""
    excluding = ScriptedEngine(["Sunny."], template=template)
    client = client_for(excluding, exclude_tools_when_tool_choice_none=True)
    assert chat(client, tools=[WEATHER], tool_choice="none").status_code == 200
    assert chat(client, tools=[WEATHER], tool_choice="auto").status_code == 200
    default = ScriptedEngine(["Sunny."], template=template)
    assert chat(client_for(default), tools=[WEATHER], tool_choice="none").status_code == 200
    assert "get_weather" not in excluding.prompts[0]
    assert "get_weather" in excluding.prompts[1] and "get_weather" in default.prompts[0]


@pytest.mark.parametrize("parallel", [None, False])
def test_required_is_generated_under_a_schema(client_for, parallel):
    answer = [
        '[{"name": "get_time", "parameters": {}}, ',
        '{"name": "get_weather", "parameters": {"city": "Rome"}}]',
    ]
    engine = ScriptedEngine(answer)
    fields = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    message = chat(client_for(engine), **fields).json()["choices"][0]["message"]
    schema = engine.params[0].structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert ("maxItems" in schema) == (parallel is False)
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    expected = [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')]
    assert calls == (expected[:1] if parallel is False else expected)
    assert message["content"] is None


def test_named_function_is_generated_under_its_parameters_schema(client_for):
    engine = ScriptedEngine(['{"city"', ': "Oslo"}'])
    client = client_for(engine)
    choice_field = {"type": "function", "function": {"name": "get_weather"}}
    message = chat(client, tools=[WEATHER, TIME], tool_choice=choice_field).json()["choices"][0]["message"]
    assert engine.params[0].structured_outputs.json == WEATHER["function"]["parameters"]
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    choices = stream_choices(client, tools=[WEATHER, TIME], tool_choice=choice_field)
    assert joined_calls(choices) == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert choices[-1]["finish_reason"] == "stop"  # (a named function's call: OpenAI's "stop")


def test_forced_call_schema_the_grammar_engine_refuses_is_a_400(client_for):
    # jsonschema accepts this parameters schema, but xgrammar has no lookbehind: once an engine-side
    # failure of the request, now a 400 before anything runs
    engine = ScriptedEngine(['{"city": "x"}'])
    client = client_for(engine)
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": "(?<=a)b"}}}}}  # fmt: skip
    response = chat(client, tools=[tool], tool_choice="required")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "Lookbehind" in error["message"], error
    assert engine.params == []


def test_forced_call_and_another_constraint_is_a_400(client_for):
    from fastdeploy.core.sampling_params import StructuredOutputsParams
    from fastdeploy.entrypoints.openai.errors import BadRequestError
    from fastdeploy.entrypoints.openai.tool_calling import ToolPlan

    plan = ToolPlan(parser=None, constraint=StructuredOutputsParams(json={"type": "object"}))
    from fastdeploy.core.sampling_params import SamplingParams

    with pytest.raises(BadRequestError) as err:
        plan.sampling_params(SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)))
    assert err.value.param == "tool_choice"


CITY_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "final_output",
        "strict": True,
        "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    },
}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_call_overrides_response_format(client_for, tool_choice):
    # the OpenAI Agents SDK sends both for an agent with an output_type whose tool use is required, and
    # OpenAI accepts them: response_format shapes a text answer, and a forced call's answer is the call
    engine = ScriptedEngine(
        ['{"city": "Oslo"}']
        if isinstance(tool_choice, dict)
        else ['[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]']
    )
    client = client_for(engine)
    response = chat(client, tools=[WEATHER], tool_choice=tool_choice, response_format=CITY_FORMAT)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    schema = engine.params[0].structured_outputs.json
    assert schema != CITY_FORMAT["json_schema"]["schema"] and "city" in json.dumps(schema)


def test_forced_call_over_a_responses_text_format(client_for):
    engine = ScriptedEngine(['[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]'])
    tool = {"type": "function", **WEATHER["function"]}
    fmt = {"type": "json_schema", **CITY_FORMAT["json_schema"]}
    body = {
        "model": "m",
        "input": "Weather?",
        "tools": [tool],
        "tool_choice": "required",
        "text": {"format": fmt},
    }
    response = client_for(engine).post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    (call,) = response.json()["output"]
    assert (call["type"], call["name"], call["arguments"]) == (
        "function_call",
        "get_weather",
        '{"city": "Oslo"}',
    )


def test_forced_call_with_an_extension_constraint_stays_a_400(client_for):
    engine = ScriptedEngine(["x"])
    response = chat(client_for(engine), tools=[WEATHER], tool_choice="required", guided_regex="[a-z]+")
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tool_choice"
    assert engine.params == []


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
]


def test_tool_conversation_through_a_template_that_renders_tools(client_for):
    engine = ScriptedEngine(["It is 12 C."], template=NATIVE_TEMPLATE)
    body = chat(client_for(engine), messages=CONVERSATION, tools=[WEATHER]).json()
    assert body["choices"][0]["message"]["content"] == "It is 12 C."
    prompt = engine.prompts[0]
    assert prompt.startswith("<|tools|>" + json.dumps(WEATHER))
    assert (
        '<|assistant|><tool_call>get_weather:{"city": "Paris"}</tool_call>' in prompt
    )  # arguments as an object
    assert "<|tool|>12 C[call_1]" in prompt


def test_tool_conversation_through_a_template_without_tools(client_for):
    engine = ScriptedEngine(["It is 12 C."])
    chat(
        client_for(engine),
        messages=[{"role": "system", "content": "Be brief."}, *CONVERSATION],
        tools=[WEATHER],
    )
    prompt = engine.prompts[0]
    assert prompt.startswith("<|system|>Be brief.\n\n# Tools")
    assert (
        '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert "<|user|><tool_response>\n12 C\n</tool_response>" in prompt


def test_hermes_conversation_merges_tool_results():
    out = hermes_conversation(
        [*CONVERSATION, {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}], tools=None
    )
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert (
        out[2]["content"]
        == "<tool_response>\n12 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    )


def test_mistral_keeps_special_tokens_and_parser_names(client_for):
    engine = ScriptedEngine(['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}]'])
    message = chat(client_for(engine, tool_call_parser="mistral"), tools=[WEATHER]).json()["choices"][0][
        "message"
    ]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Bern"}'
    assert engine.params[0].skip_special_tokens is False
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        build_app(ScriptedEngine([]), ["m"], ServerConfig(tool_call_parser="nope"))


def test_reasoning_is_split_before_the_calls(client_for):
    engine = ScriptedEngine(["<think>Need the", " weather.</think>\n", *HERMES_ANSWER])
    client = client_for(engine, reasoning_parser="qwen3")
    message = chat(client, tools=[WEATHER]).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Need the weather."
    assert message["content"] == "Let me look." and len(message["tool_calls"]) == 1
    choices = stream_choices(client, tools=[WEATHER])
    assert "".join(c["delta"].get("reasoning_content") or "" for c in choices) == "Need the weather."
    assert joined_calls(choices) == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]


@pytest.mark.parametrize(
    "tool_choice,body",
    [
        ("required", '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'),
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Rome"}'),
    ],
)
def test_forced_call_keeps_the_reasoning(client_for, tool_choice, body):
    # as vLLM (and SGLang): the model thinks freely, the call's grammar applies after </think>,
    # and the reasoning is reported apart from the call
    engine = ScriptedEngine(["<think>Rome is", " asked.</think>\n\n", body])
    client = client_for(engine, reasoning_parser="qwen3")
    message = chat(client, tools=[WEATHER, TIME], tool_choice=tool_choice).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Rome is asked." and message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    ]
    assert engine.params[0].structured_outputs.reasoning_prefix is not None
    choices = stream_choices(client, tools=[WEATHER, TIME], tool_choice=tool_choice)
    assert "".join(c["delta"].get("reasoning_content") or "" for c in choices) == "Rome is asked."
    assert joined_calls(choices) == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    assert not any(c["delta"].get("content") for c in choices)
    assert choices[-1]["finish_reason"] == ("tool_calls" if tool_choice == "required" else "stop")


def test_named_stream_sends_no_empty_argument_piece(client_for):
    engine = ScriptedEngine(['{"city"', ': "Oslo"}', ""])  # the last output carries no text
    choice_field = {"type": "function", "function": {"name": "get_weather"}}
    choices = stream_choices(client_for(engine), tools=[WEATHER], tool_choice=choice_field)
    pieces = [p for c in choices for p in c["delta"].get("tool_calls", [])]
    assert all(p["function"].get("arguments") for p in pieces), pieces
    assert choices[-1] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
    }  # fmt: skip (a named function's call stops, as OpenAI's)


CONFLICTING_DEFS = [
    {
        "type": "function",
        "function": {
            "name": f"tool{i}",
            "parameters": {
                "type": "object",
                "properties": {"data": {"$ref": "#/$defs/DataType"}},
                "$defs": {"DataType": {"type": "object", "properties": {"value": {"type": kind}}}},
            },
        },
    }
    for i, kind in enumerate(["string", "number"])
]


@pytest.mark.parametrize(
    "fields,words",
    [
        (  # SGLang's test_tool_choice checks these words of each 400
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "nonexistent_function"}},
            },
            ["Tool 'nonexistent_function' not found in tools list"],
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": "unknown_type"}}},
                        },
                    }
                ],  # fmt: skip
                "tool_choice": "required",
            },
            ["invalid 'parameters' schema"],
        ),
        ({"tools": CONFLICTING_DEFS, "tool_choice": "required"}, ["multiple schemas", "not supported"]),
        (
            {
                "tools": [{"type": "function", "function": {"description": "no name"}}],
                "tool_choice": "required",
            },
            ["name"],
        ),
    ],
)
def test_tool_400s_say_what_sglang_clients_look_for(client_for, fields, words):
    response = chat(client_for(ScriptedEngine(["x"])), **fields)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert all(word.lower() in message.lower() for word in words), message


STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


def test_auto_with_a_strict_tool_holds_calls_to_its_schema(client_for):
    """``tool_choice`` auto with a ``strict`` tool: the request carries the grammar (a structural tag:
    free text, and after ``<tool_call>`` a call of one of the tools, a strict one's arguments in its
    schema); the answer is read as before. Without ``strict``, or with the request's own
    ``response_format``, no such grammar."""
    import xgrammar as xgr

    engine = ScriptedEngine(HERMES_ANSWER)
    choice = chat(client_for(engine), tools=[STRICT_WEATHER, TIME]).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    constraint = engine.params[0].structured_outputs
    assert constraint is not None and constraint.structural_tag is not None
    grammar = xgr.Grammar.from_structural_tag(constraint.structural_tag)
    accepts = xgr.testing._is_grammar_accept_string
    call = '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>'
    assert accepts(grammar, "Let me look. " + call % '{"city": "Paris"}')
    assert not accepts(grammar, call % '{"town": "Paris"}')  # the strict tool's schema
    assert not accepts(grammar, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    assert accepts(grammar, '<tool_call>\n{"name": "get_time", "arguments": {"any": 1}}\n</tool_call>')
    assert accepts(grammar, "No call at all.")

    loose = ScriptedEngine(HERMES_ANSWER)
    chat(client_for(loose), tools=[WEATHER])
    assert loose.params[0].structured_outputs is None
    own = ScriptedEngine(['{"a": 1}'])
    chat(client_for(own), tools=[STRICT_WEATHER], response_format={"type": "json_object"})
    assert own.params[0].structured_outputs.json_object  # the request's constraint stays


def test_a_strict_tool_is_not_held_where_the_call_marker_is_a_special_token():
    """A grammar sees text, not a special token's: where ``<tool_call>`` is one, no grammar is
    added (it would keep the model from calling at all)."""
    from fastdeploy.entrypoints.openai.tool_calling import ToolCalling

    tokenizer = ScriptedTokenizer(PLAIN_TEMPLATE)
    assert ToolCalling(tokenizer, "hermes").strict_trigger == "<tool_call>"
    tokenizer.all_special_tokens = ["<tool_call>", "</tool_call>"]
    assert ToolCalling(tokenizer, "hermes").strict_trigger is None
    assert (
        ToolCalling(ScriptedTokenizer(PLAIN_TEMPLATE), "mistral").strict_trigger is None
    )  # not built for it


def _legacy_stream(choices: list[dict[str, Any]]) -> tuple[dict[str, str], str]:
    """The deprecated streamed call put together (its name once, then argument pieces), and the
    stream's finish reason; no ``tool_calls`` pieces."""
    call = {"name": "", "arguments": ""}
    for choice in choices:
        assert "tool_calls" not in choice["delta"], choice
        piece = choice["delta"].get("function_call")
        if piece:
            call["name"] += piece.get("name", "")
            call["arguments"] += piece.get("arguments", "")
    return call, choices[-1]["finish_reason"]


def test_deprecated_functions_answer_in_the_deprecated_shape(client_for):
    """``functions`` + ``function_call``: the call comes back as ``message.function_call`` (no
    ``tool_calls``), whole and streamed; a named one stops with ``stop``, an automatic one with
    ``function_call``, as OpenAI's deprecated API answers."""
    function = WEATHER["function"]
    engine = ScriptedEngine(['{"city"', ': "Oslo"}'])
    client = client_for(engine)
    named = {"functions": [function], "function_call": {"name": "get_weather"}}
    choice = chat(client, **named).json()["choices"][0]
    assert engine.params[0].structured_outputs.json == function["parameters"]
    assert choice["message"]["function_call"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    call, finish = _legacy_stream(stream_choices(client, **named))
    assert call == {"name": "get_weather", "arguments": '{"city": "Oslo"}'} and finish == "stop"

    client = client_for(ScriptedEngine(HERMES_ANSWER), tool_call_parser="hermes")
    choice = chat(client, functions=[function]).json()["choices"][0]
    assert choice["message"]["function_call"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["finish_reason"] == "function_call"
    call, finish = _legacy_stream(stream_choices(client, functions=[function]))
    assert call == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and finish == "function_call"


def test_deprecated_function_messages_render_as_tool_messages(client_for):
    """The next turn of the deprecated API (an assistant ``function_call``, a ``function`` message)
    reaches the template as a tool call and a ``tool`` message."""
    engine = ScriptedEngine(["It is sunny."])
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    request = ChatCompletionRequest(model="m", messages=messages)
    rendered = [m.to_template_dict() for m in request.messages]
    assert rendered[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert rendered[1]["content"] is None and "function_call" not in rendered[1]
    assert rendered[2]["role"] == "tool" and rendered[2]["name"] == "get_weather"
    body = {"model": "m", "messages": messages, "functions": [WEATHER["function"]]}
    assert client_for(engine).post("/v1/chat/completions", json=body).status_code == 200
