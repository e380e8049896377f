"""``fastdeploy serve --api-server-count 2``: two API server processes on one port, one engine core.

The same greedy text as one API server for concurrent completions and chats (streamed and
not), served by both processes (``fastdeploy:api_server_requests`` per process); a stream
aborted on either frees its KV blocks; ``/metrics`` from any process is valid Prometheus text
whose counters add up once; DP=2 x 2 API servers gives the same text; multimodal requests work on
both; SIGTERM stops every process; a killed engine core or API server takes the whole server down
(exit 1, nothing left behind).
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.conftest import API_KEY, RemoteServer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors:",
    "The best way to learn Python is",
    "Water boils at",
    "My favourite animal is",
    "In 1969, the first",
]
MAX_TOKENS = 12
PER_SERVER = "fastdeploy:api_server_requests_total{{api_server={}}}"
SUCCESS = "fastdeploy:request_success_total{{finished_reason={}}}"


def api_servers(srv: RemoteServer) -> list[psutil.Process]:
    """The server's API server processes, by index (from the process names in their command lines)."""
    found = {}
    for child in psutil.Process(srv.proc.pid).children():
        name = child.cmdline()[-1]
        if name.startswith("fastdeploy-api-server-"):
            found[int(name.rsplit("-", 1)[1])] = child
    return [found[index] for index in sorted(found)]


async def _one(client, model: str, prompt: str, chat: bool, stream: bool) -> str:
    kwargs = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0}
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if not stream:
            response = await client.chat.completions.create(messages=messages, **kwargs)
            return response.choices[0].message.content
        chunks = await client.chat.completions.create(messages=messages, stream=True, **kwargs)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    if not stream:
        return (await client.completions.create(prompt=prompt, **kwargs)).choices[0].text
    chunks = await client.completions.create(prompt=prompt, stream=True, **kwargs)
    return "".join([c.choices[0].text async for c in chunks if c.choices])


def concurrent_greedy(srv: RemoteServer, model: str) -> list[str]:
    """16 requests at once (each prompt as a completion and as a chat, every other one streamed),
    each on a connection of its own; their texts in order."""

    async def run() -> list[str]:
        clients = [srv.async_openai() for _ in range(2 * len(PROMPTS))]
        jobs = []
        for i, prompt in enumerate(PROMPTS):
            for chat in (False, True):
                client = clients[len(jobs)]
                jobs.append(_one(client, model, prompt, chat, stream=(i + chat) % 2 == 0))
        try:
            return list(await asyncio.gather(*jobs))
        finally:
            for client in clients:
                await client.close()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    """``--api-server-count 2``; the last test of this file kills one of its API servers."""
    srv = RemoteServer(
        tmp_path_factory.mktemp("apis") / "server.log", "--api-server-count", "2", api_key=API_KEY
    )
    try:
        yield srv
    finally:
        if srv.proc.poll() is None or not srv._log.closed:
            srv.stop(check=False)


def test_two_api_server_processes_one_engine_core(two_servers):
    assert len(api_servers(two_servers)) == 2
    assert len(two_servers.engine_core().children()) == 1
    assert "fastdeploy serve: 2 API server processes on port" in two_servers.log(100_000)


def test_concurrent_greedy_text_equals_one_api_server(server, two_servers, model_name):
    before = two_servers.wait_idle()
    texts = concurrent_greedy(two_servers, model_name)
    assert texts == concurrent_greedy(server, model_name)
    assert all(texts), texts
    after = two_servers.wait_idle()
    served = [after[PER_SERVER.format(i)] - before.get(PER_SERVER.format(i), 0.0) for i in (0, 1)]
    assert sum(served) == 16 and min(served) > 0, served  # both processes served some
    finished = sum(after[SUCCESS.format(r)] - before[SUCCESS.format(r)] for r in ("stop", "length", "abort"))
    assert finished == 16
    # the engine's interval counters are added by one API server only: every prompt token is looked up once
    prompt_tokens = after["fastdeploy:prompt_tokens_total"] - before["fastdeploy:prompt_tokens_total"]
    queries = after["fastdeploy:prefix_cache_queries_total"] - before["fastdeploy:prefix_cache_queries_total"]
    assert queries == prompt_tokens > 0


