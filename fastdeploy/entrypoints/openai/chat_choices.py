"""What each choice of a chat answer reports: the request's options (:class:`ChatOptions`), a streamed
answer split into deltas of reasoning, content and tool calls (:class:`ChoiceSplit`), a whole answer's
assistant message (:func:`assistant_message`) and its finish reason (:func:`chat_finish_reason`).
Shared by ``/v1/chat/completions`` (``serving_chat.py``) and the Responses API (``responses_output.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.core.outputs import CompletionOutput
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessageOut, DeltaMessage
from fastdeploy.entrypoints.openai.protocol.tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from fastdeploy.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
from fastdeploy.entrypoints.openai.tool_calling import ToolPlan
from fastdeploy.entrypoints.openai.tool_parsers import NamedToolParser, ToolCallDelta, ToolCallStream


@dataclass
class ChatOptions:
    """What a chat answer reports besides its text, from the request."""

    include_usage: bool = False
    """Streaming: end with a usage chunk (and ``"usage": null`` in the other chunks)."""
    continuous_usage: bool = False
    """Streaming: the usage so far in every chunk (vLLM's ``continuous_usage_stats``)."""
    num_prompt_logprobs: int | None = None
    """The ``prompt_logprobs`` the client asked for (None: leave the field out)."""
    echo_text: str = ""
    """The text every choice starts with (``echo``)."""
    return_token_ids: bool = False
    """Report ``prompt_token_ids`` and each choice's ``token_ids``."""
    reasoning: ReasoningParser | None = None
    """Splits each answer's reasoning from its content (None: all content)."""
    tools: ToolPlan | None = None
    """Reads tool calls out of each answer's content (None: no tools)."""
    legacy_functions: bool = False
    """The request gave ``functions`` (deprecated): its call is reported as ``function_call``."""
    tokens_as_ids: bool = False
    """Logprobs tokens as ``token_id:N`` (``return_tokens_as_token_ids``)."""
    include_reasoning: bool = True
    """Return the reasoning the parser splits out (vLLM's ``include_reasoning``; false: dropped)."""

    @classmethod
    def of(cls, request: ChatCompletionRequest, force_usage: bool = False) -> ChatOptions:
        """The options ``request`` asks for (``force_usage``: ``--enable-force-include-usage``)."""
        include_usage, continuous_usage = request.usage_in_stream(force_usage)
        return cls(
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            num_prompt_logprobs=request.prompt_logprobs,
            echo_text=request.echo_text,
            return_token_ids=bool(request.return_token_ids),
            include_reasoning=request.include_reasoning is not False,
            legacy_functions=request.legacy_functions,
        )


def chat_finish_reason(
    reason: str | None, called: bool, named: bool = False, legacy: bool = False
) -> str | None:
    """``tool_calls`` (``function_call`` for a request that gave ``functions``) for an answer that
    called tools and stopped by itself, else ``reason``; a call of the function ``tool_choice``
    named stops with ``stop``, as OpenAI's (and vLLM's) do."""
    if called and reason == "stop" and not named:
        return "function_call" if legacy else "tool_calls"
    return reason


def names_a_function(options: ChatOptions) -> bool:
    """Whether the request's ``tool_choice`` names one function (its answer is that call)."""
    return options.tools is not None and isinstance(options.tools.parser, NamedToolParser)


class ChoiceSplit:
    """One streamed answer split into deltas: reasoning first (``--reasoning-parser``), then the
    content through the tool-call parser (with tools)."""

    def __init__(self, options: ChatOptions):
        self.reasoning: ReasoningStream | None = options.reasoning.stream() if options.reasoning else None
        parser = options.tools.parser if options.tools else None
        self.tools: ToolCallStream | None = parser.stream() if parser else None
        self.named = names_a_function(options)
        self.legacy = options.legacy_functions
        self.called = False
        self.include_reasoning = options.include_reasoning
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        """The answer so far with a reasoning parser, tokens and text pieces (its reasoning tokens are
        counted from them at the end)."""

    def delta(self, c: CompletionOutput) -> DeltaMessage:
        """The delta message of a streamed piece of the answer (its end releases what was held back)."""
        if self.reasoning is not None:  # (only the reasoning count at the end reads them)
            self.token_ids.extend(c.token_ids)
            self.texts.append(c.text)
        reasoning, content = ("", c.text) if self.reasoning is None else self.reasoning.feed(c.text)
        if c.finish_reason is not None and self.reasoning is not None:
            last_reasoning, last_content = self.reasoning.finish()
            reasoning, content = reasoning + last_reasoning, content + last_content
        if not self.include_reasoning:
            reasoning = ""
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if c.finish_reason is not None:
                last_content, last_calls = self.tools.finish()
                content, calls = content + last_content, calls + last_calls
        self.called = self.called or bool(calls)
        legacy_call = None
        if self.legacy and calls:  # the deprecated shape: the one call's name, then its arguments
            legacy_call = DeltaFunctionCall(
                name=next((d.name for d in calls if d.name), None),
                arguments="".join(d.arguments for d in calls if d.index == 0) or None,
            )
            calls = []
        return DeltaMessage(
            content=content or None,
            reasoning_content=reasoning or None,
            reasoning=reasoning or None,
            tool_calls=_delta_tool_calls(calls) or None,
            function_call=legacy_call,
        )

    def finish_reason(self, reason: str | None) -> str | None:
        return chat_finish_reason(reason, self.called, self.named, self.legacy)


def _delta_tool_calls(calls: list[ToolCallDelta]) -> list[DeltaToolCall]:
    """The parser's call pieces as OpenAI deltas, the argument pieces of one call that follow each
    other joined into one."""
    out: list[DeltaToolCall] = []
    for d in calls:
        if out and out[-1].index == d.index and d.id is None:
            out[-1].function.arguments = (out[-1].function.arguments or "") + d.arguments
            continue
        out.append(
            DeltaToolCall(
                index=d.index,
                id=d.id,
                type="function" if d.id else None,
                function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
            )
        )
    return out


def assistant_message(text: str, options: ChatOptions) -> ChatMessageOut:
    """The assistant message of a whole answer: ``echo`` text first, reasoning split out, then the
    tool calls read out of the content."""
    if options.reasoning is None and options.tools is None:
        return ChatMessageOut(content=options.echo_text + text)
    reasoning, content = (None, text) if options.reasoning is None else options.reasoning.extract(text)
    if not options.include_reasoning:
        reasoning = None
    tool_calls = None
    if options.tools is not None and options.tools.parser is not None:
        extracted = options.tools.parser.extract(content or "")
        content = extracted.content
        tool_calls = [
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in extracted.calls
        ] or None
    if options.echo_text:
        content = options.echo_text + (content or "")
    if options.legacy_functions and tool_calls:  # the deprecated shape: one call, no id
        return ChatMessageOut(
            content=content,
            reasoning_content=reasoning,
            reasoning=reasoning,
            function_call=tool_calls[0].function,
        )
    return ChatMessageOut(
        content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=tool_calls
    )
