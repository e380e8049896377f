"""Qwen3: the model opens ``<think>`` itself (or the prompt does, as in the thinking-only
2507 models); ``enable_thinking: false`` in ``chat_template_kwargs`` means no reasoning."""

from __future__ import annotations

from fastdeploy.entrypoints.openai.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """``<think>…</think>`` where the output starts in the answer unless it begins with ``<think>``
    or the prompt left one open; nothing is reasoning with ``enable_thinking`` false."""

    def starts_in_reasoning(self) -> bool:
        return self.prompt_opens_reasoning()

    def enabled(self) -> bool:
        return self.template_kwargs.get("enable_thinking", True) is not False
