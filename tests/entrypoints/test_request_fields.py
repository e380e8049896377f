"""OpenAI compatibility without a model: which request fields are accepted, used, ignored or refused,
the extension fields of responses, legacy ``top_logprobs``, ``--strict-request-fields`` through
``build_app``, ``GET /v1/models/{model}``, and the end of a detokenized stream cut inside a character.

(The end-to-end side, with the official client against a live server, is tests/e2e/test_openai_compat.py.)
"""

from __future__ import annotations

import json
import logging
import uuid
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from openai.types import completion_create_params as openai_completion_params
from openai.types.chat import completion_create_params as openai_chat_params

from fastdeploy.config import ModelConfig, ServerConfig
from fastdeploy.core.outputs import Logprob
from fastdeploy.engine.detokenizer import IncrementalDetokenizer
from fastdeploy.entrypoints.openai.api_server import build_app
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.logprobs import completion_logprobs
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseChoice,
    ChatMessageOut,
    CompletionRequest,
    CompletionResponseChoice,
    parse_request,
)

USER = [{"role": "user", "content": "Hello"}]
PROTOCOL_LOGGER = "fastdeploy.entrypoints.openai.protocol"


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": USER, **fields})


def unique(name: str) -> str:
    """A field name no test has sent before (warnings are logged once per name and process)."""
    return f"{name}_{uuid.uuid4().hex[:8]}"


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# --------------------------------------------------------------------------- unknown fields


def test_unknown_fields_are_dropped_with_one_warning_per_name(caplog):
    top, nested = unique("top"), unique("nested")
    data = {"messages": USER, top: 1, "stream": True, "stream_options": {"include_usage": True, nested: 2}}
    with caplog.at_level(logging.WARNING, logger=PROTOCOL_LOGGER):
        request = parse_request(ChatCompletionRequest, data)
        parse_request(ChatCompletionRequest, data)
    assert request.usage_in_stream()[0] and request.messages[0].content == "Hello"
    assert data[top] == 1 and nested in data["stream_options"]  # the caller's data is left alone
    logged = warnings_of(caplog)
    assert [m for m in logged if top in m] == [
        f"Ignoring the request field '{top}': it is not part of the OpenAI API nor a supported extension "
        "(start the server with --strict-request-fields to refuse such requests)"
    ]
    assert len([m for m in logged if f"stream_options.{nested}" in m]) == 1


def test_unknown_fields_are_400_with_strict_fields():
    name = unique("field")
    with pytest.raises(BadRequestError) as info:
        parse_request(CompletionRequest, {"prompt": "hi", name: 1}, strict_fields=True)
    assert info.value.param == name
    assert info.value.message == f"Unrecognized request argument supplied: {name}"


def test_a_messages_own_fields_and_custom_roles_reach_the_template_unless_strict():
    """As vLLM: a message's field outside OpenAI's goes to the chat template with the message (no
    part of the prompt is dropped), and a custom role is rendered as it is; both are 400 with
    --strict-request-fields."""
    messages = [{"role": "my-custom-role", "content": "x", "extra": 1}, {"role": "user", "content": "y"}]
    request = parse_request(ChatCompletionRequest, {"messages": messages})
    assert request.messages[0].to_template_dict() == {"role": "my-custom-role", "content": "x", "extra": 1}
    with pytest.raises(BadRequestError) as info:
        parse_request(ChatCompletionRequest, {"messages": messages}, strict_fields=True)
    assert info.value.param == "messages[0].role"
    messages[0]["role"] = "user"
    with pytest.raises(BadRequestError) as info:
        parse_request(ChatCompletionRequest, {"messages": messages}, strict_fields=True)
    assert info.value.param == "messages[0].extra"
    assert info.value.message == "Unrecognized request argument supplied: messages[0].extra"
    # a text part's own fields (kept for --chat-template-content-format openai) are extensions too
    parts = [{"role": "user", "content": [{"type": "text", "text": "x", "lang": "es"}]}]
    assert parse_request(ChatCompletionRequest, {"messages": parts}).messages[0].content == "x"
    with pytest.raises(BadRequestError) as info:
        parse_request(ChatCompletionRequest, {"messages": parts}, strict_fields=True)
    assert info.value.param == "messages[0].content[0].lang"