def test_metrics_text_is_valid_from_either_process(two_servers):
    """Each scrape (on a new connection, so from either process) parses; every family and every
    labelled sample appears once; the gauges and counters are there."""
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(6):
        text = two_servers.metrics_text()
        families = list(text_string_to_metric_families(text))
        names = [f.name for f in families]
        assert len(names) == len(set(names)), names
        samples = [(s.name, tuple(sorted(s.labels.items()))) for f in families for s in f.samples]
        assert len(samples) == len(set(samples))
        for name in (
            "fastdeploy:kv_cache_usage_perc",
            "fastdeploy:request_success",
            "fastdeploy:prompt_tokens",
        ):
            assert name in names, names


def test_aborted_streams_free_their_blocks_on_either_api_server(two_servers, model_name):
    """Streams are opened and dropped (each on a new connection) until both API servers had one;
    every one ends as an abort and the KV cache is empty again."""
    body = {
        "model": model_name,
        "prompt": "Tell me a very long story about a dragon.",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    before = two_servers.wait_idle()
    dropped = 0
    for _ in range(12):
        with two_servers.http() as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines, chunks = response.iter_lines(), 0
                while chunks < 3:
                    chunks += next(lines).startswith("data: ")
        dropped += 1
        m = two_servers.wait_idle(timeout=10)
        assert m["fastdeploy:kv_cache_usage_perc"] == 0 and m["fastdeploy:num_requests_running"] == 0, m
        if all(m[PER_SERVER.format(i)] > before.get(PER_SERVER.format(i), 0.0) for i in (0, 1)):
            break
    m = two_servers.wait_idle()
    assert all(m[PER_SERVER.format(i)] > before.get(PER_SERVER.format(i), 0.0) for i in (0, 1)), m
    assert m[SUCCESS.format("abort")] - before[SUCCESS.format("abort")] == dropped
    generated = m["fastdeploy:generation_tokens_total"] - before["fastdeploy:generation_tokens_total"]
    assert generated < 1500 * dropped / 2, generated


def test_stored_responses_are_shared_by_both_api_servers(two_servers, model_name):
    """``/v1/responses`` on new connections until both processes made some: every response is read
    back and continued (``previous_response_id``) on new connections, whichever process answers."""
    before = two_servers.wait_idle()
    made = []
    for _ in range(16):
        with two_servers.http() as http:  # a new connection each time
            body = {"model": model_name, "input": f"Say {len(made)}.", "max_output_tokens": 2}
            response = http.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        made.append(response.json())
        m = two_servers.metrics()
        if len(made) >= 4 and all(
            m[PER_SERVER.format(i)] > before.get(PER_SERVER.format(i), 0.0) for i in (0, 1)
        ):
            break
    assert all(m[PER_SERVER.format(i)] > before.get(PER_SERVER.format(i), 0.0) for i in (0, 1)), m
    for first in made:
        with two_servers.http() as http:
            assert http.get(f"/v1/responses/{first['id']}").json() == first
        with two_servers.http() as http:
            body = {
                "model": model_name,
                "input": "Again.",
                "max_output_tokens": 2,
                "previous_response_id": first["id"],
            }
            response = http.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]


