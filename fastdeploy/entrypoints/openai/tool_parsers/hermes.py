"""Hermes-style calls, as Qwen2.5, Qwen3 and the Hermes models write them:
``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, one block per call, text around them."""

from __future__ import annotations

from fastdeploy.entrypoints.openai.tool_parsers.base import Segmenter, TaggedSegmenter, ToolParser


class HermesToolParser(ToolParser):
    """``<tool_call>…</tool_call>`` blocks holding ``{"name", "arguments"}`` JSON."""

    name = "hermes"

    def segmenter(self) -> Segmenter:
        return TaggedSegmenter("<tool_call>", "</tool_call>")