def test_openais_own_assistant_fields_are_not_extensions():
    """What the openai client's ``message.model_dump()`` sends back (``refusal``, ``audio``,
    ``annotations``, the deprecated ``function_call``), refusal parts and the ``function`` role are
    OpenAI's protocol: accepted with --strict-request-fields, not handed to the template; a refusal
    with no content is the content. The same fields on a user message stay extensions."""
    sent_back = {
        "role": "assistant", "content": None, "refusal": "I cannot help.", "audio": None, "annotations": [],
        "function_call": None,
    }  # fmt: skip
    legacy = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    parts = {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}
    messages = [
        {"role": "user", "content": "x"},
        sent_back,
        parts,
        legacy,
        {"role": "function", "name": "f", "content": "1"},
    ]
    request = parse_request(ChatCompletionRequest, {"messages": messages}, strict_fields=True)
    assert request.messages[1].to_template_dict() == {"role": "assistant", "content": "I cannot help."}
    assert request.messages[2].to_template_dict()["content"] == "No."
    assert request.messages[4].to_template_dict()["role"] == "tool"
    with pytest.raises(BadRequestError) as info:
        parse_request(
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x", "refusal": "no"}]},
            strict_fields=True,
        )
    assert info.value.param == "messages[0].refusal"
    with pytest.raises(BadRequestError) as info:  # a refusal part is an assistant's only
        parse_request(
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "n"}]}]},
        )
    assert info.value.param.startswith("messages")


def test_other_errors_still_win_after_unknown_fields_are_dropped():
    with pytest.raises(BadRequestError) as info:
        parse_request(CompletionRequest, {"prompt": "hi", unique("f"): 1, "max_tokens": "5"})
    assert info.value.param == "max_tokens"


# --------------------------------------------------------------------------- OpenAI's own fields


def test_every_field_of_openais_request_schemas_is_declared():
    """The installed ``openai`` package's request parameters are all known here (none is an unknown field)."""
    chat_fields = set(openai_chat_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    completion_fields = set(openai_completion_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert chat_fields - set(ChatCompletionRequest.model_fields) == set()
    assert completion_fields - set(CompletionRequest.model_fields) == set()


IGNORED_CHAT_FIELDS = {
    "metadata": {"team": "a"},
    "store": True,
    "service_tier": "flex",
    "reasoning_effort": "low",
    "verbosity": "low",
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "Hello"},
    "web_search_options": {},
    "moderation": {"policy": {}},
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "1h"},
    "safety_identifier": "s",
    "user": "u",
}


def test_openai_fields_the_engine_cannot_apply_are_accepted_and_logged_once(caplog):
    with caplog.at_level(logging.WARNING, logger=PROTOCOL_LOGGER):
        chat(
            **IGNORED_CHAT_FIELDS, stream=True, stream_options={"include_obfuscation": True}
        ).to_sampling_params()
    logged = warnings_of(caplog)
    for name in (*IGNORED_CHAT_FIELDS, "stream_options.include_obfuscation"):
        # earlier tests of this process may already have logged it, never twice
        assert len([m for m in logged if f"'{name}' is accepted but ignored" in m]) <= 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=PROTOCOL_LOGGER):
        chat(**IGNORED_CHAT_FIELDS).to_sampling_params()
    assert warnings_of(caplog) == []
    params = chat(store=True, user="u", metadata={"a": "b"}).to_sampling_params()
    assert params == chat().to_sampling_params()


def test_off_values_of_ignored_fields_log_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger=PROTOCOL_LOGGER):
        chat(store=False, modalities=["text"], service_tier="auto").to_sampling_params()
    assert not [m for m in warnings_of(caplog) if "'store'" in m or "'modalities'" in m]


