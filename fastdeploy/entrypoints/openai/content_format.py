"""How a chat message's text reaches the chat template (``--chat-template-content-format``, vLLM's
flag): ``string`` joins a message's text parts into one string (what most templates expect);
``openai`` hands the template OpenAI's list of parts, ``[{"type": "text", "text": ...}, ...]``,
each part with the fields the client gave it (templates that read per-part fields, such as a
translation model's ``source_lang_code``); ``auto`` picks ``openai`` for a template that loops over
a message's content, else ``string``, as vLLM's ``auto`` does.

A message's parts travel to the renderer beside its joined text, under :data:`PARTS_KEY` of its
template dict; :func:`apply_content_format` takes them out (or wraps the text) just before the
template is applied. A text that changed on the way (the tool-call prompt rewrites some) is
wrapped as one part.
"""

from __future__ import annotations

import re
from typing import Any, Literal

PARTS_KEY = "_fd_content_parts"
"""The template dict key that carries a message's original text parts to the renderer."""

_LOOPS_OVER_CONTENT = re.compile(r"""\bfor\s+\w+\s+in\s+\w+\s*(?:\[\s*['"]content['"]\s*\]|\.content\b)""")


def resolve_content_format(setting: str, template: str | None) -> Literal["string", "openai"]:
    """``string`` or ``openai`` for this chat template (``auto``: what the template reads)."""
    if setting in ("string", "openai"):
        return setting  # type: ignore[return-value]
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"


def apply_content_format(conversation: list[dict[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """The template dicts to render: text contents as ``content_format`` wants them, and no
    :data:`PARTS_KEY` left (content lists of image / video parts are left as they are)."""
    out = []
    for message in conversation:
        msg = dict(message)
        parts = msg.pop(PARTS_KEY, None)
        content = msg.get("content")
        if content_format == "openai" and isinstance(content, str):
            joined = "\n".join(p.get("text", "") for p in parts) if parts else None
            msg["content"] = (
                [dict(p) for p in parts] if joined == content else [{"type": "text", "text": content}]
            )
        out.append(msg)
    return out
