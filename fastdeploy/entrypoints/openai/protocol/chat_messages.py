"""Chat messages as requests carry them: roles, text and multimodal feature content parts, the
fields OpenAI's clients send back, and the checks of a message list (shared by
``/v1/chat/completions`` and ``/tokenize``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fastdeploy.entrypoints.openai.content_format import PARTS_KEY
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol.common import OpenAIModel, warn_once
from fastdeploy.entrypoints.openai.protocol.tools import ToolCallIn
from fastdeploy.multimodal.parts import is_feature_part


class TextContentPart(OpenAIModel):
    """A ``{"type": "text", "text": ...}`` content part; other fields of it are kept for templates
    that read them (``--chat-template-content-format openai``), as vLLM keeps them."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
"""The roles of OpenAI's chat messages (its deprecated ``function`` role aside)."""

DEPRECATED_ROLES = frozenset({"function"})
"""OpenAI's deprecated roles: a ``function`` message answers a ``function_call`` (the template is shown
it as a ``tool`` message); not an extension, so ``--strict-request-fields`` accepts it."""

ASSISTANT_FIELDS = frozenset({"refusal", "audio", "function_call", "annotations"})
"""OpenAI's fields of an assistant message beyond the declared ones: ``refusal``, ``audio`` and the
deprecated ``function_call`` of its request schema, and ``annotations``, which the openai client's
``ChatCompletionMessage.model_dump()`` adds when an answer is sent back as it came. Not extensions
(``--strict-request-fields`` accepts them); not handed to the chat template (a ``refusal`` without
content is shown as the content, a ``function_call`` as the message's tool call)."""


