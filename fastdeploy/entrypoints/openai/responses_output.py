"""The output items of one ``/v1/responses`` answer and the stream events that tell them, built
in one pass from the answer's streamed pieces (split into reasoning, text and tool calls by the
chat handler's ``ChoiceSplit``): a ``reasoning`` item, a ``message`` item with one
``output_text`` part, a ``function_call`` item per call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastdeploy.core.outputs import CompletionOutput
from fastdeploy.entrypoints.openai.chat_choices import ChatOptions, ChoiceSplit
from fastdeploy.entrypoints.openai.logprobs import chat_logprobs
from fastdeploy.entrypoints.openai.protocol.responses import new_id
from fastdeploy.entrypoints.openai.protocol.responses_objects import (
    function_call_item,
    message_item,
    reasoning_item,
)

Event = dict[str, Any]


@dataclass
class _OpenItem:
    """The output item being generated."""

    kind: str
    """``reasoning``, ``message`` or ``function_call``."""
    id: str
    output_index: int
    text: str = ""
    """Its reasoning or message text, or a call's arguments."""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class ResponseOutput:
    """The output items of one answer, built from its streamed pieces, and the events that tell them."""

    def __init__(self, options: ChatOptions, num_top: int | None):
        self._split = ChoiceSplit(options)
        self._num_top = num_top
        self._tokens_as_ids = options.tokens_as_ids
        self.items: list[dict[str, Any]] = []
        """The finished output items, in order."""
        self._open: _OpenItem | None = None
        self._pending_logprobs: list[dict[str, Any]] = []
        """Logprobs of tokens whose text has not come out yet (held back by a parser)."""
        self.finish_reason: str | None = None
        self.reasoning_tokens = 0
        """Output tokens whose piece was reasoning only (an estimate where a piece mixes both)."""

    def feed(self, c: CompletionOutput) -> list[Event]:
        """Take one streamed piece of the answer; the events it makes."""
        delta = self._split.delta(c)
        if c.logprobs and self._num_top is not None:
            entries = chat_logprobs(c.token_ids, c.logprobs, self._num_top, self._tokens_as_ids).content or []
            self._pending_logprobs += [e.model_dump() for e in entries]
        events: list[Event] = []
        if delta.reasoning_content:
            if not delta.content and not delta.tool_calls:
                self.reasoning_tokens += len(c.token_ids)
            item = self._switch_to("reasoning", events)
            item.text += delta.reasoning_content
            events.append(
                self._part_event("response.reasoning_text.delta", item, delta=delta.reasoning_content)
            )
        if delta.content:
            item = self._switch_to("message", events)
            item.text += delta.content
            logprobs, self._pending_logprobs = self._pending_logprobs, []
            item.logprobs += logprobs
            events.append(
                self._part_event("response.output_text.delta", item, delta=delta.content, logprobs=logprobs)
            )
        for call in delta.tool_calls or []:
            if call.id is not None:
                item = self._switch_to(
                    "function_call", events, call_id=call.id, name=call.function.name or ""
                )
            item = self._open
            if item is None or item.kind != "function_call":
                continue  # (a parser never sends arguments before the call's id)
            if call.function.arguments:
                item.text += call.function.arguments
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": item.id,
                        "output_index": item.output_index,
                        "delta": call.function.arguments,
                    }
                )
        if c.finish_reason is not None:
            self.finish_reason = self._split.finish_reason(c.finish_reason)
        return events

    def finish(self) -> list[Event]:
        """Close the last item (an empty message when the answer had none); the events that makes."""
        events: list[Event] = []
        if self._open is None and not self.items:
            self._switch_to("message", events)
        self._close(events, "completed" if self.finish_reason in ("stop", "tool_calls") else "incomplete")
        return events

    def abandon(self) -> list[Event]:
        """Close the item being generated as ``incomplete`` (the request failed); its events."""
        events: list[Event] = []
        self._close(events, "incomplete")
        return events

    # ---- items ----------------------------------------------------------------------

    def _switch_to(self, kind: str, events: list[Event], call_id: str = "", name: str = "") -> _OpenItem:
        """The open item if it is of ``kind`` (and not a new call), else a new one after closing it."""
        if self._open is not None and self._open.kind == kind and kind != "function_call":
            return self._open
        self._close(events, "completed")
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _OpenItem(kind, new_id(prefix), len(self.items), call_id=call_id, name=name)
        self._open = item
        events.append(
            {
                "type": "response.output_item.added",
                "output_index": item.output_index,
                "item": self._item(item, "in_progress"),
            }
        )
        if kind != "function_call":
            events.append(self._part_event("response.content_part.added", item, part=self._part(item, "")))
        return item

    def _close(self, events: list[Event], status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        if item.kind == "reasoning":
            events.append(self._part_event("response.reasoning_text.done", item, text=item.text))
        elif item.kind == "message":
            item.logprobs += self._pending_logprobs
            self._pending_logprobs = []
            events.append(
                self._part_event("response.output_text.done", item, text=item.text, logprobs=item.logprobs)
            )
        else:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item.id,
                    "output_index": item.output_index,
                    "name": item.name,
                    "arguments": item.text,
                }
            )
        if item.kind != "function_call":
            events.append(
                self._part_event("response.content_part.done", item, part=self._part(item, item.text))
            )
        done = self._item(item, status)
        self.items.append(done)
        events.append({"type": "response.output_item.done", "output_index": item.output_index, "item": done})

    def _item(self, item: _OpenItem, status: str) -> dict[str, Any]:
        final = status != "in_progress"
        if item.kind == "reasoning":
            out = reasoning_item(item.id, item.text, status)
            if not final:
                out["content"] = []
            return out
        if item.kind == "message":
            out = message_item(
                item.id, item.text, status, item.logprobs if self._num_top is not None else None
            )
            if not final:
                out["content"] = []
            return out
        return function_call_item(item.id, item.call_id, item.name, item.text if final else "", status)

    def _part(self, item: _OpenItem, text: str) -> dict[str, Any]:
        if item.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self._num_top is not None:
            part["logprobs"] = item.logprobs if text else []
        return part

    @staticmethod
    def _part_event(kind: str, item: _OpenItem, **fields: Any) -> Event:
        return {
            "type": kind,
            "item_id": item.id,
            "output_index": item.output_index,
            "content_index": 0,
            **fields,
        }
