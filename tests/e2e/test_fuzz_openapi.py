"""Schema-driven fuzzing of the live server with schemathesis, from its own ``/openapi.json``.

Every route of the document gets a few hundred generated requests, valid ones
(positive) and invalid ones (negative), with generation kept small
(``max_tokens`` <= 4, ``n`` <= 2). No response may be a 5xx, every error must be
an OpenAI error body, and the API server's memory must come back near where
it started, oversized prompts included.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import psutil
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

API_KEY = "fuzz-key"
EXAMPLES = {"POST": int(os.environ.get("FD_FUZZ_EXAMPLES", "250")), "GET": 25}
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from tests.e2e.conftest import RemoteServer

    srv = RemoteServer(tmp_path_factory.mktemp("fuzz") / "server.log", api_key=API_KEY)
    try:
        yield srv
    finally:
        srv.stop()


def bounded(body: Any, model_name: str) -> Any:
    """The generated body with generation kept cheap (and, half the time, the real model name)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in MAX_TOKEN_FIELDS:
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
            body[key] = max(min(body[key], 4), -1)
    if "messages" in body or "prompt" in body:
        body.setdefault("max_tokens", 4)
    if "input" in body:
        body.setdefault("max_output_tokens", 4)
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool):
        body["n"] = min(body["n"], 2)
    if isinstance(body.get("model"), str) and hash(json.dumps(body, sort_keys=True, default=str)) % 2:
        body["model"] = model_name
    return body


def check_response(response: httpx.Response, what: str) -> None:
    assert response.status_code < 500, f"{what} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, (what, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}, (what, body)
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], (what, body)


def fuzz_operation(op: Any, client: httpx.Client, model_name: str, counts: dict[str, int]) -> None:
    """Send the operation's generated requests (valid and invalid ones) and check every response."""
    method = op.method.upper()
    label = f"{method} {op.path}"
    strategy = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

    @settings(
        max_examples=EXAMPLES.get(method, 25),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        kwargs: dict[str, Any] = {"params": case.query or None}
        if method == "POST":
            body = bounded(case.body, model_name)
            try:
                kwargs["content"] = json.dumps(body, allow_nan=True)
            except (TypeError, ValueError):
                return  # not representable as JSON text: nothing to send
            kwargs["headers"] = {"Content-Type": "application/json"}
        response = client.request(method, op.path, **kwargs)
        check_response(response, f"{label} {str(kwargs.get('content'))[:300]}")
        counts[label] = counts.get(label, 0) + 1

    run()


def rss_mib(server) -> float:
    return psutil.Process(server.proc.pid).memory_info().rss / 2**20


def test_fuzz_every_route_no_5xx_and_memory_returns(fuzz_server):
    server = fuzz_server
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=server.headers)
    model_name = server.model_name()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /v1/responses",
        "GET /v1/responses/{response_id}",
        "POST /tokenize",
        "POST /detokenize",
        "GET /v1/models",
    }
    client = httpx.Client(base_url=server.url, headers=server.headers, timeout=120)
    client.post("/v1/completions", json={"model": model_name, "prompt": "warm up", "max_tokens": 2})
    idle_rss = rss_mib(server)
    counts: dict[str, int] = {}

    for op in operations:
        fuzz_operation(op, client, model_name, counts)

    # what once bloated the server: multi-megabyte prompts on every tokenizing route
    for path, body in [
        ("/tokenize", {"prompt": "hello " * 1_000_000}),
        ("/v1/completions", {"prompt": "hello " * 1_000_000, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 2_000_000}]}),
    ]:
        for _ in range(3):
            check_response(client.post(path, json=body), path)
    client.close()

    after_rss = rss_mib(server)
    print(f"\nfuzz requests per route: {counts}")
    print(f"API server RSS: idle {idle_rss:.0f} MiB, after the fuzz run {after_rss:.0f} MiB")
    assert all(n > 0 for n in counts.values())
    assert after_rss < idle_rss * 1.25 + 50, (idle_rss, after_rss)
    assert httpx.get(server.url + "/health").status_code == 200