class ChatMessage(OpenAIModel):
    """One message of a chat. ``content`` is a string or a list of content parts.

    Text parts are joined into a string. Parts carrying precomputed image / video
    features (``image_feature_url``, ``video_feature_url``, ``image_embeds``; see
    docs/multimodal.md) keep the content a list of parts, in order. An assistant
    message may carry the ``tool_calls`` it made (its content then may be null); a
    ``tool`` message answers the call ``tool_call_id``.

    As vLLM does, a message may have a role outside OpenAI's (a custom role the chat
    template renders as it is) and fields outside OpenAI's (``model_extra``: handed to the
    chat template with the message, which may use them); both are refused with
    ``--strict-request-fields`` (:meth:`ChatCompletionRequest.refuse_extensions`).
    """

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    _text_parts: list[dict[str, Any]] | None = PrivateAttr(default=None)
    """The text parts ``content`` was joined from, as the client sent them (their extra fields
    too), for ``--chat-template-content-format openai``."""

    @model_validator(mode="wrap")
    @classmethod
    def _keep_text_parts(cls, data: Any, handler: Any) -> ChatMessage:
        message = handler(data)
        raw = data.get("content") if isinstance(data, dict) else None
        if isinstance(raw, list) and isinstance(message.content, str):  # text parts only (checked)
            message._text_parts = [
                {"type": "text", "text": part["refusal"]} if part.get("type") == "refusal" else dict(part)
                for part in raw
            ]
        return message

    @field_validator("content", mode="before")
    @classmethod
    def _join_parts(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content parts")
        parts: list[dict[str, Any]] = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if is_feature_part(part):
                parts.append(part)
                continue
            if kind == "refusal" and info.data.get("role") == "assistant":
                # OpenAI's refusal part of an assistant message: its text (as vLLM reads it)
                parts.append({"type": "text", "text": _refusal_text(part, i)})
                continue
            if kind != "text":
                raise ValueError(
                    f"content part {i}: type {kind!r} is not supported (only 'text', 'refusal' in "
                    "assistant messages, and the feature parts 'image_feature_url', 'video_feature_url', "
                    "'image_embeds')"
                    if kind
                    else f"content part {i} must be an object with a 'type'"
                )
            try:
                parts.append({"type": "text", "text": TextContentPart.model_validate(part).text})
            except ValidationError as exc:
                raise ValueError(f"content part {i}: {exc.errors()[0]['msg']}") from None
        if any(p["type"] != "text" for p in parts):
            return parts
        return "\n".join(p["text"] for p in parts)

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it (``developer`` is shown as ``system``); ``content``
        stays a list of parts when it carries image / video features.

        As ``transformers`` templates expect: an assistant message with ``tool_calls`` keeps a null
        content, and each call's ``arguments`` is given as the object its JSON text encodes. OpenAI's
        deprecated shapes are shown as the current ones: an assistant's ``function_call`` as its one
        tool call, a ``function`` message as a ``tool`` message.
        """
        extra = dict(self.model_extra or {})
        known = (
            {key: extra.pop(key) for key in ASSISTANT_FIELDS & set(extra)} if self.role == "assistant" else {}
        )
        legacy = known.get("function_call") if not self.tool_calls else None
        legacy_call = isinstance(legacy, dict) and isinstance(legacy.get("name"), str)
        refusal = known.get("refusal")
        msg: dict[str, Any] = {
            "role": {"developer": "system", "function": "tool"}.get(self.role, self.role),
            "content": None
            if self.content is None and (self.tool_calls or legacy_call)
            else (self.content or (refusal if isinstance(refusal, str) else "")),
        }
        if legacy_call:
            arguments = legacy.get("arguments")
            function = {
                "name": legacy["name"],
                "arguments": _arguments(arguments if isinstance(arguments, str) else "{}"),
            }
            msg["tool_calls"] = [{"id": "call_0", "type": "function", "function": function}]
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        for key, value in extra.items():  # (the template may use them, as in vLLM)
            msg.setdefault(key, value)
        if self._text_parts is not None:
            msg[PARTS_KEY] = self._text_parts
        return msg


def _refusal_text(part: dict[str, Any], i: int) -> str:
    """The text of a ``{"type": "refusal", "refusal": TEXT}`` content part (a 400 if it has none)."""
    text = part.get("refusal")
    if not isinstance(text, str):
        raise ValueError(f"content part {i}: a 'refusal' part needs a string 'refusal'")
    extra = next((key for key in part if key not in ("type", "refusal")), None)
    if extra is not None:
        raise ValueError(f"content part {i}: a 'refusal' part has no field {extra[:100]!r}")
    return text


def _arguments(text: str) -> Any:
    """A call's arguments as templates render them: the object its JSON encodes, else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def message_extensions(messages: list[ChatMessage]) -> Iterator[tuple[int, str | None]]:
    """What the messages carry beyond OpenAI's protocol, in order: ``(i, None)`` for message ``i``'s
    role outside OpenAI's, ``(i, field)`` for each of its own fields."""
    for i, msg in enumerate(messages):
        if msg.role not in OPENAI_ROLES and msg.role not in DEPRECATED_ROLES:
            yield i, None
        known = ASSISTANT_FIELDS if msg.role == "assistant" else frozenset()
        for key in msg.model_extra or {}:
            if key not in known:
                yield i, key


def refuse_message_extensions(messages: list[ChatMessage]) -> None:
    """Under ``--strict-request-fields``: a 400 for a message's role or field outside OpenAI's."""
    for i, key in message_extensions(messages):
        if key is None:
            raise BadRequestError(
                f"messages[{i}].role: {messages[i].role[:100]!r} is not one of {', '.join(sorted(OPENAI_ROLES))}",
                param=f"messages[{i}].role",
            )
        param = f"messages[{i}].{key[:100]}"
        raise BadRequestError(f"Unrecognized request argument supplied: {param}", param=param)
    for i, msg in enumerate(messages):  # a text part's own fields (for --chat-template-content-format openai)
        for j, part in enumerate(msg._text_parts or []):
            extra = next((key for key in part if key not in ("type", "text")), None)
            if extra is not None:
                param = f"messages[{i}].content[{j}].{extra[:100]}"
                raise BadRequestError(f"Unrecognized request argument supplied: {param}", param=param)


def check_messages(value: list[ChatMessage]) -> list[ChatMessage]:
    if not value:
        raise ValueError("must not be empty")
    for i, key in message_extensions(value):
        if key is None:
            role = value[i].role[:100]
            warn_once(
                f"role:{role}",
                f"A chat message has the role {role!r}, outside OpenAI's: the chat template renders it as "
                "it is (start the server with --strict-request-fields to refuse such requests)",
            )
        else:
            warn_once(
                f"message-field:{key[:100]}",
                f"A chat message has the field {key[:100]!r}, outside OpenAI's: it is handed to the chat "
                "template with the message (start the server with --strict-request-fields to refuse it)",
            )
    for i, msg in enumerate(value):
        if msg.content is None and msg.role != "assistant":
            raise ValueError(f"message {i} ({msg.role}) has no content")
        if msg.tool_calls is not None and msg.role != "assistant":
            raise ValueError(f"message {i} ({msg.role}): only assistant messages have tool_calls")
        if (msg.tool_call_id is None) == (msg.role == "tool"):
            raise ValueError(
                f"message {i}: a tool message needs a tool_call_id"
                if msg.role == "tool"
                else f"message {i} ({msg.role}): only tool messages have a tool_call_id"
            )
    return value
