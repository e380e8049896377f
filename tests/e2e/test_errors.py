"""Bad requests get the right 4xx with an OpenAI error body, and the server keeps serving.

The shared server runs with ``--api-key``: requests without the key, or with a
wrong one, are 401s; every other request here sends the key.
"""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def post(server, path: str, body=None, *, content: bytes | None = None, headers=None) -> httpx.Response:
    with server.http() as client:
        if content is not None:
            return client.post(
                path, content=content, headers={"Content-Type": "application/json", **(headers or {})}
            )
        return client.post(path, json=body, headers=headers)


BAD_REQUESTS = [
    # (id, path, body, expected param or None)
    ("max_tokens-string", COMPLETIONS_PATH, {"prompt": "Hi", "max_tokens": "5"}, "max_tokens"),
    ("temperature-string", CHAT_PATH, {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("prompt-number", COMPLETIONS_PATH, {"prompt": 123}, "prompt"),
    ("messages-string", CHAT_PATH, {"messages": "Hi"}, "messages"),
    ("message-content-number", CHAT_PATH, {"messages": [{"role": "user", "content": 5}]}, None),
    ("empty-role", CHAT_PATH, {"messages": [{"role": "", "content": "Hi"}]}, None),
    ("stream-string", COMPLETIONS_PATH, {"prompt": "Hi", "stream": "yes"}, "stream"),
    ("stop-number", COMPLETIONS_PATH, {"prompt": "Hi", "stop": 7}, "stop"),
    ("negative-max_tokens", COMPLETIONS_PATH, {"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    ("zero-max_tokens", CHAT_PATH, {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("negative-max_completion_tokens", CHAT_PATH, {"messages": MESSAGES, "max_completion_tokens": -3}, None),
    ("negative-temperature", COMPLETIONS_PATH, {"prompt": "Hi", "temperature": -0.5}, "temperature"),
    ("top_p-above-1", COMPLETIONS_PATH, {"prompt": "Hi", "top_p": 1.5}, "top_p"),
    ("n-zero", COMPLETIONS_PATH, {"prompt": "Hi", "n": 0}, "n"),
    ("n-huge", COMPLETIONS_PATH, {"prompt": "Hi", "n": 10**6}, "n"),  # would flood the engine
    ("empty-messages", CHAT_PATH, {"messages": []}, "messages"),
    ("missing-messages", CHAT_PATH, {"max_tokens": 4}, "messages"),
    ("missing-prompt", COMPLETIONS_PATH, {"max_tokens": 4}, "prompt"),
    ("empty-prompt", COMPLETIONS_PATH, {"prompt": ""}, "prompt"),
    ("body-not-object", COMPLETIONS_PATH, ["Hi"], None),
    ("token-id-out-of-vocab", COMPLETIONS_PATH, {"prompt": [10**9]}, "prompt"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_request_is_400(server, path, body, param):
    error = server.check_error(post(server, path, body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("path", [COMPLETIONS_PATH, CHAT_PATH])
def test_unknown_field_is_ignored_with_a_warning(server, path):
    """A field outside the OpenAI API and its extensions is dropped and logged, as vLLM does (the server
    would refuse it with --strict-request-fields: tests/entrypoints/test_request_fields.py)."""
    field = f"bogus_{uuid.uuid4().hex[:8]}"  # warnings come once per field name: a name never sent before
    body = {"prompt": "Hi"} if path == COMPLETIONS_PATH else {"messages": MESSAGES}
    response = post(server, path, {**body, "max_tokens": 1, field: 1})
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 10
    while f"Ignoring the request field '{field}'" not in server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no warning naming {field} in the server log"
        time.sleep(0.1)


@pytest.mark.parametrize("path", [COMPLETIONS_PATH, CHAT_PATH])
def test_invalid_json_is_400(server, path):
    error = server.check_error(post(server, path, content=b'{"prompt": "Hi", '), 400)
    assert error["type"] == "invalid_request_error"
    assert "json" in error["message"].lower()
    server.check_error(post(server, path, content=b"\xff\xfe not utf-8"), 400)
    server.check_error(post(server, path, content=b""), 400)


@pytest.mark.parametrize("path", [COMPLETIONS_PATH, CHAT_PATH])
@pytest.mark.parametrize("with_max_tokens", [True, False], ids=["max_tokens", "no-max_tokens"])
def test_too_long_prompt_is_400_naming_the_limit(server, path, with_max_tokens):
    text = "hello " * (server.max_model_len + 100)
    body = {"prompt": text} if path == COMPLETIONS_PATH else {"messages": [{"role": "user", "content": text}]}
    if with_max_tokens:
        body["max_tokens"] = 8
    error = server.check_error(post(server, path, body), 400)
    assert error["type"] == "invalid_request_error"
    assert str(server.max_model_len) in error["message"], error
    assert error["code"] == "context_length_exceeded"


def test_prompt_plus_max_tokens_over_limit_is_400(server):
    # the prompt alone fits; with max_tokens it does not
    error = server.check_error(
        post(server, COMPLETIONS_PATH, {"prompt": "hello " * 100, "max_tokens": server.max_model_len}), 400
    )
    assert str(server.max_model_len) in error["message"], error


@pytest.mark.parametrize("path", [COMPLETIONS_PATH, CHAT_PATH])
def test_unknown_model_is_404(server, path):
    body = (
        {"model": "no-such-model", "prompt": "Hi"}
        if path == COMPLETIONS_PATH
        else {
            "model": "no-such-model",
            "messages": MESSAGES,
        }
    )
    error = server.check_error(post(server, path, body), 404)
    assert error["param"] == "model"
    assert "no-such-model" in error["message"]


def test_unknown_route_is_404(server):
    with server.http() as client:
        server.check_error(client.get("/v1/nothing-here"), 404)


# ---- authentication --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": "wrong-key"},
        {"Authorization": "Basic abc"},
    ],
    ids=["missing", "wrong", "no-scheme", "basic"],
)
@pytest.mark.parametrize(
    "method,path", [("POST", COMPLETIONS_PATH), ("POST", CHAT_PATH), ("GET", "/v1/models")]
)
def test_bad_api_key_is_401(server, headers, method, path):
    body = {"prompt": "Hi", "messages": MESSAGES} if method == "POST" else None
    with httpx.Client(base_url=server.url, timeout=30) as client:  # no key by default
        response = client.request(method, path, json=body, headers=headers)
    error = server.check_error(response, 401)
    assert error["type"] == "authentication_error"


def test_openai_client_with_wrong_key_raises_authentication_error(server, model_name):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    assert info.value.status_code == 401


def test_open_endpoints_need_no_key(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/version").status_code == 200
        assert client.get("/metrics").status_code == 200


# ---- the openai client sees these errors as its exception types -------------------------------


def test_openai_client_error_types(server, model_name):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=[])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=model_name, prompt="hello " * (server.max_model_len + 10), max_tokens=4
        )
    assert str(server.max_model_len) in info.value.message


def test_valid_request_succeeds_after_bad_ones(server, model_name):
    # one more burst of bad requests right before, then a valid one on the same connection
    with server.http() as client:
        for body in ({"prompt": 1}, {"prompt": "Hi", "max_tokens": -5}, {"model": "x", "prompt": "Hi"}):
            assert 400 <= client.post(COMPLETIONS_PATH, json=body).status_code < 500
        response = client.post(COMPLETIONS_PATH, json={"model": model_name, "prompt": "Hi", "max_tokens": 3})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]
        response = client.post(
            CHAT_PATH, json={"model": model_name, "messages": MESSAGES, "max_tokens": 3, "stream": True}
        )
        assert response.status_code == 200
        assert response.text.rstrip().endswith("data: [DONE]")
    assert httpx.get(server.url + "/health").status_code == 200
