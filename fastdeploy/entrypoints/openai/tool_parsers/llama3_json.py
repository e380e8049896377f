"""Llama 3.x JSON calls: the answer is ``{"name": "f", "parameters": {...}}`` (or ``"arguments"``),
possibly after ``<|python_tag|>``, several separated by ``;``.

An answer that starts with ``{`` (or ``<|python_tag|>``) starts with calls; otherwise text up to a
``<|python_tag|>`` is content. Text after the last call is content. An object that is not a call
(plain JSON the user asked for) stays content.
"""

from __future__ import annotations

from fastdeploy.entrypoints.openai.tool_parsers.base import (
    BODY,
    CLOSE,
    CONTENT,
    OPEN,
    Event,
    JsonScanner,
    Segmenter,
    ToolParser,
    partial_suffix,
)

PYTHON_TAG = "<|python_tag|>"
_START, _OUT, _CALLS, _IN_CALL, _AFTER = "start", "out", "calls", "in_call", "after"


class Llama3JsonSegmenter(Segmenter):
    """Cuts ``[content <|python_tag|>] {call}; {call} content`` into events."""

    def __init__(self) -> None:
        self._state = _START
        self._held = ""
        self._scanner: JsonScanner | None = None

    def feed(self, text: str) -> list[Event]:
        text, self._held = self._held + text, ""
        events: list[Event] = []
        while text:
            if self._state == _START:
                stripped = text.lstrip()
                if stripped.startswith(PYTHON_TAG):
                    self._state, text = _CALLS, stripped[len(PYTHON_TAG) :]
                elif stripped.startswith("{"):
                    self._state = _CALLS
                elif PYTHON_TAG.startswith(stripped):  # whitespace or a piece of the tag: wait
                    self._held = text
                    break
                else:
                    self._state = _OUT
            elif self._state == _OUT:
                at = text.find(PYTHON_TAG)
                if at < 0:
                    keep = partial_suffix(text, PYTHON_TAG)
                    if len(text) > keep:
                        events.append((CONTENT, text[: len(text) - keep]))
                    self._held = text[len(text) - keep :]
                    break
                if at:
                    events.append((CONTENT, text[:at]))
                self._state, text = _CALLS, text[at + len(PYTHON_TAG) :]
            elif self._state == _CALLS:
                stripped = text.lstrip(" \t\r\n;")
                if not stripped:
                    self._held = text
                    break
                if stripped[0] == "{":
                    self._scanner = JsonScanner()
                    events.append((OPEN, ""))
                    self._state, text = _IN_CALL, stripped
                else:
                    self._state, text = _AFTER, stripped
            elif self._state == _IN_CALL:
                assert self._scanner is not None
                end = self._scanner.feed(text)
                if end is None:
                    events.append((BODY, text))
                    break
                events += [(BODY, text[:end]), (CLOSE, "")]
                self._state, text = _CALLS, text[end:]
            else:
                events.append((CONTENT, text))
                break
        return events

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        if self._state == _IN_CALL:
            self._state = _AFTER
            return [(CLOSE, "")]
        if self._state in (_START, _OUT) and held:
            return [(CONTENT, held)]
        return []


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3 JSON tool calls (``{"name", "parameters"}``)."""

    name = "llama3_json"

    def segmenter(self) -> Segmenter:
        return Llama3JsonSegmenter()
