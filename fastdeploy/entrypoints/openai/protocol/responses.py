"""``POST /v1/responses`` (OpenAI's Responses API): the request and its translation to a chat
request (the response object and its output items: :mod:`.responses_objects`).

A Responses request is served as the chat request it amounts to: ``instructions`` become the
first (system) message, then the stored conversation of ``previous_response_id``, then the
``input`` items (messages, the assistant's earlier ``function_call`` items and the client's
``function_call_output`` items); ``text.format`` becomes ``response_format``, ``tools`` (function
tools, flat) become chat tools, ``max_output_tokens`` the output limit. So structured outputs,
tool calling (forced calls under a grammar) and the reasoning split behave as on
``/v1/chat/completions``. A 400 from that translation names the Responses field
(:func:`responses_error`).

Every field of OpenAI's create-response request is declared: used, ignored with a warning
logged once (:attr:`ResponsesRequest.IGNORED_FIELDS`), or, where ignoring would change what the
client gets (``conversation``, ``prompt``, hosted tools), a 400 that says so.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, ClassVar, Literal

from pydantic import ValidationError

from fastdeploy.core.sampling_params import ALL_LOGPROBS
from fastdeploy.entrypoints.openai.errors import BadRequestError, encodable, from_pydantic
from fastdeploy.entrypoints.openai.protocol.chat import ChatCompletionRequest
from fastdeploy.entrypoints.openai.protocol.common import OpenAIModel, warn_once
from fastdeploy.entrypoints.openai.protocol.sampling import SamplingControls
from fastdeploy.multimodal.parts import is_feature_part

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` value that asks for the output text's logprobs."""
INCLUDE_VALUES = (
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    LOGPROBS_INCLUDE,
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
)
"""OpenAI's ``include`` values: any other is a 400, as OpenAI answers it (those but the logprobs
one add nothing here and are accepted with a warning)."""


def new_id(prefix: str) -> str:
    """An id as OpenAI's Responses API writes them: ``resp_<hex>``, ``msg_<hex>``, ``fc_<hex>``..."""
    return f"{prefix}_{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- request


