"""Calls as a JSON array of ``{"name": ..., "arguments": {...}}`` objects, after an optional marker.

Mistral writes ``[TOOL_CALLS][{...}, {...}]``; a forced ``tool_choice: "required"`` answer is such
an array from its first character (``{"name": ..., "parameters": {...}}`` items). Text before the
marker, and after the array, is content; an array that goes wrong (an item that is not an object)
ends there and the rest of the text is content.
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
    partial_suffix,
)

_BEFORE, _ARRAY_START, _BETWEEN, _IN_CALL, _AFTER = "before", "array_start", "between", "in_call", "after"


class JsonArraySegmenter(Segmenter):
    """Cuts ``content marker [ {call}, {call} ] content`` into events (no marker: the array starts
    the text)."""

    def __init__(self, marker: str | None):
        self.marker = marker
        self._state = _BEFORE if marker else _ARRAY_START
        self._held = ""
        self._scanner: JsonScanner | None = None

    def feed(self, text: str) -> list[Event]:
        text, self._held = self._held + text, ""
        events: list[Event] = []
        while text:
            if self._state == _BEFORE:
                assert self.marker is not None
                at = text.find(self.marker)
                if at < 0:
                    keep = partial_suffix(text, self.marker)
                    if len(text) > keep:
                        events.append((CONTENT, text[: len(text) - keep]))
                    self._held = text[len(text) - keep :]
                    break
                if at:
                    events.append((CONTENT, text[:at]))
                self._state, text = _ARRAY_START, text[at + len(self.marker) :]
            elif self._state in (_ARRAY_START, _BETWEEN):
                stripped = text.lstrip() if self._state == _ARRAY_START else text.lstrip(" \t\r\n,")
                if not stripped:  # only separators so far: wait for what follows them
                    self._held = text
                    break
                expected = "[" if self._state == _ARRAY_START else "{"
                if stripped[0] == expected and expected == "[":
                    self._state, text = _BETWEEN, stripped[1:]
                elif stripped[0] == expected:
                    self._scanner = JsonScanner()
                    events.append((OPEN, ""))
                    self._state, text = _IN_CALL, stripped
                elif stripped[0] == "]" and self._state == _BETWEEN:
                    self._state, text = _AFTER, stripped[1:]
                else:  # not an array of objects: the rest is content
                    self._state = _AFTER
                    text = (self.marker or "") + text if expected == "[" else stripped
            elif self._state == _IN_CALL:
                assert self._scanner is not None
                end = self._scanner.feed(text)
                if end is None:
                    events.append((BODY, text))
                    break
                events += [(BODY, text[:end]), (CLOSE, "")]
                self._state, text = _BETWEEN, text[end:]
            else:
                events.append((CONTENT, text))
                break
        return events

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        if self._state == _IN_CALL:
            self._state = _AFTER
            return [(CLOSE, "")]
        return [(CONTENT, held)] if held else []
