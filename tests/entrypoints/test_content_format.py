"""How the chat template is applied, through the app (a scripted engine records the rendered
prompts): ``--chat-template-content-format`` (what the template is handed as a message's content)
and a request's own ``chat_template`` (``--trust-request-chat-template``)."""

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


def test_a_requests_chat_template_is_refused_unless_trusted():
    """vLLM refuses a request's chat_template without --trust-request-chat-template (dropping it as an
    unknown field would render the prompt with another template than the one sent); with it, the
    request's template renders the prompt (/tokenize's chat form too)."""
    own = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    engine = ScriptedEngine(["ok"], template=AS_STRING)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "chat_template": own}
    with TestClient(build_app(engine, ["m"], ServerConfig())) as client:
        refused = client.post("/v1/chat/completions", json=body).json()["error"]
        assert refused["param"] == "chat_template"
        assert "Refused request with untrusted chat template" in refused["message"]
        assert client.post("/tokenize", json=body).status_code == 400
        assert client.post("/v1/chat/completions", json={**body, "chat_template": None}).status_code == 200
    assert engine.prompts == ["<user>Hi"]  # (an explicit null is the default)
    with TestClient(build_app(engine, ["m"], ServerConfig(trust_request_chat_template=True))) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert client.post("/tokenize", json=body).json()["count"] == len("<<Hi>>")
    assert engine.prompts[-1] == "<<Hi>>"