class ResponsesTextConfig(OpenAIModel):
    """``text``: the output format (``{"type": "text" | "json_object" | "json_schema", ...}``)."""

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesReasoning(OpenAIModel):
    """``reasoning``: effort and summary settings of reasoning models (accepted, ignored)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(OpenAIModel):
    """``stream_options``: ``include_obfuscation`` (accepted, ignored: events are not padded)."""

    include_obfuscation: bool | None = None


_NOT_USED = "this server does not use it"
_PREFIX_CACHE = "the prefix cache is automatic and shared; its keys and lifetime cannot be set"


class ResponsesRequest(SamplingControls):
    """``POST /v1/responses``: OpenAI's fields, plus, as extensions, the chat endpoint's
    :class:`SamplingControls` (``top_k``, ``min_p``, penalties, ``seed``, ``stop``, ``ignore_eos``...)
    and ``chat_template_kwargs``."""

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoning | None = None
    include: list[str] | None = None
    store: bool | None = None
    """Keep the response for ``GET /v1/responses/{id}`` and ``previous_response_id`` (default true,
    as OpenAI's)."""
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    """Up to 16 string pairs, returned with the response."""
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    context_management: list[Any] | None = None
    moderation: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """An extension, as on /v1/chat/completions (the others: :class:`SamplingControls`)."""

    IGNORED_FIELDS: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {
        "user": ("end-user ids are not used by this server", (None,)),
        "safety_identifier": ("end-user ids are not used by this server", (None,)),
        "service_tier": ("this server has a single service tier", (None, "auto", "default")),
        "prompt_cache_key": (_PREFIX_CACHE, (None,)),
        "prompt_cache_retention": (_PREFIX_CACHE, (None,)),
        "prompt_cache_options": (_PREFIX_CACHE, (None,)),
        "truncation": ("a conversation longer than the context is a 400, never cut", (None, "disabled")),
        "max_tool_calls": (_NOT_USED, (None,)),
        "context_management": (_NOT_USED, (None,)),
        "moderation": ("this server does no moderation", (None,)),
    }
    """Fields accepted and ignored: name → (why, the values that need no warning)."""

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "conversation": "the Conversations API is not supported by this server; use "
        "'previous_response_id' to continue a conversation",
        "prompt": "prompt templates are not supported by this server; send 'instructions' and 'input'",
    }
    """Fields that would change the answer if ignored: anything but off is a 400."""

    @property
    def stores(self) -> bool:
        """Whether the response is kept (``store`` defaults to true)."""
        return self.store is not False

    @property
    def wants_logprobs(self) -> bool:
        """Whether the output text carries logprobs (``include`` asks, or ``top_logprobs`` > 0)."""
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)

    def check_supported(self) -> None:
        """A 400 for what this server cannot do; a warning (once) for each ignored field."""
        for name, why in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and value is not False:
                raise BadRequestError(why, param=name)
        if self.background and not self.stores:
            raise BadRequestError("background can only be used when `store` is true", param="background")
        if self.background and self.stream:
            raise BadRequestError(
                "a background response cannot be streamed here; poll GET /v1/responses/{id} instead",
                param="stream",
            )
        if self.input is None and self.previous_response_id is None:
            raise BadRequestError("'input' is required", param="input")
        if self.top_logprobs is not None and self.top_logprobs < ALL_LOGPROBS:
            raise BadRequestError(
                f"top_logprobs must be at least 0 (or -1: the whole vocabulary), got {self.top_logprobs}",
                param="top_logprobs",
            )
        if self.metadata is not None and len(self.metadata) > 16:
            raise BadRequestError("metadata holds at most 16 pairs", param="metadata")
        for name, (why, quiet) in self.IGNORED_FIELDS.items():
            if getattr(self, name) not in quiet:
                warn_once(f"responses:{name}", f"The request field '{name}' is accepted but ignored: {why}")
        ignored = {
            "text.verbosity": self.text is not None and self.text.verbosity is not None,
            "reasoning": self.reasoning is not None and self.reasoning.model_dump(exclude_none=True) != {},
            "stream_options.include_obfuscation": bool(
                self.stream_options and self.stream_options.include_obfuscation
            ),
        }
        for name, given in ignored.items():
            if given:
                warn_once(
                    f"responses:{name}",
                    f"The request field '{name}' is accepted but ignored: the served model's "
                    "reasoning and verbosity cannot be set, and events are not padded",
                )
        for i, value in enumerate(self.include or []):
            if value not in INCLUDE_VALUES:
                raise BadRequestError(
                    f"Invalid value: {encodable(value[:100])!r}. Supported values are: "
                    + ", ".join(repr(v) for v in INCLUDE_VALUES),
                    param=f"include[{i}]",
                    code="invalid_value",
                )
            if value != LOGPROBS_INCLUDE:
                shown = encodable(value[:100])
                warn_once(
                    f"responses:include:{shown}",
                    f"'include' value {shown!r} is accepted but ignored (only {LOGPROBS_INCLUDE!r} "
                    "adds anything here)",
                )

    def input_messages(self) -> list[dict[str, Any]]:
        """The ``input`` items as chat messages (dicts, as a chat request's ``messages``)."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            _add_input_item(messages, item, f"input[{i}]")
        return messages

    def to_chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this request amounts to, ``history`` (the stored conversation of
        ``previous_response_id``) between the instructions and the input."""
        self.check_supported()
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += history + self.input_messages()
        if not messages:
            raise BadRequestError("'input' must not be empty", param="input")
        tools, choice = _chat_tools(self.tools, self.tool_choice)
        data: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": False,
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "max_completion_tokens": self.max_output_tokens,
            "response_format": _response_format(self.text),
        }
        if self.wants_logprobs:
            data["logprobs"], data["top_logprobs"] = True, self.top_logprobs or 0
        for name in ("temperature", "top_p", "chat_template_kwargs", *SamplingControls.model_fields):
            data[name] = getattr(self, name)
        data = {k: v for k, v in data.items() if v is not None}
        try:
            return ChatCompletionRequest.model_validate(data)
        except ValidationError as exc:
            raise responses_error(from_pydantic(exc)) from None


