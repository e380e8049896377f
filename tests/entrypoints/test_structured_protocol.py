"""The structured-output request fields → ``SamplingParams.structured_outputs``, and their 400s."""

from __future__ import annotations

import pytest

from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def chat(**fields):
    return parse_request(ChatCompletionRequest, {"messages": USER, **fields}).to_sampling_params()


def completion(**fields):
    return parse_request(CompletionRequest, {"prompt": "hi", **fields}).to_sampling_params()


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize(
    ("fields", "kind", "value"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
            "json",
            SCHEMA,
        ),
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
        ({"structured_outputs": {"regex": "a+", "backend": "xgrammar"}}, "regex", "a+"),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, "json", SCHEMA),
        ({"guided_regex": r"\d+"}, "regex", r"\d+"),
        ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
        ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
        # SGLang's names
        ({"json_schema": SCHEMA}, "json", SCHEMA),
        ({"regex": r"\d+"}, "regex", r"\d+"),
        ({"ebnf": 'root ::= "Hi" | "Hey"'}, "grammar", 'root ::= "Hi" | "Hey"'),
    ],
)
def test_fields_become_the_constraint(make, fields, kind, value):
    params = make(**fields).structured_outputs
    assert params.kind == kind
    assert getattr(params, kind) == value


def test_text_format_and_no_fields_mean_free_text():
    assert chat(response_format={"type": "text"}).structured_outputs is None
    assert completion().structured_outputs is None


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": {"type": "foo"}},
                }
            },
            "response_format.json_schema.schema",
            "invalid JSON schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
            "response_format.json_schema",
            "schema",
        ),
        ({"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
        ({"guided_grammar": "root ::= y"}, "guided_grammar", "invalid grammar"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "only one"),
        ({"ebnf": "root ::= y"}, "ebnf", "invalid grammar"),
        ({"regex": "[a-"}, "regex", "invalid regex"),
        (
            {"guided_json": SCHEMA, "guided_decoding_backend": "outlines"},
            "guided_decoding_backend",
            "xgrammar",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_field(fields, param, says):
    with pytest.raises(BadRequestError) as info:
        chat(**fields)
    assert info.value.param == param
    assert says in info.value.message


def test_unknown_response_format_type_is_400():
    with pytest.raises(BadRequestError) as info:
        chat(response_format={"type": "yaml"})
    assert info.value.param.startswith("response_format")
