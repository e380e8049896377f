"""Tool-call parsers: find the function calls in a model's answer, whole or streamed.

``--tool-call-parser NAME`` picks one from :data:`TOOL_PARSERS`; without it the chat
template decides (:func:`default_tool_parser_name`). A new format is one module with a
:class:`ToolParser` subclass (its :class:`Segmenter`) plus one entry in the registry.
Forced calls (``tool_choice`` ``"required"`` or a named function) are read by the parsers
of :mod:`.forced`, whatever the model's format, since a grammar wrote them.
"""

from __future__ import annotations

import re

from fastdeploy.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)
from fastdeploy.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from fastdeploy.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from fastdeploy.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from fastdeploy.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
"""Every tool-call parser, by the name ``--tool-call-parser`` takes."""
TOOL_PARSER_ALIASES: dict[str, str] = {"qwen25": "hermes", "qwen": "hermes", "llama3": "llama3_json"}
"""SGLang's names of the same formats (its ``--tool-call-parser qwen25`` is hermes' ``<tool_call>``)."""


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class called ``name`` (or an alias of it); ``ValueError`` listing the available
    names otherwise."""
    try:
        return TOOL_PARSERS[TOOL_PARSER_ALIASES.get(name, name)]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; available: {', '.join(sorted(TOOL_PARSERS))}"
        ) from None


def default_tool_parser_name(chat_template: str | None) -> str:
    """The parser for a model whose chat template is ``chat_template``, when none is configured.

    A template that writes ``<tool_call>`` is hermes; ``[TOOL_CALLS]`` is mistral;
    ``<|python_tag|>`` or the ``ipython`` role is llama3_json. Any other template (one that
    does not render tools at all, such as the default model's) gets hermes, the format the
    server itself describes the tools in for such templates (``tool_template.py``).
    """
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or re.search(r"\bipython\b", template):
        return "llama3_json"
    return "hermes"


__all__ = [
    "TOOL_PARSER_ALIASES",
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolParser",
    "ParsedToolCall",
    "RequiredToolParser",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "default_tool_parser_name",
    "get_tool_parser",
]