def _add_input_item(messages: list[dict[str, Any]], item: Any, param: str) -> None:
    """Append one ``input`` item to ``messages`` as chat messages (a 400 naming ``param`` if wrong)."""
    if not isinstance(item, dict):
        raise BadRequestError(f"{param} must be an object", param=param)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise BadRequestError(
                f"{param}.role must be 'user', 'system', 'developer' or 'assistant', got {role!r}",
                param=f"{param}.role",
            )
        messages.append({"role": role, "content": _content(item.get("content"), f"{param}.content")})
    elif kind == "function_call":
        call = {
            "id": _text_field(item, "call_id", param),
            "type": "function",
            "function": {
                "name": _text_field(item, "name", param),
                "arguments": _text_field(item, "arguments", param),
            },
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # the calls of one assistant turn
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _content(output, f"{param}.output")
        if not isinstance(text, str):
            raise BadRequestError(f"{param}.output must be text", param=f"{param}.output")
        messages.append(
            {"role": "tool", "tool_call_id": _text_field(item, "call_id", param), "content": text}
        )
    elif kind == "reasoning":
        pass  # earlier reasoning is not shown to the model again (as chat templates drop it)
    else:
        raise BadRequestError(
            f"{param}: input items of type {kind!r} are not supported (message, function_call, "
            "function_call_output and reasoning are)",
            param=f"{param}.type",
        )


def _text_field(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise BadRequestError(f"{param}.{name} must be a string", param=f"{param}.{name}")
    return value


_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
"""Content part types that are text, and the key of their text."""


def _content(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: its text parts joined, or a list when it holds
    feature parts (``image_feature_url``...; docs/multimodal.md)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequestError(f"{param} must be a string or a list of content parts", param=param)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            key = _TEXT_PARTS[kind]
            if not isinstance(part.get(key), str):  # (a known part with its text missing)
                raise BadRequestError(
                    f"{param}[{j}].{key} must be a string (a {kind!r} part is "
                    f'{{"type": "{kind}", "{key}": TEXT}})',
                    param=f"{param}[{j}].{key}",
                )
            parts.append({"type": "text", "text": part[key]})
        elif is_feature_part(part):
            parts.append(part)
        else:
            hint = (
                " (this server takes images as precomputed features: 'image_feature_url' parts, "
                "docs/multimodal.md)"
                if kind == "input_image"
                else ""
            )
            raise BadRequestError(
                f"{param}[{j}]: content part type {kind!r} is not supported{hint}", param=f"{param}[{j}]"
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _chat_tools(tools: list[dict[str, Any]] | None, choice: Any) -> tuple[list[dict] | None, Any]:
    """Responses ``tools`` (flat function tools) and ``tool_choice`` in the chat request's shapes.

    ``tool_choice`` ``auto`` is the Responses default with or without tools (a response reports it with
    ``tools: []``), so it is accepted without tools, as OpenAI accepts it and clients send it (the
    OpenAI Agents SDK with a run-wide ``tool_choice`` and an agent without tools); ``required`` or a
    named function without tools stays a 400, as in OpenAI's API."""
    out = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise BadRequestError(
                f"tools[{i}]: tools of type {kind!r} are not supported (only 'function': this server "
                "runs no hosted tools)",
                param=f"tools[{i}].type",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
        }
        out.append({"type": "function", "function": function})
    if isinstance(choice, str) and choice not in _TOOL_CHOICE_MODES:
        raise BadRequestError(
            f"Invalid value: {encodable(choice[:100])!r}. tool_choice must be {_TOOL_CHOICE_SHAPES}",
            param="tool_choice",
            code="invalid_value",
        )
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            name = choice.get("name")
            if not isinstance(name, str):  # (not the chat shape's {"function": {"name": ...}})
                raise BadRequestError(
                    "Missing required parameter: 'tool_choice.name' (a function tool_choice is "
                    '{"type": "function", "name": NAME})',
                    param="tool_choice.name",
                )
            choice = {"type": "function", "function": {"name": name}}
        elif kind == "allowed_tools":
            choice, out = _allowed_tools(choice, out)
        else:
            raise BadRequestError(
                f"tool_choice of type {kind!r} is not supported: tool_choice must be {_TOOL_CHOICE_SHAPES}",
                param="tool_choice",
            )
    if not out and choice == "auto":
        choice = None  # (OpenAI's default whatever the tools: with none, a plain answer, not a 400)
    return out or None, choice


_TOOL_CHOICE_MODES = ("none", "auto", "required")
_TOOL_CHOICE_SHAPES = (
    "'none', 'auto', 'required', {\"type\": \"function\", \"name\": NAME} or "
    '{"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type": "function", "name": NAME}, ...]}'
)
"""The ``tool_choice`` values of the Responses API (as error messages list them)."""


def _allowed_tools(choice: dict[str, Any], tools: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """An ``allowed_tools`` ``tool_choice``: its mode and the offered tools narrowed to those it
    names (each must be one of ``tools``, as a named function choice must)."""
    mode = choice.get("mode", "auto")
    if mode not in ("auto", "required"):
        raise BadRequestError(
            f"Invalid value: {encodable(str(mode)[:100])!r}. tool_choice.mode must be 'auto' or 'required'",
            param="tool_choice.mode",
            code="invalid_value",
        )
    listed = choice.get("tools")
    if not isinstance(listed, list):
        raise BadRequestError(
            'tool_choice.tools must be a list of tools ({"type": "function", "name": NAME})',
            param="tool_choice.tools",
        )
    names = {t["function"]["name"] for t in tools}
    allowed = set()
    for i, tool in enumerate(listed):
        name = tool.get("name") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(name, str):
            raise BadRequestError(
                f'tool_choice.tools[{i}] must be {{"type": "function", "name": NAME}} (only function '
                "tools are supported)",
                param=f"tool_choice.tools[{i}]",
            )
        if name not in names:
            raise BadRequestError(
                f"Tool {encodable(name[:100])!r} not found in tools list: tool_choice.tools must name "
                "functions of tools",
                param=f"tool_choice.tools[{i}].name",
            )
        allowed.add(name)
    return mode, [t for t in tools if t["function"]["name"] in allowed]


def _response_format(text: ResponsesTextConfig | None) -> dict[str, Any] | None:
    """``text.format`` as the chat request's ``response_format``."""
    fmt = None if text is None else text.format
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if fmt.get("schema") is None:  # (flat, unlike chat's response_format.json_schema.schema)
            raise BadRequestError(
                "Missing required parameter: 'text.format.schema' (a json_schema format is "
                '{"type": "json_schema", "name": NAME, "schema": {...}, "strict": ...})',
                param="text.format.schema",
            )
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequestError(
        f"text.format.type must be 'text', 'json_object' or 'json_schema', got {fmt.get('type')!r}",
        param="text.format.type",
    )


_PARAM_NAMES = (
    (re.compile(r"^messages\b.*"), "input"),
    (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
    (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"^logprobs"), "include"),
)
"""A chat request's field → the Responses field it came from."""


def responses_error(exc: BadRequestError) -> BadRequestError:
    """``exc`` (raised for the chat request a Responses request became) naming the Responses field."""
    if exc.param is None:
        return exc
    param = exc.param
    for pattern, name in _PARAM_NAMES:
        if pattern.match(param):
            param = pattern.sub(name, param, count=1)
            break
    if param == exc.param:
        return exc
    message = exc.message.replace(f"'{exc.param}'", f"'{param}'").replace(exc.param, param)
    return BadRequestError(
        message.replace("max_completion_tokens", "max_output_tokens"), param=param, code=exc.code
    )


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as the item list ``GET /v1/responses/{id}/input_items`` returns (each
    item with an id)."""
    items = (
        [{"role": "user", "content": request.input}]
        if isinstance(request.input, str)
        else request.input or []
    )
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
        item.setdefault("id", new_id({"message": "msg", "function_call": "fc"}.get(kind, kind[:2])))
        out.append(item)
    return out
