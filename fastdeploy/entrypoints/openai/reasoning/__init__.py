"""Reasoning parsers: split a model's thinking (``<think>…</think>``) from its answer.

``--reasoning-parser NAME`` picks one from :data:`REASONING_PARSERS`; the chat
handler then reports the thinking as ``reasoning_content`` (and ``reasoning``)
and the rest as ``content``, whole or streamed. A new parser is one module
with a :class:`ReasoningParser` subclass plus one entry in the registry.
"""

from __future__ import annotations

from fastdeploy.entrypoints.openai.reasoning.base import ReasoningParser, ReasoningStream
from fastdeploy.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from fastdeploy.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
"""Every reasoning parser, by the name ``--reasoning-parser`` takes."""


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class called ``name`` (hyphens read as underscores: SGLang spells it
    ``deepseek-r1``); ``ValueError`` listing the available names otherwise."""
    try:
        return REASONING_PARSERS[name.replace("-", "_")]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; available: {', '.join(sorted(REASONING_PARSERS))}"
        ) from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
]
