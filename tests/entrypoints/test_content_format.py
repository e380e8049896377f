"""``--chat-template-content-format``: what a chat template is handed as a message's content,
through the app (a scripted engine records the rendered prompts)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fastdeploy.config import ServerConfig
from fastdeploy.entrypoints.openai.api_server import build_app
from tests.entrypoints.test_tool_calling import ScriptedEngine, chat


def rendered_prompt(engine: ScriptedEngine, content, **server) -> str:
    """The prompt ``engine`` was given for one chat request of a user message with ``content``."""
    with TestClient(build_app(engine, ["m"], ServerConfig(**server))) as client:
        assert chat(client, messages=[{"role": "user", "content": content}]).status_code == 200
    return engine.prompts[-1]


# reads each part's own field, as a translation model's template does (it needs the parts)
PER_PART = (
    "{% for m in messages %}{% for part in m['content'] %}[{{ part.get('lang', '-') }}:{{ part.text }}]"
    "{% endfor %}{% endfor %}"
)
# concatenates the content as a string, as most templates do
AS_STRING = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"

PARTS = [{"type": "text", "text": "Hola", "lang": "es"}, {"type": "text", "text": "mundo"}]


@pytest.mark.parametrize(
    "template, setting, rendered",
    [
        (PER_PART, "auto", "[es:Hola][-:mundo]"),  # the template loops over the content: openai
        (PER_PART, "openai", "[es:Hola][-:mundo]"),
        (AS_STRING, "auto", "<user>Hola\nmundo"),  # a string template: the parts joined
        (AS_STRING, "string", "<user>Hola\nmundo"),
    ],
)
def test_the_template_gets_the_content_as_it_reads_it(template, setting, rendered):
    engine = ScriptedEngine(["ok"], template=template)
    assert rendered_prompt(engine, PARTS, chat_template_content_format=setting) == rendered


def test_a_string_content_is_one_part_in_the_openai_format():
    assert rendered_prompt(ScriptedEngine(["ok"], template=PER_PART), "Hi") == "[-:Hi]"
