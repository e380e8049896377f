"""What every tool-call parser shares: finding the calls in a model's text, whole or streamed.

A parser is a *segmenter* (``feed`` / ``finish``) that cuts the text into events:
content outside the calls, the opening marker of a call, pieces of the call's body
(a JSON object ``{"name": ..., "arguments" | "parameters": {...}}``) and its closing
marker. The same segmenter serves whole answers (:meth:`ToolParser.extract`) and
streams (:meth:`ToolParser.stream`), so both cut a text at the same places.

A whole answer keeps a call only if its body is valid JSON naming a function; any other
body goes back into the content, markers included. A stream sends a call's id and name
as soon as its body starts with ``{"name": "...", "arguments": {`` and then the
arguments as they arrive (the same text the whole answer reports); a body in another
shape is held until the call ends and then decided as a whole answer would be. A call
whose JSON breaks after its name was streamed (cut by ``max_tokens``) cannot be taken
back: it stays a call in the stream. Content is the text outside the calls, trimmed of
the whitespace around it (``None`` if nothing is left).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

CONTENT, OPEN, BODY, CLOSE = "content", "open", "body", "close"
"""Segmenter event kinds: text outside calls, a call's opening marker, a piece of its body, its end."""

Event = tuple[str, str]
"""``(kind, text)``: for ``OPEN`` / ``CLOSE`` the marker as written (may be empty)."""


def new_call_id() -> str:
    """A tool-call id in OpenAI's form: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker`` (to hold back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class JsonScanner:
    """Finds where a JSON object or array ends, fed piece by piece (strings and escapes respected).

    It checks nesting only, not full syntax: :func:`parse_call` validates a finished body.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False

    def feed(self, text: str) -> int | None:
        """Index in ``text`` just past the value's closing bracket, or None if it has not closed yet."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
"""The start of a call body whose name comes first and whose arguments are an object."""


def _header(body: str) -> tuple[str, int] | None:
    """``(name, where the arguments object starts)`` if ``body`` starts with a name-first header."""
    m = _HEADER.match(body)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    return name, m.end()


def _cut_call(body: str) -> ParsedToolCall | None:
    """The call of a body the answer ended in: its name and the partial arguments after it (None
    before the arguments start)."""
    header = _header(body)
    if header is None or len(body) <= header[1]:
        return None
    return ParsedToolCall(header[0], body[header[1] :])


@dataclass
class ParsedToolCall:
    """One call found in a model's text: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


def parse_call(body: str) -> ParsedToolCall | None:
    """The call a finished body holds, or None if it is not a JSON object naming a function.

    ``arguments`` (or ``parameters``, Llama's key) is reported as the model wrote it when it is
    an object that follows the name, else re-serialised; arguments given as a JSON string that
    encodes an object are that string; absent arguments are ``{}``.
    """
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key, {})
    if isinstance(args, str):
        try:
            if isinstance(json.loads(args), dict):
                return ParsedToolCall(obj["name"], args)
        except ValueError:
            pass
        return None
    if not isinstance(args, dict):
        return None
    header = _header(body)
    if header is not None:
        scanner = JsonScanner()
        end = scanner.feed(body[header[1] :])
        if end is not None:
            return ParsedToolCall(obj["name"], body[header[1] : header[1] + end])
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass
class ExtractedToolCalls:
    """A whole answer split into its content (text outside the calls, or None) and its calls."""

    content: str | None
    calls: list[ParsedToolCall]


@dataclass
class ToolCallDelta:
    """A streamed piece of call ``index``: its id and name the first time, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Segmenter:
    """Cuts a model's text into :data:`Event` s; one instance per answer."""

    def feed(self, text: str) -> list[Event]:
        """The events the new text completes (text that may be the start of a marker is held back)."""
        raise NotImplementedError

    def finish(self) -> list[Event]:
        """The events of the held-back text at the end of the answer (an open call is closed)."""
        raise NotImplementedError


class TaggedSegmenter(Segmenter):
    """Calls between an opening and a closing tag (``<tool_call>…</tool_call>``); text around them is
    content. A call left open at the end of the answer ends there."""

    def __init__(self, start: str, end: str):
        self.start, self.end = start, end
        self._in_call = False
        self._held = ""

    def feed(self, text: str) -> list[Event]:
        text, self._held = self._held + text, ""
        events: list[Event] = []
        while text:
            tag = self.end if self._in_call else self.start
            kind = BODY if self._in_call else CONTENT
            at = text.find(tag)
            if at < 0:
                keep = partial_suffix(text, tag)
                if len(text) > keep:
                    events.append((kind, text[: len(text) - keep]))
                self._held = text[len(text) - keep :]
                break
            if at:
                events.append((kind, text[:at]))
            events.append((CLOSE if self._in_call else OPEN, tag))
            self._in_call = not self._in_call
            text = text[at + len(tag) :]
        return events

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        events: list[Event] = [(BODY if self._in_call else CONTENT, held)] if held else []
        if self._in_call:
            events.append((CLOSE, ""))
            self._in_call = False
        return events


