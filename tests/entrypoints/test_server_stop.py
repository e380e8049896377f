"""The stop stages of the app (``--shutdown-timeout``): draining refuses new requests and /health
with a 503 (the requests in flight going on: tests/e2e/test_failures.py)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from fastdeploy.config import ServerConfig
from fastdeploy.entrypoints.openai.api_server import build_app
from tests.entrypoints.test_request_fields import fake_engine


def test_a_draining_server_refuses_new_requests_and_health():
    app = build_app(fake_engine(healthy=True), ["m"], ServerConfig())
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        app.state.begin_drain()
        health = client.get("/health")
        completion = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 1})
    assert health.status_code == completion.status_code == 503
    assert health.json()["error"]["code"] == completion.json()["error"]["code"] == "shutting_down"
