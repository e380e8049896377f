"""``POST /v1/responses``' response object, its usage and its output items (messages, reasoning,
function calls), and the chat messages a stored output continues a conversation with.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.openai.protocol.common import ResponseModel
from fastdeploy.entrypoints.openai.protocol.responses import ResponsesRequest


class ResponseUsage(ResponseModel):
    """Token counts: ``input_tokens`` (``cached_tokens`` of them from the prefix cache), ``output_tokens``
    (``reasoning_tokens`` of them inside the reasoning)."""

    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int

    @classmethod
    def build(cls, input_tokens: int, cached: int, output_tokens: int, reasoning: int) -> ResponseUsage:
        return cls(
            input_tokens=input_tokens,
            input_tokens_details={"cached_tokens": cached, "cache_write_tokens": 0},
            output_tokens=output_tokens,
            output_tokens_details={"reasoning_tokens": reasoning},
            total_tokens=input_tokens + output_tokens,
        )


class ResponseObject(ResponseModel):
    """The ``response`` object: what the request asked for, the status and the output items."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"] = "in_progress"
    completed_at: int | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    background: bool = False
    service_tier: str = "default"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def of(
        cls, response_id: str, model: str, request: ResponsesRequest, params: SamplingParams
    ) -> ResponseObject:
        """The response to ``request``, in progress and without output; ``params``: the sampling it
        runs with, whose ``temperature`` and ``top_p`` it reports (the values used, defaults
        included, as OpenAI's and vLLM's do: never null)."""
        text = request.text.model_dump(exclude_none=True) if request.text else {}
        return cls(
            id=response_id,
            model=model,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            max_tool_calls=request.max_tool_calls,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id,
            reasoning=request.reasoning.model_dump()
            if request.reasoning
            else {"effort": None, "summary": None},
            store=request.stores,
            temperature=params.temperature,
            text={"format": {"type": "text"}, **text},
            tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
            tools=list(request.tools or []),
            top_logprobs=request.top_logprobs,
            top_p=params.top_p,
            truncation=request.truncation or "disabled",
            background=bool(request.background),
            user=request.user,
            metadata=dict(request.metadata or {}),
        )


def message_item(item_id: str, text: str, status: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    """An assistant ``message`` output item with one ``output_text`` part."""
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A ``reasoning`` output item: the model's reasoning text (no summary)."""
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A ``function_call`` output item: a call the client runs and answers with a
    ``function_call_output`` item carrying the same ``call_id``."""
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a later turn sees (its reasoning dropped)."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "message":
            message["content"] = (message["content"] or "") + "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            call = {"name": item["name"], "arguments": item["arguments"]}
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
    if message["content"] is None and not message.get("tool_calls"):
        message["content"] = ""
    return [message]
