"""Tools in the prompt of a model whose chat template does not render them (hermes style).

A template that uses the ``tools`` variable gets the request's tools as ``tools=`` and the
messages as they are (``transformers``' convention). Any other template (the default model's,
for one) would drop the tools and fail on an assistant message whose content is null, so the
server writes the conversation in the hermes format itself, as Qwen2.5's template does: the tools
in the system message inside ``<tools></tools>``, each call the assistant made as a
``<tool_call>`` block in its content, and tool results as a user turn of ``<tool_response>``
blocks. The hermes parser reads the answers of such models (the default rule of
``tool_parsers.default_tool_parser_name``).
"""

from __future__ import annotations

import json
import re
from typing import Any

_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_text(tokenizer: Any) -> str | None:
    """The tokenizer's chat template as text (named templates joined), or None if it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else None


def renders_tools(template: str | None) -> bool:
    """Whether a chat template uses the ``tools`` variable (and so renders tools and tool calls)."""
    return bool(template and re.search(r"\btools\b", template))


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that describes ``tools`` (dicts of ``{"type": "function", "function": ...}``)."""
    return _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def _call_block(call: dict[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def hermes_conversation(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """``conversation`` (template dicts) written in the hermes format, for a template without tools.

    ``tools`` (None or empty: none described) go at the end of the first system message, or in
    a system message of their own; assistant ``tool_calls`` become ``<tool_call>`` blocks after
    the content; consecutive ``tool`` messages become one user message of ``<tool_response>``
    blocks.
    """
    out: list[dict[str, Any]] = []
    for msg in conversation:
        msg = dict(msg)
        calls = msg.pop("tool_calls", None)
        if calls:
            parts = [msg["content"]] if msg.get("content") else []
            msg["content"] = "\n".join(parts + [_call_block(c) for c in calls])
        if msg.get("content") is None:
            msg["content"] = ""
        if msg["role"] == "tool":
            msg.pop("tool_call_id", None)
            block = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
                continue
            msg = {"role": "user", "content": block, "_tool_results": True}
        out.append(msg)
    for msg in out:
        msg.pop("_tool_results", None)
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system" and isinstance(out[0].get("content"), str):
            out[0]["content"] = (out[0]["content"] + "\n\n" + prompt).lstrip()
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
