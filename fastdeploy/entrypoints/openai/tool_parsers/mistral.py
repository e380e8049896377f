"""Mistral's calls, in both of its formats:

- tokenizer v3 to v7 (Mistral 7B v0.3, Nemo, Small 3.1, ...): ``[TOOL_CALLS]`` and a JSON array of
  ``{"name", "arguments"}`` objects;
- tokenizer v11 and later (Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]name[ARGS]{...}`` per call.

Text before the first ``[TOOL_CALLS]`` is content. ``[TOOL_CALLS]`` is a special token, so a
request with tools keeps special tokens in its text. A v11 call is handed on as the body
``{"name": NAME, "arguments": ARGS}``; if its arguments are not valid JSON, that body (not the
text as written) is what goes back into the content.
"""

from __future__ import annotations

import json

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
from fastdeploy.entrypoints.openai.tool_parsers.json_array import JsonArraySegmenter

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_BEFORE, _AFTER_MARKER, _NAME, _ARGS_START, _IN_ARGS = (
    "before",
    "after_marker",
    "name",
    "args_start",
    "in_args",
)


class MistralSegmenter(Segmenter):
    """Finds ``[TOOL_CALLS]``, then reads a JSON array (v3 to v7) or ``name[ARGS]{...}`` calls (v11)."""

    def __init__(self) -> None:
        self._state = _BEFORE
        self._held = ""
        self._name = ""
        self._array: JsonArraySegmenter | None = None
        self._scanner: JsonScanner | None = None

    def feed(self, text: str) -> list[Event]:
        if self._array is not None:
            return self._array.feed(text)
        text, self._held = self._held + text, ""
        events: list[Event] = []
        while text:
            if self._state == _BEFORE:
                at = text.find(MARKER)
                if at < 0:
                    keep = partial_suffix(text, MARKER)
                    if len(text) > keep:
                        events.append((CONTENT, text[: len(text) - keep]))
                    self._held = text[len(text) - keep :]
                    break
                if at:
                    events.append((CONTENT, text[:at]))
                self._state, text = _AFTER_MARKER, text[at + len(MARKER) :]
            elif self._state == _AFTER_MARKER:
                stripped = text.lstrip()
                if not stripped:
                    self._held = text
                    break
                if stripped[0] == "[":
                    self._array = JsonArraySegmenter(None)
                    return events + self._array.feed(stripped)
                self._state, self._name = _NAME, ""
            elif self._state == _NAME:
                at = text.find(ARGS)
                if at < 0:
                    keep = partial_suffix(text, ARGS)
                    self._name += text[: len(text) - keep]
                    self._held = text[len(text) - keep :]
                    break
                self._name += text[:at]
                name = json.dumps(self._name.strip(), ensure_ascii=False)
                events += [(OPEN, MARKER), (BODY, f'{{"name": {name}, "arguments": ')]
                self._state, text = _ARGS_START, text[at + len(ARGS) :]
            elif self._state == _ARGS_START:
                stripped = text.lstrip()
                if not stripped:
                    break
                if stripped[0] != "{":  # not an object: the call ends here, invalid
                    events += [(BODY, "}"), (CLOSE, "")]
                    self._state, text = _BEFORE, stripped
                    continue
                self._scanner = JsonScanner()
                self._state, text = _IN_ARGS, stripped
            else:
                assert self._scanner is not None
                end = self._scanner.feed(text)
                if end is None:
                    events.append((BODY, text))
                    break
                events += [(BODY, text[:end] + "}"), (CLOSE, "")]
                self._state, text = _BEFORE, text[end:]
        return events

    def finish(self) -> list[Event]:
        if self._array is not None:
            return self._array.finish()
        held, self._held = self._held, ""
        if self._state == _BEFORE:
            return [(CONTENT, held)] if held else []
        if self._state == _AFTER_MARKER:
            return [(CONTENT, MARKER + held)]
        if self._state == _NAME:
            return [(CONTENT, MARKER + self._name + held)]
        return [(BODY, "}"), (CLOSE, "")]  # arguments cut short: the body is invalid unless complete


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``."""

    name = "mistral"
    needs_special_tokens = True

    def segmenter(self) -> Segmenter:
        return MistralSegmenter()
