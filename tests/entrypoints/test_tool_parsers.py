"""Tool-call parsers: whole answers, and every split of them into deltas reassembled to the same
calls and content; the registry and the default chosen from a chat template.

(The chat handler and the request side are tests/entrypoints/test_tool_calling.py; the end-to-end
side, with the official client against a live server, is tests/e2e/test_tool_calling_serve.py.)
"""

from __future__ import annotations

import json

import pytest

from fastdeploy.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    default_tool_parser_name,
    get_tool_parser,
)
from fastdeploy.entrypoints.openai.tool_parsers.base import JsonScanner, parse_call

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
T = '{"name": "get_time", "arguments": {"tz": "Europe/Paris \\"CET\\"", "n": [1, {"x": "}"}]}}'
W_ARGS = '{"city": "Paris", "unit": "C"}'
T_ARGS = '{"tz": "Europe/Paris \\"CET\\"", "n": [1, {"x": "}"}]}'

# (parser, answer, content, [(name, arguments)])
CASES: list[tuple[ToolParser, str, str | None, list[tuple[str, str]]]] = [
    # hermes
    (HermesToolParser(), f"<tool_call>\n{W}\n</tool_call>", None, [("get_weather", W_ARGS)]),
    (
        HermesToolParser(),
        f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>\nDone.",
        "Let me check.\n\n\nDone.",
        [("get_weather", W_ARGS), ("get_time", T_ARGS)],
    ),
    (HermesToolParser(), "No tools needed: 4.", "No tools needed: 4.", []),
    (HermesToolParser(), "a < b <tool_", "a < b <tool_", []),
    (
        HermesToolParser(),
        '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',  # malformed JSON: content
        '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',
        [],
    ),
    (HermesToolParser(), "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    (HermesToolParser(), '<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
    (
        HermesToolParser(),  # arguments after the name, given as an encoded string, or absent
        '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call><tool_call>{"name": "g", '
        '"arguments": "{\\"b\\": 2}"}</tool_call><tool_call>{"name": "h"}</tool_call>',
        None,
        [("f", '{"a": 1}'), ("g", '{"b": 2}'), ("h", "{}")],
    ),
    (
        HermesToolParser(max_calls=1),
        f"<tool_call>{W}</tool_call><tool_call>{T}</tool_call>",
        None,
        [("get_weather", W_ARGS)],
    ),
    (HermesToolParser(), f"<tool_call>{W}", None, [("get_weather", W_ARGS)]),  # no closing tag
    # llama3_json
    (Llama3JsonToolParser(), W, None, [("get_weather", W_ARGS)]),
    (
        Llama3JsonToolParser(),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; ' + T,
        None,
        [("get_weather", W_ARGS), ("get_time", T_ARGS)],
    ),
    (Llama3JsonToolParser(), f"Checking. <|python_tag|>{W}", "Checking.", [("get_weather", W_ARGS)]),
    (Llama3JsonToolParser(), f"  {W}\nThat is all.", "That is all.", [("get_weather", W_ARGS)]),
    (Llama3JsonToolParser(), "The answer is {4}.", "The answer is {4}.", []),
    (Llama3JsonToolParser(), '{"answer": 4}', '{"answer": 4}', []),  # plain JSON, not a call
    (
        Llama3JsonToolParser(),
        '{"name": "f", "parameters": {"a": 1,,}}',
        '{"name": "f", "parameters": {"a": 1,,}}',
        [],
    ),
    # mistral
    (MistralToolParser(), f"[TOOL_CALLS][{W}, {T}]", None, [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    (MistralToolParser(), f"Sure. [TOOL_CALLS] [ {W} ] bye", "Sure.  bye", [("get_weather", W_ARGS)]),
    (MistralToolParser(), "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    (MistralToolParser(), "[TOOL_CALLS][1, 2]", "1, 2]", []),
    (MistralToolParser(), "Just text [TOOL", "Just text [TOOL", []),
    (  # tokenizer v11: [TOOL_CALLS]name[ARGS]{...} per call
        MistralToolParser(),
        f"Sure. [TOOL_CALLS]get_weather[ARGS]{W_ARGS}[TOOL_CALLS]get_time[AR" + "GS]" + T_ARGS,
        "Sure.",
        [("get_weather", W_ARGS), ("get_time", T_ARGS)],
    ),
    (MistralToolParser(), "[TOOL_CALLS]f[ARGS]{}", None, [("f", "{}")]),
    (MistralToolParser(), "[TOOL_CALLS]f[ARGS]oops", '[TOOL_CALLS]{"name": "f", "arguments": }oops', []),
    (MistralToolParser(), "[TOOL_CALLS]no_args_marker", "[TOOL_CALLS]no_args_marker", []),
    # forced: tool_choice "required" and a named function
    (
        RequiredToolParser(),
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}, {"name": "get_time", '
        '"parameters": ' + T_ARGS + "}]",
        None,
        [("get_weather", W_ARGS), ("get_time", T_ARGS)],
    ),
    (NamedToolParser("get_weather"), "  " + W_ARGS, None, [("get_weather", W_ARGS)]),
    (NamedToolParser("get_weather"), " \n", None, []),  # an empty answer (cut at once): no call, not ""
]

BROKEN_AFTER_NAME = {
    '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',
    '{"name": "f", "parameters": {"a": 1,,}}',
}
"""Answers whose JSON breaks after the call's name and arguments began: content when whole."""


def reassemble(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and calls of a stream fed ``pieces``: ids and names come before any arguments."""
    stream = parser.stream()
    content: list[str] = []
    calls: dict[int, list] = {}
    for out in [*(stream.feed(p) for p in pieces), stream.finish()]:
        content.append(out[0])
        for d in out[1]:
            if d.index not in calls:
                assert d.id and d.id.startswith("call_") and d.name, d  # the header comes first
                calls[d.index] = [d.name, ""]
            else:
                assert d.id is None and d.name is None
            calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content) or None, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_whole_answer(parser, text, content, calls):
    out = parser.extract(text)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.calls] == calls
    for c in out.calls:
        assert c.id.startswith("call_") and isinstance(json.loads(c.arguments), dict)
    assert len({c.id for c in out.calls}) == len(out.calls)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_every_split_streams_the_same(parser, text, content, calls):
    if text in BROKEN_AFTER_NAME:  # streamed, they stay calls (test_a_call_broken_after_...)
        return
    expected = (content, calls)
    assert reassemble(parser, [text]) == expected
    assert reassemble(parser, list(text)) == expected  # character by character
    for cut in range(len(text) + 1):
        assert reassemble(parser, [text[:cut], text[cut:]]) == expected, cut


def test_arguments_stream_in_pieces():
    stream = HermesToolParser().stream()
    deltas = []
    for ch in f"<tool_call>{W}</tool_call>":
        deltas += stream.feed(ch)[1]
    assert deltas[0].name == "get_weather" and deltas[0].arguments == ""
    assert len(deltas) > 10 and "".join(d.arguments for d in deltas) == W_ARGS


def test_a_call_broken_after_its_name_was_streamed_stays_a_call():
    text = '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>'
    assert HermesToolParser().extract(text).calls == []
    assert reassemble(HermesToolParser(), list(text)) == (None, [("f", '{"a": }')])


def test_json_scanner_and_parse_call():
    s = JsonScanner()
    assert s.feed('{"a": "}\\"", "b": [') is None
    assert s.feed("1]} tail") == 3
    assert parse_call('{"name": "f", "arguments": {"x": 1}}').arguments == '{"x": 1}'
    assert parse_call('{"name": "", "arguments": {}}') is None
    assert parse_call('{"name": "f", "arguments": [1]}') is None
    assert parse_call('{"name": "f", "arguments": "not an object"}') is None


def test_registry_and_default_rule():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    assert get_tool_parser("mistral") is MistralToolParser
    with pytest.raises(ValueError, match="available: hermes, llama3_json, mistral"):
        get_tool_parser("nope")
    assert MistralToolParser.needs_special_tokens and not HermesToolParser.needs_special_tokens
    assert default_tool_parser_name("{{ '<tool_call>' }}{{ tools }}") == "hermes"
    assert default_tool_parser_name("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert default_tool_parser_name("{{ '<|python_tag|>' }}") == "llama3_json"
    assert default_tool_parser_name("{% if message.role == 'ipython' %}") == "llama3_json"
    assert default_tool_parser_name("{{ message['content'] }}") == "hermes"
    assert default_tool_parser_name(None) == "hermes"


@pytest.mark.parametrize(
    "parser,text,content,calls",
    [
        (RequiredToolParser(), '[{"name": "get_weather", "parameters": {"city": "Par', None,
         [("get_weather", '{"city": "Par')]),
        (RequiredToolParser(), '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x', None,
         [("a", "{}"), ("b", '{"x')]),
        # no name yet: no call, and no content either (the required call's grammar wrote that JSON)
        (RequiredToolParser(), '[{"name": "get_w', None, []),
        (HermesToolParser(), 'Sure. <tool_call>{"name": "get_w', 'Sure. <tool_call>{"name": "get_w', []),
        (HermesToolParser(), 'Sure. <tool_call>{"name": "get_weather", "arguments": {"ci', "Sure.",
         [("get_weather", '{"ci')]),
    ],
)  # fmt: skip
def test_an_answer_cut_inside_a_call_is_that_call_as_its_stream_reports_it(parser, text, content, calls):
    """Cut by ``max_tokens`` inside a call whose name is complete: the whole answer reports the call
    with the arguments written so far, what the stream of the same answer sent (was: content)."""
    out = parser.extract(text)
    assert (out.content, [(c.name, c.arguments) for c in out.calls]) == (content, calls)
    assert reassemble(parser, list(text)) == (content, calls)


def test_sglangs_parser_names_are_aliases():
    from fastdeploy.entrypoints.openai.tool_parsers import (
        HermesToolParser,
        Llama3JsonToolParser,
        get_tool_parser,
    )

    assert get_tool_parser("qwen25") is get_tool_parser("qwen") is HermesToolParser
    assert get_tool_parser("llama3") is Llama3JsonToolParser