def test_ignored_fields_keep_their_types():
    with pytest.raises(BadRequestError) as info:
        chat(store="yes")
    assert info.value.param == "store"


def test_deprecated_functions_and_off_values_are_accepted():
    """``functions`` (deprecated) is read as ``tools`` (tests/entrypoints/test_tool_calling.py has
    the answers' shape); the "off" values of the tool fields pass."""
    request = chat(functions=[{"name": "f"}])
    request.to_sampling_params()
    assert [tool.function.name for tool in request.tools] == ["f"] and request.legacy_functions
    chat(tools=None, tool_choice="none", response_format={"type": "text"}).to_sampling_params()


# --------------------------------------------------------------------------- extensions


def test_add_generation_prompt_and_continue_final_message_are_exclusive():
    """Both set true is vLLM's 400; continue_final_message alone turns the generation prompt off
    (as SGLang reads it)."""
    assert chat().add_generation_prompt and not chat().continue_final_message
    chat(add_generation_prompt=False, continue_final_message=True).to_sampling_params()
    alone = chat(continue_final_message=True)
    alone.to_sampling_params()
    assert not alone.add_generation_prompt
    with pytest.raises(BadRequestError) as info:
        chat(continue_final_message=True, add_generation_prompt=True).to_sampling_params()
    assert info.value.param == "continue_final_message"


@pytest.mark.parametrize("stream_options", [{"include_usage": True}, {"continuous_usage_stats": True}, {}])
def test_stream_options_need_stream(stream_options):
    """As OpenAI and vLLM: stream options without a stream are a 400 naming the field."""
    for stream in (False, None):
        with pytest.raises(BadRequestError) as info:
            chat(stream=stream, stream_options=stream_options).to_sampling_params()
        assert info.value.param == "stream_options"
    chat(stream=True, stream_options=stream_options).to_sampling_params()
    chat(stream=False, stream_options=None).to_sampling_params()


def test_chat_echo_echoes_the_message_the_answer_continues():
    with_answer = [*USER, {"role": "assistant", "content": "The answer is"}]
    assert chat(messages=with_answer, echo=True).echo_text == "The answer is"
    assert chat(messages=with_answer).echo_text == ""  # no echo asked
    assert chat(echo=True).echo_text == ""  # a new assistant message: nothing to echo
    assert chat(echo=True, add_generation_prompt=False).echo_text == "Hello"  # vLLM: the last message


def test_continuous_usage_needs_include_usage():
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert chat(stream=True, stream_options=both).usage_in_stream()[1]
    assert not chat(stream=True, stream_options={"continuous_usage_stats": True}).usage_in_stream()[1]
    assert not chat(stream=True, stream_options={"include_usage": True}).usage_in_stream()[1]


def test_forced_usage_as_vllms_enable_force_include_usage():
    """``--enable-force-include-usage``: a stream ends with usage unasked; continuous usage still needs
    ``continuous_usage_stats``; a whole answer always has its usage."""
    assert chat(stream=True).usage_in_stream(forced=True) == (True, False)
    continuous = {"continuous_usage_stats": True}
    assert chat(stream=True, stream_options=continuous).usage_in_stream(forced=True) == (True, True)
    assert chat(stream=True, stream_options=continuous).usage_in_stream() == (False, False)
    assert chat().usage_in_stream(forced=True) == (False, False)


@pytest.mark.parametrize("forced", [False, True])
def test_enable_force_include_usage_ends_streams_with_usage(forced):
    from tests.entrypoints.test_tool_calling import ScriptedEngine

    app = build_app(ScriptedEngine(["Hi", " there"]), ["m"], ServerConfig(enable_force_include_usage=forced))
    bodies = {
        "/v1/chat/completions": {"model": "m", "messages": USER, "stream": True},
        "/v1/completions": {"model": "m", "prompt": "Hello", "stream": True},
    }
    with TestClient(app) as client:
        for path, body in bodies.items():
            text = client.post(path, json=body).text
            chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            assert text.rstrip().endswith("data: [DONE]")
            usage_chunks = [c for c in chunks if c.get("usage")]
            if forced:
                assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and not chunks[-1]["choices"]
                assert chunks[-1]["usage"]["completion_tokens"] == 2, path
            else:
                assert usage_chunks == [], path


