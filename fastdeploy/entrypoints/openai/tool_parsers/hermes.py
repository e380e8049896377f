"""Hermes-style calls, as Qwen2.5, Qwen3 and the Hermes models write them:
``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, one block per call, text around them."""

from __future__ import annotations

import json

from fastdeploy.entrypoints.openai.tool_parsers.base import Segmenter, TaggedSegmenter, ToolParser


class HermesToolParser(ToolParser):
    """``<tool_call>…</tool_call>`` blocks holding ``{"name", "arguments"}`` JSON."""

    name = "hermes"
    call_trigger = "<tool_call>"
    call_closing = "}\n</tool_call>"

    @classmethod
    def call_opening(cls, name: str) -> str:
        """``<tool_call>`` and the call object up to its arguments, as Qwen's templates write it."""
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '

    def segmenter(self) -> Segmenter:
        return TaggedSegmenter("<tool_call>", "</tool_call>")