def test_background_responses_are_cancelled_from_either_api_server(two_servers, model_name):
    """Background responses started and cancelled on new connections (so often on different processes:
    the cancel then goes through the store's marker): every one ends cancelled, nothing left running."""
    body = {
        "model": model_name,
        "input": "Tell a long story.",
        "background": True,
        "max_output_tokens": 1500,
        "ignore_eos": True,
    }
    for _ in range(4):
        with two_servers.http() as http:
            queued = http.post("/v1/responses", json=body).json()
        assert queued["status"] == "queued", queued
        with two_servers.http() as http:
            cancelled = http.post(f"/v1/responses/{queued['id']}/cancel").json()
        assert cancelled["status"] == "cancelled", cancelled
        with two_servers.http() as http:
            assert http.get(f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"
    m = two_servers.wait_idle(timeout=10)
    assert m["fastdeploy:num_requests_running"] == 0 and m["fastdeploy:kv_cache_usage_perc"] == 0, m


def test_files_and_batches_are_shared_and_cancelled_from_either_api_server(two_servers, model_name):
    """A file uploaded and batches created on new connections (so on either process): every one is
    read back on new connections; a long batch cancelled from any process ends cancelled with the
    answers of the lines it had sent, and nothing is left running."""
    import json

    line = {"custom_id": "x", "method": "POST", "url": "/v1/completions",
            "body": {"model": model_name, "prompt": "Tell a long story.", "max_tokens": 400, "ignore_eos": True}}  # fmt: skip
    data = "".join(json.dumps({**line, "custom_id": f"r{i}"}) + "\n" for i in range(300)).encode()
    with two_servers.http() as http:
        uploaded = http.post(
            "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}
        ).json()
    for _ in range(6):
        with two_servers.http() as http:
            assert http.get(f"/v1/files/{uploaded['id']}").json()["bytes"] == len(data)
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    with two_servers.http() as http:
        batch = http.post("/v1/batches", json=body).json()
    for _ in range(4):
        with two_servers.http() as http:
            cancelling = http.post(f"/v1/batches/{batch['id']}/cancel").json()
        assert cancelling["status"] in ("cancelling", "cancelled"), cancelling
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with two_servers.http() as http:
            seen = http.get(f"/v1/batches/{batch['id']}").json()
        if seen["status"] == "cancelled":
            break
        time.sleep(0.5)
    assert seen["status"] == "cancelled", seen
    counts = seen["request_counts"]
    assert counts["total"] == 300 and counts["completed"] + counts["failed"] < 300, counts
    m = two_servers.wait_idle(timeout=30)
    assert m["fastdeploy:num_requests_running"] == 0 and m["fastdeploy:kv_cache_usage_perc"] == 0, m


@pytest.mark.slow
def test_dp2_with_two_api_servers(server, server_factory, model_name):
    """Two engine cores, two API servers (each routing its own requests over both ranks): the same
    text; a killed engine core stops the whole server (exit 1, one log line, nothing left behind)."""
    srv = server_factory("--data-parallel-size", "2", "--api-server-count", "2", api_key=API_KEY)
    assert len(api_servers(srv)) == 2
    cores = [p for p in srv.descendants() if p.cmdline()[-1].startswith("fastdeploy-engine-core-")]
    assert len(cores) == 2
    assert concurrent_greedy(srv, model_name) == concurrent_greedy(server, model_name)
    m = srv.wait_idle()
    assert (
        m["fastdeploy:num_requests_running{engine=0}"] == m["fastdeploy:num_requests_running{engine=1}"] == 0
    )
    srv.remember_descendants()
    cores[1].kill()
    assert srv.wait_exit(timeout=30) == 1
    assert "the engine core process of data-parallel rank 1 exited" in srv.log(), srv.log()


def test_multimodal_requests_on_both_api_servers(server_factory, qwen2_vl_dummy, tmp_path):
    """Qwen2-VL with an image feature URL, the same request on new connections until both API servers
    took some: every answer is the first one (each carries its features: no feature mirror with
    several API servers); SIGTERM then stops every process (exit 143, no orphans)."""
    import numpy as np

    from tests.e2e.test_multimodal import chat_body, image_part

    folder, _ = qwen2_vl_dummy
    media = tmp_path / "media"
    media.mkdir()
    np.save(media / "cat.npy", np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32))
    srv = server_factory(
        "--model", str(folder), "--allowed-local-media-path", str(media), "--api-server-count", "2"
    )
    body = chat_body(srv.model_name(), [image_part((media / "cat.npy").as_uri())])
    texts = []
    for _ in range(12):
        with srv.http() as http:  # a new connection each time
            response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["message"]["content"])
        m = srv.metrics()
        if len(texts) >= 4 and all(m.get(PER_SERVER.format(i), 0) > 0 for i in (0, 1)):
            break
    assert all(m[PER_SERVER.format(i)] > 0 for i in (0, 1)), m
    assert texts[0] and texts == [texts[0]] * len(texts)
    m = srv.wait_idle()
    assert m["fastdeploy:encoder_cache_hits_total"] + m["fastdeploy:encoder_cache_misses_total"] == len(texts)
    assert srv.send_signal_and_wait(signal.SIGTERM) == 143


