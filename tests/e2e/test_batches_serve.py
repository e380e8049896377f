"""OpenAI's Files and Batches APIs on a real server, driven by the official ``openai`` client: a batch
file uploaded, run in the background, its answers read back (2xx lines in the output file, the
others in the error file, each the server's own answer to that body); a bad file fails the batch
naming its line; bad batch requests are 400s naming the field; unknown ids 404; files list and
delete; the API key guards the routes."""

from __future__ import annotations

import io
import json
import time

import pytest

from tests.e2e.conftest import RemoteServer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


def _wait(client, batch_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s")


def _upload(client, lines: list[dict], purpose: str = "batch"):
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose=purpose)


def test_a_batch_runs_and_its_answers_come_back(server: RemoteServer, model_name: str):
    client = server.openai()
    lines = [
        {"custom_id": f"c-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model_name, "messages": [{"role": "user", "content": p}], "max_tokens": 6,
                  "temperature": 0}}
        for i, p in enumerate(PROMPTS)
    ]  # fmt: skip
    lines.append(
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model_name, "messages": [{"role": "user", "content": "x"}], "temperature": -1}}
    )  # fmt: skip
    uploaded = _upload(client, lines)
    assert uploaded.id.startswith("file-") and uploaded.purpose == "batch" and uploaded.bytes > 0
    assert client.files.retrieve(uploaded.id).filename == "input.jsonl"
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
        metadata={"job": "e2e"},
    )  # fmt: skip
    assert batch.id.startswith("batch_") and batch.status in ("validating", "in_progress", "completed")
    done = _wait(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    assert done.metadata == {"job": "e2e"} and done.completed_at >= done.created_at
    out = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == ["c-0", "c-1", "c-2"]
    for r in out:
        assert r["response"]["status_code"] == 200 and r["error"] is None
        prompt = PROMPTS[int(r["custom_id"][2:])]
        direct = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": prompt}], max_tokens=6, temperature=0
        )
        assert r["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    errors = [json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["param"] == "temperature"
    assert done.id in [b.id for b in client.batches.list()]
    assert uploaded.id in [f.id for f in client.files.list()]
    assert client.files.delete(done.output_file_id).deleted
    with pytest.raises(Exception) as gone:
        client.files.retrieve(done.output_file_id)
    assert getattr(gone.value, "status_code", None) == 404


def test_a_bad_file_fails_its_batch_naming_the_line(server: RemoteServer, model_name: str):
    client = server.openai()
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": model_name, "prompt": "hi", "max_tokens": 2}}  # fmt: skip
    uploaded = _upload(client, [good, {**good, "url": "/v1/chat/completions", "custom_id": "b"}])
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    done = _wait(client, batch.id)
    assert done.status == "failed" and done.failed_at is not None
    assert done.errors.data[0].line == 2 and "endpoint" in done.errors.data[0].message


def test_bad_batch_requests_are_400s_and_unknown_ids_404s(server: RemoteServer, model_name: str):
    http = server.http()
    uploaded = server.openai().files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    for body, param in (
        ({"input_file_id": uploaded.id, "endpoint": "/v1/moderations", "completion_window": "24h"}, "endpoint"),
        ({"input_file_id": uploaded.id, "endpoint": "/v1/completions", "completion_window": "1h"},
         "completion_window"),
        ({"input_file_id": 7, "endpoint": "/v1/completions", "completion_window": "24h"}, "input_file_id"),
        ({"input_file_id": uploaded.id, "endpoint": "/v1/completions", "completion_window": "24h",
          "metadata": {"a": 1}}, "metadata"),
    ):  # fmt: skip
        error = RemoteServer.check_error(http.post("/v1/batches", json=body), 400)
        assert error["param"] == param, body
    for path in ("/v1/batches/batch_" + "0" * 32, "/v1/files/file-" + "0" * 32, "/v1/files/../../etc/passwd"):
        assert http.get(path).status_code == 404, path
    error = RemoteServer.check_error(
        http.post("/v1/files", files={"file": ("x", b"x")}, data={"purpose": "nonsense"}), 400
    )
    assert error["param"] == "purpose"
    assert server.http().get("/v1/files", headers={"Authorization": "Bearer wrong"}).status_code == 401
