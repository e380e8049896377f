"""Tool calling in the chat protocol: the tools a request offers, ``tool_choice``, the calls in
assistant messages and answers, and the JSON schema that forces a call.

``tool_choice`` is ``"none"`` (the answer is read as plain content), ``"auto"`` (the
default with tools: the tool-call parser finds the calls the model chose to make),
``"required"`` or ``{"type": "function", "function": {"name": F}}``: the answer is
generated under a grammar (:func:`forced_call_schema`, vLLM's schemas) so that it is a
valid call whatever the model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import field_validator

from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol.common import OpenAIModel, ResponseModel

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for function names."""

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""The parameters of a function that declares none."""

# --------------------------------------------------------------------------- request side


class FunctionDefinition(OpenAIModel):
    """A function the model may call: its name, what it does, and a JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError("must be 1 to 64 letters, digits, underscores or dashes")
        return v

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        import jsonschema

        try:
            jsonschema.validators.validator_for(v).check_schema(v)
        except jsonschema.SchemaError as exc:
            raise ValueError(
                f"invalid 'parameters' schema (not a valid JSON schema): {exc.message}"
            ) from None
        except Exception as exc:  # a malformed "$schema" and the like
            raise ValueError(
                f"invalid 'parameters' schema (not a valid JSON schema): {type(exc).__name__}: {exc}"
            ) from None
        if v.get("type", "object") != "object":
            raise ValueError(f"must be a schema of an object (type 'object'), got type {v['type']!r}")
        return v


class ChatCompletionTool(OpenAIModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionCallIn(OpenAIModel):
    """The function and its arguments (JSON text) in a call of an assistant message."""

    name: str
    arguments: str


class ToolCallIn(OpenAIModel):
    """A call the assistant made, sent back in the conversation: ``{"id", "type", "function"}``."""

    id: str
    type: Literal["function"]
    function: FunctionCallIn


@dataclass(frozen=True)
class ToolChoice:
    """What ``tool_choice`` asks for: ``mode`` is ``none``, ``auto``, ``required`` or ``named``
    (then ``function`` is its name)."""

    mode: str
    function: str | None = None

    @property
    def forced(self) -> bool:
        """Whether the answer must be a call (generated under a grammar)."""
        return self.mode in ("required", "named")


def resolve_tool_choice(tools: list[ChatCompletionTool] | None, tool_choice: Any) -> ToolChoice:
    """The checked ``tool_choice`` of a request offering ``tools`` (a 400 naming the field if wrong).

    Without ``tool_choice`` it is ``auto`` when there are tools and ``none`` otherwise.
    """
    names = [t.function.name for t in tools or []]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise BadRequestError(f"tools define the function {duplicates[0]!r} more than once", param="tools")
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not names:
            raise BadRequestError(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        return ToolChoice(tool_choice)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(name, str)
        or set(tool_choice) != {"type", "function"}
        or set(function) != {"name"}
    ):
        raise BadRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
            '{"name": NAME}}',
            param="tool_choice",
        )
    if name not in names:
        raise BadRequestError(
            f"Tool {name!r} not found in tools list"
            + (f" ({', '.join(names)})" if names else " (the request has no tools)")
            + ": tool_choice must name one of the functions in tools",
            param="tool_choice.function.name",
        )
    return ToolChoice("named", name)


def _parameters(tool: ChatCompletionTool) -> dict[str, Any]:
    return tool.function.parameters or EMPTY_PARAMETERS


def forced_call_schema(tools: list[ChatCompletionTool], choice: ToolChoice, parallel: bool) -> dict[str, Any]:
    """The JSON schema a forced call is generated under (vLLM's).

    A named function: its parameters schema (the answer is the arguments object).
    ``required``: an array of ``{"name": one of the tools' names, "parameters": that tool's
    schema}`` objects, at least one, at most one unless ``parallel``. The tools' ``$defs``
    move to the top of the array's schema, where their ``#/$defs/...`` references point.
    """
    if choice.mode == "named":
        return next(_parameters(t) for t in tools if t.function.name == choice.function)
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        params = dict(_parameters(tool))
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise BadRequestError(
                    f"tools define $defs {key!r} differently: multiple schemas under one $defs name are "
                    "not supported with tool_choice 'required' (its grammar puts all tools' $defs together)",
                    param="tools",
                )
            defs[key] = value
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def strict_calls_tag(
    tools: list[ChatCompletionTool], trigger: str, opening: Callable[[str], str], closing: str
) -> str:
    """xgrammar's structural tag that leaves the answer free but holds every call to its tool
    (``tool_choice`` auto with a ``strict`` tool): once the model writes ``trigger``, the call must be
    one of ``tools``, written ``opening(name)`` + its arguments + ``closing``; a ``strict`` tool's
    arguments follow its parameters schema, another's are any JSON object (as OpenAI holds strict
    functions to their schemas)."""
    tags = [
        {
            "begin": opening(tool.function.name),
            "content": {
                "type": "json_schema",
                "json_schema": _parameters(tool) if tool.function.strict else {"type": "object"},
            },
            "end": closing,
        }
        for tool in tools
    ]
    return json.dumps(
        {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [trigger], "tags": tags}}
    )


# --------------------------------------------------------------------------- response side


class FunctionCallOut(ResponseModel):
    """The function an answer calls and its arguments, as JSON text."""

    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    """A call in an answer: ``{"id": "call_...", "type": "function", "function": {...}}``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(ResponseModel):
    """A streamed piece of a call's function: the name once, then argument text."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    """A streamed piece of call ``index``: ``id``, ``type`` and the name in its first piece."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    def to_json(self) -> dict[str, Any]:
        """The piece as OpenAI sends it: unset fields left out."""
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        out["function"] = {k: v for k, v in self.function.model_dump().items() if v is not None}
        return out