@pytest.mark.parametrize("phase", ["loading", pytest.param("serving", marks=pytest.mark.slow)])
def test_sigterm_stops_everything_and_leaves_no_files(server_factory, monkeypatch, phase):
    """SIGTERM while the engine core loads its model, or while serving (after a request): exit 143
    within a few seconds, no process left, no socket file or metrics directory left in TMPDIR."""
    from tests.e2e.test_lifecycle import ipc_leftovers, wait_until, worker_started

    tmpdir = Path(tempfile.mkdtemp(prefix="fd-apis-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    try:
        srv = server_factory("--api-server-count", "2", wait=phase == "serving")
        if phase == "loading":
            wait_until(lambda: worker_started(srv), 120, srv, "worker process")
        else:
            with srv.http() as http:
                body = {"model": srv.model_name(), "prompt": "Hello", "max_tokens": 2}
                assert http.post("/v1/completions", json=body).status_code == 200
                body = {"model": srv.model_name(), "input": "Hello", "max_output_tokens": 2}
                assert http.post("/v1/responses", json=body).status_code == 200  # a stored response
            assert any(p.name.startswith("fastdeploy-metrics-") for p in tmpdir.iterdir())
            assert any(any(p.iterdir()) for p in tmpdir.glob("fastdeploy-responses-*"))
        started = time.monotonic()
        assert srv.send_signal_and_wait(signal.SIGTERM) == 143
        assert time.monotonic() - started < 3.0  # as with one API server (test_lifecycle.py)
        log = srv.log(tail=1_000_000)
        assert "Traceback" not in log, log
        assert ipc_leftovers(tmpdir) == []
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.slow
def test_dead_engine_core_without_exit_gives_503_from_every_api_server(server_factory):
    """``--no-exit-on-engine-death``: a killed engine core turns ``/health`` to 503 on both API
    servers (each watches the engine core's pid) and the server stays up until SIGTERM."""
    srv = server_factory("--api-server-count", "2", "--no-exit-on-engine-death")
    srv.remember_descendants()
    srv.engine_core().kill()
    deadline = time.monotonic() + 5
    while True:  # new connections, so both processes answer
        codes = [httpx.get(srv.url + "/health", timeout=5).status_code for _ in range(8)]
        if set(codes) == {503} or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert set(codes) == {503}, codes
    time.sleep(1.0)
    assert srv.proc.poll() is None and len(api_servers(srv)) == 2, srv.log()
    assert "the API servers answer 503 until stopped" in srv.log()
    assert srv.send_signal_and_wait(signal.SIGTERM) == 143


def test_killing_an_api_server_stops_the_server(two_servers):
    """Last test of the module: SIGKILL API server 1; the serve process stops everything and exits 1."""
    victim = api_servers(two_servers)[1]
    two_servers.remember_descendants()
    victim.kill()
    code = two_servers.wait_exit(timeout=30)
    assert code == 1
    assert "API server 1" in two_servers.log() and "exited" in two_servers.log()
    with pytest.raises(httpx.HTTPError):  # nothing listens on the port any more
        httpx.get(two_servers.url + "/health", timeout=2)
