"""The ``<think>…</think>`` reasoning parser that the Qwen3 and DeepSeek-R1 parsers specialise.

One state machine serves whole texts and streams alike (a whole text is one
delta followed by the end), so both always split a text the same way. Text
that may be the start of a tag is held back until the next delta decides it;
the end of the output releases it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

_START, _REASONING, _CONTENT_START, _CONTENT = "start", "reasoning", "content_start", "content"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag`` (what to hold back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """The split of one answer, delta by delta: :meth:`feed` each piece of text, then :meth:`finish`.

    Each call returns ``(reasoning, content)``, the new text of each (possibly empty).
    ``in_reasoning`` says whether the output starts inside the reasoning (the prompt
    opened it); a leading start tag is accepted either way. Without ``enabled``
    everything is content.
    """

    def __init__(self, parser: ReasoningParser, in_reasoning: bool, enabled: bool = True):
        self.start_tag, self.end_tag = parser.start_tag, parser.end_tag
        self._state = _START if enabled else _CONTENT
        self._then = _REASONING if in_reasoning else _CONTENT  # where a text without the start tag goes
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """The reasoning and content text that ``delta`` completes."""
        text, self._held = self._held + delta, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._state == _START:
                stripped = text.lstrip()
                if stripped.startswith(self.start_tag):
                    self._state, text = _REASONING, stripped[len(self.start_tag) :]
                elif self.start_tag.startswith(stripped):  # whitespace or a piece of the tag: wait
                    self._held = text
                    break
                else:
                    self._state = self._then
            elif self._state == _REASONING:
                at = text.find(self.end_tag)
                if at >= 0:
                    reasoning.append(text[:at])
                    self._state, text = _CONTENT_START, text[at + len(self.end_tag) :]
                    continue
                keep = _partial_suffix(text, self.end_tag)
                reasoning.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            elif self._state == _CONTENT_START:  # the blank lines after the end tag are no content
                text = text.lstrip()
                if text:
                    self._state = _CONTENT
            else:
                content.append(text)
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The held-back text at the end of the output: reasoning if the output ended inside it."""
        held, self._held = self._held, ""
        if self._state == _START:
            self._state = self._then
        if self._state == _REASONING:
            return held, ""
        if self._state == _CONTENT:
            return "", held
        return "", ""  # only whitespace after the end tag


class ReasoningParser:
    """A reasoning parser for the ``<think>…</think>`` style; subclasses say when the output starts
    inside the reasoning.

    One instance serves one request: ``prompt`` is the rendered prompt text and
    ``template_kwargs`` the request's ``chat_template_kwargs``.
    """

    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def __init__(self, prompt: str, template_kwargs: dict[str, Any] | None = None):
        self.prompt = prompt
        self.template_kwargs = template_kwargs or {}

    def starts_in_reasoning(self) -> bool:
        """Whether the output begins inside the reasoning (without a start tag of its own)."""
        raise NotImplementedError

    def enabled(self) -> bool:
        """Whether this request can have reasoning at all."""
        return True

    def prompt_opens_reasoning(self) -> bool:
        """Whether the prompt ends inside a reasoning block (its last start tag is not closed)."""
        return self.prompt.rfind(self.start_tag) > self.prompt.rfind(self.end_tag)

    def stream(self) -> ReasoningStream:
        """A fresh incremental split of one answer."""
        return ReasoningStream(self, self.starts_in_reasoning(), self.enabled())

    def count_reasoning_tokens(self, token_ids: Sequence[int], text: str, tokenizer: Any) -> int:
        """How many of an answer's tokens (``token_ids``, its ``text``) are its reasoning, the tags
        not counted, for ``usage.completion_tokens_details.reasoning_tokens``: by the tags' ids where
        each tag is one token (Qwen3's and DeepSeek-R1's are), else the reasoning text re-tokenized."""
        if not self.enabled() or not token_ids:
            return 0
        start, end = _single_token_id(tokenizer, self.start_tag), _single_token_id(tokenizer, self.end_tag)
        if start is None or end is None:
            reasoning, _ = self.extract(text)
            return len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        opens = token_ids[0] == start
        if not (opens or self.starts_in_reasoning()):
            return 0
        count = 0
        for token in token_ids[1:] if opens else token_ids:
            if token == end:
                break
            count += 1
        return count

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole answer; None for an empty part."""
        stream = self.stream()
        parts = [stream.feed(text), stream.finish()]
        reasoning = "".join(p[0] for p in parts)
        content = "".join(p[1] for p in parts)
        return reasoning or None, content or None


def _single_token_id(tokenizer: Any, tag: str) -> int | None:
    """The id of ``tag`` when the tokenizer has it as one token, else None."""
    try:
        ids = tokenizer.encode(tag, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - a tokenizer without encode: count by text
        return None
    return ids[0] if len(ids) == 1 else None