class _ContentStream:
    """Streams content trimmed as a whole: leading whitespace dropped, whitespace held until more
    content follows it (what is held at the end is dropped)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        out = text.rstrip()
        self._held = text[len(out) :]
        return out


class _CallStream:
    """One call being streamed: its header once the name is known, then the arguments as they come."""

    def __init__(self, index: int, opening: str):
        self.index = index
        self.opening = opening
        self.body = ""
        self.committed = False
        self._scanner: JsonScanner | None = None  # over the arguments, once committed
        self._args_done = False

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.body += text
        if not self.committed:
            header = _header(self.body)
            if header is None or len(self.body) <= header[1]:
                return []
            self.committed = True
            self._scanner = JsonScanner()
            first = ToolCallDelta(self.index, id=new_call_id(), name=header[0])
            return [first, *self._arguments(self.body[header[1] :])]
        return self._arguments(text)

    def _arguments(self, text: str) -> list[ToolCallDelta]:
        if self._args_done or self._scanner is None or not text:
            return []
        end = self._scanner.feed(text)
        if end is not None:
            self._args_done = True
            text = text[:end]
        return [ToolCallDelta(self.index, arguments=text)] if text else []


class ToolCallStream:
    """The tool calls and content of one streamed answer: :meth:`feed` each text delta, then
    :meth:`finish`; each returns ``(content delta, call deltas)``."""

    def __init__(self, segmenter: Segmenter, max_calls: int | None = None, unparsed_is_content: bool = True):
        self._segmenter = segmenter
        self._max_calls = max_calls
        self._unparsed_is_content = unparsed_is_content
        self._content = _ContentStream()
        self._call: _CallStream | None = None
        self.num_calls = 0
        """Calls started so far (their ids and names sent)."""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and call pieces that ``text`` completes."""
        return self._apply(self._segmenter.feed(text))

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What was held back, at the end of the answer."""
        return self._apply(self._segmenter.finish())

    def _apply(self, events: list[Event]) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for kind, text in events:
            if kind == CONTENT:
                content.append(self._content.feed(text))
            elif kind == OPEN:
                self._call = _CallStream(self.num_calls, text)
            elif kind == BODY and self._call is not None:
                calls.extend(self._allowed(self._call.feed(text)))
            elif kind == CLOSE and self._call is not None:
                call, self._call = self._call, None
                if not call.committed:
                    parsed = parse_call(call.body)
                    if parsed is None:
                        if self._unparsed_is_content:
                            content.append(self._content.feed(call.opening + call.body + text))
                        continue
                    calls.extend(self._allowed([ToolCallDelta(call.index, id=parsed.id, name=parsed.name)]))
                    calls.extend(self._allowed([ToolCallDelta(call.index, arguments=parsed.arguments)]))
                if self._max_calls is None or self.num_calls < self._max_calls:
                    self.num_calls += 1
        return "".join(content), calls

    def _allowed(self, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        """The deltas of calls within ``max_calls`` (``parallel_tool_calls: false`` keeps the first)."""
        if self._max_calls is None:
            return deltas
        return [d for d in deltas if d.index < self._max_calls]


class ToolParser:
    """A model family's tool-call format; subclasses give the segmenter (and a registry name).

    ``max_calls`` limits the calls reported (1 with ``parallel_tool_calls: false``; the
    others are dropped). ``needs_special_tokens``: the format's markers are special tokens,
    so the request must keep them in its text (``skip_special_tokens`` off).
    """

    name: ClassVar[str] = ""
    needs_special_tokens: ClassVar[bool] = False
    call_trigger: ClassVar[str | None] = None
    """What starts a call in free text, for the grammar of ``strict`` tools (:meth:`call_opening`);
    None: this format's calls are not held to their schemas under ``tool_choice`` auto."""
    call_closing: ClassVar[str] = ""
    """What ends a call after its arguments (with :attr:`call_trigger`)."""
    unparsed_is_content: ClassVar[bool] = True
    """A call that does not parse (its name cut by ``max_tokens``) is given back as content: in free
    text it may be the model's own words. False where a grammar wrote the call syntax (the answer
    of ``tool_choice: "required"``): it is dropped, never shown as text."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls

    @classmethod
    def call_opening(cls, name: str) -> str:
        """The text of a call of ``name`` up to its arguments (starting with :attr:`call_trigger`)."""
        raise NotImplementedError

    def segmenter(self) -> Segmenter:
        """A fresh segmenter for one answer."""
        raise NotImplementedError

    def stream(self) -> ToolCallStream:
        """A fresh incremental parse of one answer."""
        return ToolCallStream(self.segmenter(), self.max_calls, self.unparsed_is_content)

    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and calls of a whole answer. A call the answer ends inside (cut by
        ``max_tokens``) whose name is complete is that call with the arguments written so far, as
        its stream reports it (:class:`_CallStream`); with the name incomplete it is content."""
        segmenter = self.segmenter()
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        opening, body = "", ""
        events = [(event, False) for event in segmenter.feed(text)]
        events += [(event, True) for event in segmenter.finish()]
        for (kind, piece), at_end in events:
            if kind == CONTENT:
                content.append(piece)
            elif kind == OPEN:
                opening, body = piece, ""
            elif kind == BODY:
                body += piece
            else:
                parsed = parse_call(body)
                if parsed is None and at_end:
                    parsed = _cut_call(body)
                if parsed is None:
                    if self.unparsed_is_content:
                        content.append(opening + body + piece)
                elif self.max_calls is None or len(calls) < self.max_calls:
                    calls.append(parsed)
        return ExtractedToolCalls("".join(content).strip() or None, calls)