def test_token_id_fields_are_left_out_unless_asked():
    plain = CompletionResponseChoice(index=0, text="x").model_dump()
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    asked = CompletionResponseChoice(index=0, text="x", token_ids=[5], prompt_token_ids=[1, 2]).model_dump()
    assert (asked["token_ids"], asked["prompt_token_ids"]) == ([5], [1, 2])
    assert (
        "token_ids"
        not in ChatCompletionResponseChoice(index=0, message=ChatMessageOut(content="")).model_dump()
    )


# --------------------------------------------------------------------------- legacy logprobs


def entry(sampled: int, sampled_rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
    """An engine logprobs entry: the sampled token first, then the top alternatives by rank."""
    result = {
        sampled: Logprob(-5.0 if sampled_rank > len(top) else dict(top)[sampled], sampled_rank, f"t{sampled}")
    }
    for rank, (token, lp) in enumerate(top, start=1):
        result.setdefault(token, Logprob(lp, rank, f"t{token}"))
    return result


def test_completion_logprobs_zero_returns_the_sampled_token_per_position():
    lps = [entry(7, 3, []), entry(8, 1, [])]
    out = completion_logprobs([7, 8], lps, 0, 0)
    assert out.top_logprobs == [{"t7": -5.0}, {"t8": lps[1][8].logprob}]


def test_completion_top_logprobs_always_hold_the_sampled_token():
    top = [(1, -0.1), (2, -0.5)]
    out = completion_logprobs([9, 2], [entry(9, 4, top), entry(2, 2, top)], 2, 0)
    assert out.top_logprobs[0] == {"t1": -0.1, "t2": -0.5, "t9": -5.0}  # logprobs + 1 entries
    assert out.top_logprobs[1] == {"t1": -0.1, "t2": -0.5}
    # the sampled token first, then by likelihood (vLLM's order: its clients read the first key)
    assert [list(top) for top in out.top_logprobs] == [["t9", "t1", "t2"], ["t2", "t1"]]


# --------------------------------------------------------------------------- the app


def fake_engine(model_path: str = "/models/m.gguf", healthy: bool = False) -> SimpleNamespace:
    """Just enough of an engine client for /tokenize and /v1/models; generation gets a 503 (unhealthy
    unless ``healthy``, when a generation request would reach the missing ``generate``)."""
    return SimpleNamespace(
        is_healthy=healthy,
        max_model_len=64,
        vocab_size=100,
        tokenizer=SimpleNamespace(
            encode=lambda text, add_special_tokens: [1, 2], get_vocab=lambda: {"ab": 0}
        ),
        source=SimpleNamespace(path=model_path),
        config=SimpleNamespace(model=ModelConfig()),
    )


@pytest.mark.parametrize("strict", [False, True])
def test_build_app_applies_strict_request_fields(strict):
    app = build_app(fake_engine(), ["m"], ServerConfig(strict_request_fields=strict))
    body = {"prompt": "hi", unique("field"): 1}
    with TestClient(app) as client:
        response = client.post("/v1/completions", json=body)
        tokenize = client.post("/tokenize", json={"prompt": "hi", unique("field"): 1})
    if strict:
        assert response.status_code == tokenize.status_code == 400
        assert response.json()["error"]["message"].startswith("Unrecognized request argument supplied")
    else:  # parsed: it gets as far as the (unhealthy) engine
        assert response.status_code == 503, response.text
        assert tokenize.status_code == 200 and tokenize.json()["tokens"] == [1, 2], tokenize.text


def test_retrieve_model_and_its_root():
    app = build_app(fake_engine("/models/m.gguf"), ["m", "org/alias"], ServerConfig(api_key="k"))
    headers = {"Authorization": "Bearer k"}
    with TestClient(app) as client:
        listed = client.get("/v1/models", headers=headers).json()["data"]
        assert [card["root"] for card in listed] == ["/models/m.gguf"] * 2
        card = client.get("/v1/models/m", headers=headers).json()
        assert card == listed[0]
        assert client.get("/v1/models/org/alias", headers=headers).json()["id"] == "org/alias"
        missing = client.get("/v1/models/nope", headers=headers)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        assert "`nope`" in missing.json()["error"]["message"]
        assert client.get("/v1/models/m").status_code == 401


def test_model_card_has_vllms_fields():
    """vLLM's model cards (and clients reading them) carry ``parent``: null for a base model."""
    app = build_app(fake_engine("/models/m.gguf"), ["m"], ServerConfig())
    with TestClient(app) as client:
        (card,) = client.get("/v1/models").json()["data"]
    assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"} <= set(card)
    assert card["parent"] is None and card["max_model_len"] == 64


def test_tokenize_refuses_a_request_chat_template():
    app = build_app(fake_engine(), ["m"], ServerConfig())
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages }}"}
    with TestClient(app) as client:
        response = client.post("/tokenize", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template"


# --------------------------------------------------------------------------- detokenization


@pytest.fixture(scope="module")
def tokenizer():
    from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

    config = ModelConfig()
    return load_tokenizer(config, resolve_model(config))


@pytest.mark.parametrize("text", [" 🦊", "é 你好"])
def test_a_choice_cut_inside_a_character_drops_the_incomplete_tail(tokenizer, text):
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    for cut in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = [detok.add_tokens([t], final=i == cut - 1) for i, t in enumerate(ids[:cut])]
        assert "\ufffd" not in detok.text, (cut, deltas)
        assert text.startswith(detok.text)
        complete = tokenizer.decode(ids[:cut]).rstrip("\ufffd")
        assert detok.text == complete


def test_root_path_serves_routes_with_and_without_the_prefix():
    """``--root-path /llm`` (a reverse proxy's prefix): /llm/v1/... and /v1/... both answer, as vLLM's;
    the API key still applies to both."""
    app = build_app(fake_engine(), ["m"], ServerConfig(api_key="k", root_path="/llm/"))
    headers = {"Authorization": "Bearer k"}
    with TestClient(app) as client:
        for path in ("/llm/v1/models", "/v1/models"):
            assert client.get(path, headers=headers).json()["data"][0]["id"] == "m", path
            assert client.get(path).status_code == 401
        assert client.get("/llm/health").status_code == 503  # (the fake engine is unhealthy)
        assert client.get("/other/v1/models", headers=headers).status_code == 404


def test_cors_only_for_the_allowed_origins():
    """Without ``--allowed-origins`` no CORS headers (pages on other origins cannot read answers);
    with them, a preflight from an allowed origin passes and others get no allow header."""
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    with TestClient(build_app(fake_engine(), ["m"], ServerConfig())) as client:
        response = client.options("/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in response.headers
    config = ServerConfig(api_key="k", allowed_origins=["https://app.example"])
    with TestClient(build_app(fake_engine(), ["m"], config)) as client:
        response = client.options("/v1/chat/completions", headers=preflight)
        assert response.status_code == 200  # a preflight needs no key
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        other = client.options(
            "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in other.headers
        listed = client.get(
            "/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer k"}
        )
        assert listed.headers["access-control-allow-origin"] == "https://app.example"
        assert client.get("/v1/models", headers={"Origin": "https://app.example"}).status_code == 401


def test_several_api_keys_each_open_the_routes():
    app = build_app(fake_engine(), ["m"], ServerConfig(api_key=["first", "second"]))
    with TestClient(app) as client:
        for key, status in (("first", 200), ("second", 200), ("firs", 401), ("", 401)):
            assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == status
