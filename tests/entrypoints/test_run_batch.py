"""The batch runner's parts without an engine: the input file's checks, the output lines, and the
requests posted to an ASGI app in order (``fastdeploy run-batch`` itself: tests/e2e/test_run_batch_cli.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from fastdeploy.entrypoints.openai.run_batch import (
    BatchFileError,
    BatchRequest,
    BatchResult,
    parse_batch_file,
    read_input,
    run_requests,
    write_output,
)


def line(custom_id="a", method="POST", url="/v1/chat/completions", body=None) -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body or {"model": "m"}})


def test_a_batch_file_gives_its_requests_in_order_and_skips_blank_lines():
    text = "\n".join([line("x"), "", "   ", line("y", url="/v1/completions", body={"prompt": "p"})]) + "\n"
    requests = parse_batch_file(text)
    assert [(r.line, r.custom_id, r.url) for r in requests] == [
        (1, "x", "/v1/chat/completions"),
        (4, "y", "/v1/completions"),
    ]
    assert requests[1].body == {"prompt": "p"}


@pytest.mark.parametrize(
    "bad, words",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "custom_id"),
        (line(custom_id=""), "custom_id"),
        (line(method="GET"), "method must be 'POST'"),
        (line(url="/v1/images/generations"), "url '/v1/images/generations'"),
        (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"}), "body"),
        (line(body={"model": "m", "stream": True}), "body.stream"),
        ('{"custom_id": ' + "9" * 5000 + "}", "not JSON"),  # (past 4300 digits: once uncaught)
        ("[" * 100_000 + "]" * 100_000, "not JSON"),
    ],
)
def test_a_bad_line_is_refused_naming_its_line(bad, words):
    with pytest.raises(BatchFileError) as info:
        parse_batch_file(line("first") + "\n" + bad + "\n")
    assert info.value.line == 2
    assert str(info.value).startswith("line 2: ") and words in str(info.value)


def test_a_custom_id_used_twice_is_refused():
    with pytest.raises(BatchFileError, match="line 3: custom_id 'a' is used by an earlier line"):
        parse_batch_file("\n".join([line("a"), line("b"), line("a")]))


def test_the_output_line_is_openais_batch_output_object():
    out = json.loads(BatchResult("c-1", 400, {"error": {"message": "no"}}, "cmpl-1").output_line())
    assert out["id"].startswith("batch_req_") and out["custom_id"] == "c-1"
    assert out["response"] == {
        "status_code": 400,
        "request_id": "cmpl-1",
        "body": {"error": {"message": "no"}},
    }
    assert out["error"] is None


def test_urls_are_not_fetched(tmp_path):
    with pytest.raises(OSError, match="nothing is fetched"):
        read_input("http://169.254.169.254/latest/meta-data")
    path = tmp_path / "in.jsonl"
    path.write_text(line("a"), encoding="utf-8")
    assert read_input(str(path)) == line("a")


def test_the_output_file_appears_whole(tmp_path):
    path = tmp_path / "out.jsonl"
    write_output(str(path), [BatchResult("a", 200, {"id": "x"}, "x"), BatchResult("b", 404, {}, "y")])
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(text)["custom_id"] for text in lines] == ["a", "b"]
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_requests_go_through_the_app_and_come_back_in_order():
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        await asyncio.sleep(0.05 if body["prompt"] == "slow" else 0)  # the first finishes last
        if body["prompt"] == "bad":
            return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
        return {"id": f"cmpl-{body['prompt']}", "choices": [{"text": body["prompt"]}]}

    requests = [
        BatchRequest(1, "s", "/v1/completions", {"prompt": "slow"}),
        BatchRequest(2, "f", "/v1/completions", {"prompt": "fast"}),
        BatchRequest(3, "b", "/v1/completions", {"prompt": "bad"}),
    ]
    results = asyncio.run(run_requests(app, requests))
    assert [(r.custom_id, r.status_code) for r in results] == [("s", 200), ("f", 200), ("b", 400)]
    assert results[0].request_id == "cmpl-slow" and results[0].body["choices"][0]["text"] == "slow"
    assert results[2].body == {"error": {"message": "bad prompt"}} and results[2].request_id
