"""Parsers of answers produced under a forced tool call's grammar, whatever the model's own format.

``tool_choice: "required"``: the answer is a JSON array of ``{"name", "parameters"}`` objects.
A named function: the answer is that function's arguments object, all of it.
"""

from __future__ import annotations

from fastdeploy.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    Segmenter,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    new_call_id,
)
from fastdeploy.entrypoints.openai.tool_parsers.json_array import JsonArraySegmenter


class RequiredToolParser(ToolParser):
    """The answer of ``tool_choice: "required"``: ``[{"name": ..., "parameters": {...}}, ...]``. A call
    cut before its name is complete is no call and no content (the grammar wrote that JSON)."""

    name = "required"
    unparsed_is_content = False

    def segmenter(self) -> Segmenter:
        return JsonArraySegmenter(None)


class _NamedCallStream(ToolCallStream):
    """Streams the one call of a named function: id and name first, then every piece of text as
    arguments (leading whitespace dropped)."""

    def __init__(self, function: str):
        super().__init__(Segmenter(), max_calls=1)
        self._function = function
        self._started = False
        self.num_calls = 1

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        deltas = []
        if not self._started:
            text = text.lstrip()
            if not text:
                return "", []
            self._started = True
            deltas.append(ToolCallDelta(0, id=new_call_id(), name=self._function))
        if text:  # an empty piece (the last output of a finished answer) is no argument delta
            deltas.append(ToolCallDelta(0, arguments=text))
        return "", deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        # an empty answer (cut before its first character, e.g. by a reasoning that took every
        # token) is no call: arguments "" would not be JSON
        return "", []


class NamedToolParser(ToolParser):
    """The answer of ``tool_choice: {"type": "function", "function": {"name": F}}``: F's arguments.

    The whole answer is the call's arguments, as written (the grammar made it an object that
    matches F's parameters schema; one cut by ``max_tokens`` is reported as it stands). An empty
    answer is no call.
    """

    name = "named"

    def __init__(self, function: str):
        super().__init__(max_calls=1)
        self.function = function

    def stream(self) -> ToolCallStream:
        return _NamedCallStream(self.function)

    def extract(self, text: str) -> ExtractedToolCalls:
        arguments = text.lstrip()
        return ExtractedToolCalls(None, [ParsedToolCall(self.function, arguments)] if arguments else [])
