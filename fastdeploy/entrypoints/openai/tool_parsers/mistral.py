"""Mistral's calls: ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` objects.

``[TOOL_CALLS]`` is a special token, so a request with tools keeps special tokens in its text.
"""

from __future__ import annotations

from fastdeploy.entrypoints.openai.tool_parsers.base import Segmenter, ToolParser
from fastdeploy.entrypoints.openai.tool_parsers.json_array import JsonArraySegmenter


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``; text before the marker is content."""

    name = "mistral"
    needs_special_tokens = True

    def segmenter(self) -> Segmenter:
        return JsonArraySegmenter("[TOOL_CALLS]")
