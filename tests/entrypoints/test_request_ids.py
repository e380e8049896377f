"""Client-named request ids (``X-Request-Id``) and ``--enable-request-id-headers`` (the answers'
ids under a real engine: tests/e2e/test_openai_compat.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from fastdeploy.config import ServerConfig
from fastdeploy.entrypoints.openai.api_server import build_app
from fastdeploy.entrypoints.openai.request_ids import api_request_id, client_request_id
from tests.entrypoints.test_request_fields import fake_engine


def raw(headers: dict[str, str]) -> SimpleNamespace:
    return SimpleNamespace(headers=headers)


@pytest.mark.parametrize(
    "value, named",
    [
        ("trace-1", "trace-1"),
        ("a" * 128, "a" * 128),
        ("a" * 129, None),
        ("", None),
        ("has space", None),
        ("caf\u00e9", None),
    ],
)
def test_which_headers_name_a_request(value, named):
    assert client_request_id(value) == named


def test_a_named_request_keeps_its_name_and_runs_under_a_unique_engine_id():
    first = api_request_id("chatcmpl", raw({"x-request-id": "trace-1"}))
    second = api_request_id("chatcmpl", raw({"x-request-id": "trace-1"}))
    assert first[0] == second[0] == "chatcmpl-trace-1"
    assert first[1] != second[1] and first[1].startswith("chatcmpl-trace-1.")


def test_an_unnamed_request_gets_one_random_id():
    answer, engine = api_request_id("cmpl", raw({}))
    assert answer == engine and answer.startswith("cmpl-") and len(answer) == 5 + 32
    assert api_request_id("cmpl", None)[0] != answer


@pytest.mark.parametrize("enabled", [False, True])
def test_enable_request_id_headers(enabled):
    app = build_app(fake_engine(healthy=True), ["m"], ServerConfig(enable_request_id_headers=enabled))
    with TestClient(app) as client:
        echoed = client.get("/v1/models", headers={"X-Request-Id": "abc-123"})
        fresh = client.get("/health")
    if not enabled:
        assert "x-request-id" not in echoed.headers and "x-request-id" not in fresh.headers
        return
    assert echoed.headers["x-request-id"] == "abc-123"
    assert len(fresh.headers["x-request-id"]) == 32 and int(fresh.headers["x-request-id"], 16) >= 0
