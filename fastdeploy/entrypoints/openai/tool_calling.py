"""How one chat request uses tools: what goes into the prompt, the grammar of a forced call, and
the parser that reads the answer.

The chat handler asks :class:`ToolCalling` (one per server: the configured parser, or the one the
chat template implies) for a :class:`ToolPlan` per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastdeploy.core.sampling_params import SamplingParams, StructuredOutputsParams
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, forced_call_schema, strict_calls_tag
from fastdeploy.entrypoints.openai.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    default_tool_parser_name,
    get_tool_parser,
)
from fastdeploy.entrypoints.openai.tool_template import hermes_conversation, renders_tools, template_text
from fastdeploy.structured_output.grammar import validate_structured_outputs


@dataclass
class ToolPlan:
    """The tool side of one chat request."""

    parser: ToolParser | None
    """Reads the calls out of each answer (None: ``tool_choice`` none, or no tools)."""
    constraint: StructuredOutputsParams | None = None
    """The grammar of a forced call (with a reasoning parser, it applies after the reasoning)."""
    strict_constraint: StructuredOutputsParams | None = None
    """``tool_choice`` auto with a ``strict`` tool: the grammar that leaves the answer free and holds
    its calls to their tools' schemas (not applied when the request has its own output constraint)."""
    template_tools: list[dict[str, Any]] | None = None
    """The tools as ``tools=`` of a template that renders them."""
    prompt_tools: list[dict[str, Any]] | None = None
    """The tools of a template that does not render them (the server writes them in)."""
    native: bool = True
    """The chat template renders tools and tool calls itself."""

    def conversation(self, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The template dicts to render: as they are for a template that renders tools, else the
        hermes conversation (tools described, calls and results written as text)."""
        if self.native:
            return conversation
        return hermes_conversation(conversation, self.prompt_tools)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the forced call's grammar, and special tokens kept when the format's
        markers are special tokens."""
        changes: dict[str, Any] = {}
        if self.constraint is not None:
            if params.structured_outputs is not None:
                raise BadRequestError(
                    "a forced tool call (tool_choice 'required' or a named function) cannot be combined "
                    "with another output constraint (structured_outputs, guided_*, json_schema, regex, ebnf)",
                    param="tool_choice",
                )
            changes["structured_outputs"] = self.constraint
        elif self.strict_constraint is not None and params.structured_outputs is None:
            changes["structured_outputs"] = self.strict_constraint
        if self.parser is not None and self.parser.needs_special_tokens:
            changes["skip_special_tokens"] = False
        return params.clone(**changes) if changes else params


class ToolCalling:
    """The server's tool-call set-up: the parser class (``--tool-call-parser``, else the template's
    default) and whether the chat template renders tools."""

    def __init__(self, tokenizer: Any, parser_name: str | None = None, exclude_tools_when_none: bool = False):
        self.exclude_tools_when_none = exclude_tools_when_none
        """``tool_choice: "none"`` leaves the tools out of the prompt (``--exclude-tools-when-tool-choice-none``)."""
        template = template_text(tokenizer)
        self.parser_cls: type[ToolParser] = get_tool_parser(parser_name or default_tool_parser_name(template))
        self.native = renders_tools(template)
        trigger = self.parser_cls.call_trigger
        special = set(getattr(tokenizer, "all_special_tokens", None) or [])
        self.strict_trigger = trigger if trigger and trigger not in special else None
        """The text that starts a call, where a grammar can see it (a special token's text it cannot):
        ``strict`` tools are held to their schemas under ``tool_choice`` auto only then."""

    def plan(self, request: ChatCompletionRequest) -> ToolPlan:
        """What ``request``'s tools and ``tool_choice`` mean for its prompt, sampling and answer."""
        choice = request.tool_choice_mode()
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        plan = ToolPlan(parser=None, native=self.native)
        if tools and not (choice.mode == "none" and self.exclude_tools_when_none):
            if self.native:
                plan.template_tools = tools
            else:
                plan.prompt_tools = tools
        max_calls = 1 if request.parallel_tool_calls is False else None
        if choice.mode == "auto":
            plan.parser = self.parser_cls(max_calls=max_calls)
            if self.strict_trigger and any(t.function.strict for t in request.tools or []):
                tag = strict_calls_tag(
                    request.tools or [],
                    self.strict_trigger,
                    self.parser_cls.call_opening,
                    self.parser_cls.call_closing,
                )
                plan.strict_constraint = StructuredOutputsParams(structural_tag=tag)
                validate_structured_outputs(plan.strict_constraint, "tools")
        elif choice.forced:
            schema = forced_call_schema(request.tools or [], choice, request.parallel_tool_calls is not False)
            plan.constraint = StructuredOutputsParams(json=schema)
            # a parameters schema the grammar engine cannot take is the client's 400, not an engine error
            validate_structured_outputs(plan.constraint, "tools")
            plan.parser = (
                NamedToolParser(choice.function or "")
                if choice.mode == "named"
                else RequiredToolParser(max_calls=max_calls)
            )
        return plan
