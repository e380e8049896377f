"""Structured outputs through a live ``fastdeploy serve`` and the official ``openai`` client:
``chat.completions.parse`` with a pydantic model, ``json_schema`` answers that validate over a batch
of schemas and prompts (streamed and not), ``json_object``, ``guided_choice`` / ``guided_regex`` on
completions, and 400s naming the field for invalid constraints."""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
            "sunny": {"type": "boolean"},
        },
        "required": ["city", "sunny"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": 1,
                "maxItems": 3,
            },
            "total": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["items", "total"],
    },
    {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no"]},
            "why": {"type": "string", "maxLength": 20},
        },
        "required": ["answer", "why"],
    },
]
PROMPTS = ["Describe a person.", "What is the weather?", "List some numbers.", "Is the sky blue?"]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int
    mood: Literal["happy", "sad"]


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_parse_returns_a_parsed_object(server, model_name):
    client = server.openai()
    completion = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=Person,
        max_tokens=80,
        temperature=0,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person)
    assert completion.choices[0].finish_reason == "stop"


def _one(client, model_name, schema, prompt, stream, seed):
    kwargs = dict(
        model=model_name,
        messages=[{"role": "user", "content": prompt}],
        response_format=_format(schema),
        max_tokens=100,
        temperature=0.8,
        seed=seed,
    )
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_json_schema_answers_validate_every_time(server, model_name):
    client = server.openai()
    jobs = [
        (schema, prompt, stream, seed)
        for seed, (schema, prompt) in enumerate(zip(SCHEMAS, PROMPTS))
        for stream in (False, True)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # one batch of different schemas
        results = list(pool.map(lambda job: _one(client, model_name, *job), jobs))
    for (schema, _, _, _), (text, finish) in zip(jobs, results):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow  # (a second server: ~30 s)
def test_async_scheduling_server_gives_the_same_answers(server, server_factory, model_name):
    """With async scheduling each step's bitmask goes to the worker process after its forward was
    launched (and the engine reads the worker's reply only with the next call): the greedy answers
    equal the default server's, a batch of different schemas at once."""
    overlapped = server_factory("--async-scheduling")
    jobs = [(schema, prompt) for schema, prompt in zip(SCHEMAS, PROMPTS)]

    def greedy(srv, schema, prompt):
        reply = srv.openai().chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": prompt}],
            response_format=_format(schema),
            max_tokens=100,
            temperature=0,
        )
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        plain = list(pool.map(lambda job: greedy(server, *job), jobs))
        overlap = list(pool.map(lambda job: greedy(overlapped, *job), jobs))
    assert overlap == plain
    for (schema, _), (text, finish) in zip(jobs, overlap):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_n(server, model_name):
    reply = server.openai().chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0.9,
        n=2,
        logprobs=True,
    )
    assert len(reply.choices) == 2
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut by max_tokens: still a prefix of an object
            assert choice.message.content.startswith("{")
        assert len(choice.logprobs.content) > 0


def test_guided_choice_and_regex_on_completions(server, model_name):
    client = server.openai()
    reply = client.completions.create(
        model=model_name,
        prompt="The color of grass is",
        max_tokens=8,
        n=3,
        temperature=1.0,
        extra_body={"guided_choice": ["green", "blue", "purple"]},
    )
    assert {c.text for c in reply.choices} <= {"green", "blue", "purple"}
    reply = client.completions.create(
        model=model_name,
        prompt="The date today is",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": r"20\d\d-[01]\d-[0-3]\d"},
    )
    assert re.fullmatch(r"20\d\d-[01]\d-[0-3]\d", reply.choices[0].text)
    reply = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Yes or no?"}],
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert reply.choices[0].message.content in ("yes", "no")
    reply = client.chat.completions.create(  # SGLang's field names
        model=model_name,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        extra_body={"ebnf": 'root ::= "Hello" | "Hi" | "Hey"'},
    )
    assert reply.choices[0].message.content in ("Hello", "Hi", "Hey")
    reply = client.completions.create(
        model=model_name,
        prompt="The year is",
        max_tokens=8,
        temperature=0,
        extra_body={"regex": r" 20\d\d"},
    )
    assert re.fullmatch(r" 20\d\d", reply.choices[0].text)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (
            {"response_format": _format({"type": "object", "properties": {"a": {"type": "nope"}}})},
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"guided_json": {"type": "object"}, "guided_choice": ["a"]}}, "guided_choice"),
    ],
)
def test_invalid_constraint_is_400_naming_the_field(server, model_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        server.openai().chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kwargs
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == param


def test_langchain_with_structured_output(server, model_name):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key=server.api_key, model=model_name, temperature=0, max_tokens=80
    )
    for method in ("json_schema", "function_calling"):  # response_format, then a forced tool call
        structured = llm.with_structured_output(Person, method=method)
        person = structured.invoke("Describe a person as JSON with name, age and mood.")
        assert isinstance(person, Person), method
