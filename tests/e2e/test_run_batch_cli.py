"""``fastdeploy run-batch`` on the default model: a file of OpenAI batch requests in, OpenAI's batch
output lines out (the runner's parts alone: tests/entrypoints/test_run_batch.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.e2e.conftest import SERVER_ARGS

COMMAND = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "run-batch"]


def batch_line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_run_batch_answers_every_line_in_order(tmp_path):
    model = "SmolLM2-135M-Instruct"
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    lines = [
        batch_line("chat", "/v1/chat/completions", chat),
        batch_line("completion", "/v1/completions", {"model": model, "prompt": "One, two,", "max_tokens": 4}),
        batch_line("unknown-model", "/v1/chat/completions", {**chat, "model": "gpt-4o"}),
        batch_line("bad-temperature", "/v1/completions", {"model": model, "prompt": "x", "temperature": -1}),
        batch_line("response", "/v1/responses", {"model": model, "input": "Hello", "max_output_tokens": 4}),
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = subprocess.run(
        [*COMMAND, "-i", str(source), "-o", str(target), *SERVER_ARGS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "5 requests: 3 answered, 2 refused (4xx), 0 failed (5xx)" in run.stderr
    outputs = [json.loads(text) for text in target.read_text(encoding="utf-8").splitlines()]
    assert [o["custom_id"] for o in outputs] == [
        "chat",
        "completion",
        "unknown-model",
        "bad-temperature",
        "response",
    ]
    assert len({o["id"] for o in outputs}) == 5 and all(o["error"] is None for o in outputs)
    status = [o["response"]["status_code"] for o in outputs]
    assert status == [200, 200, 404, 400, 200]
    chat_body, completion_body = outputs[0]["response"]["body"], outputs[1]["response"]["body"]
    assert chat_body["object"] == "chat.completion" and chat_body["usage"]["completion_tokens"] == 6
    assert outputs[0]["response"]["request_id"] == chat_body["id"]
    assert (
        completion_body["object"] == "text_completion" and completion_body["usage"]["completion_tokens"] == 4
    )
    assert outputs[2]["response"]["body"]["error"]["code"] == "model_not_found"
    assert outputs[3]["response"]["body"]["error"]["param"] == "temperature"
    assert outputs[4]["response"]["body"]["object"] == "response"


def test_a_bad_batch_file_is_refused_before_the_model_loads(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(batch_line("a", "/v1/completions", {"prompt": "x"}) + "\n{oops\n", encoding="utf-8")
    started = time.monotonic()
    run = subprocess.run(
        [*COMMAND, "-i", str(source), "-o", str(tmp_path / "out.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert (
        run.stderr.strip()
        == f"fastdeploy run-batch: error: {source}: line 2: not JSON (Expecting property name enclosed in double quotes at column 2)"
    )
    assert not (tmp_path / "out.jsonl").exists()
    assert time.monotonic() - started < 30  # nothing was loaded
