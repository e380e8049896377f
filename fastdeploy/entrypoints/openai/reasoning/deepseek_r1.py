"""DeepSeek-R1: the chat template opens ``<think>`` in the prompt, so the output starts inside the
reasoning and only ``</think>`` appears (a leading ``<think>``, as older R1 templates let the model
write, is skipped)."""

from __future__ import annotations

from fastdeploy.entrypoints.openai.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """``<think>…</think>`` where the output always starts inside the reasoning."""

    def starts_in_reasoning(self) -> bool:
        return True
