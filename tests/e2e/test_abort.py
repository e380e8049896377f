"""A client that goes away aborts its request: the engine stops generating and frees its KV blocks.

Each request asks for far more tokens than the test waits for (``ignore_eos``,
``max_tokens=1500``), so only an abort can make the server idle again within
the few seconds the test polls ``/metrics``.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

LONG_REQUEST = {"prompt": "Tell me a very long story about a dragon.", "max_tokens": 1500, "ignore_eos": True}
SETTLE_S = 5.0
RUNNING = "fastdeploy:num_requests_running"
KV_USAGE = "fastdeploy:kv_cache_usage_perc"
GENERATED = "fastdeploy:generation_tokens_total"
ABORTED = "fastdeploy:request_success_total{finished_reason=abort}"


def wait_settled(server) -> dict[str, float]:
    """Poll /metrics for up to ``SETTLE_S``; assert no request runs and the KV cache is back to idle (0)."""
    m = server.wait_idle(timeout=SETTLE_S)
    assert m[RUNNING] == 0, m
    assert m["fastdeploy:num_requests_waiting"] == 0, m
    assert m[KV_USAGE] == 0, m
    return m


class RunningWatcher:
    """Records the highest ``num_requests_running`` seen while a request is in flight."""

    def __init__(self, server):
        self.server = server
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.server.metrics()[RUNNING])
            except Exception:
                pass
            self._stop.wait(0.1)

    def __enter__(self) -> RunningWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_client_disconnect_aborts(server, model_name, endpoint):
    before = wait_settled(server)
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body = {
            "model": model_name,
            "messages": [{"role": "user", "content": LONG_REQUEST["prompt"]}],
            "max_tokens": 1500,
            "ignore_eos": True,
        }
    else:
        path, body = "/v1/completions", {"model": model_name, **LONG_REQUEST}
    with server.http() as client:
        with client.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            # a few tokens in (chat's first chunk only carries the role); the line iterator is
            # kept, not left with ``break``: closing it would close the connection right here
            lines, chunks = response.iter_lines(), 0
            while chunks < 4:
                chunks += next(lines).startswith("data: ")
            # the gauge follows the engine's step stats, which may trail the first tokens a little
            deadline = time.monotonic() + 5
            while server.metrics()[RUNNING] != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.metrics()[RUNNING] == 1
        # leaving the block closes the connection mid-stream
    after = wait_settled(server)
    generated = after[GENERATED] - before[GENERATED]
    assert 3 <= generated < 1500, generated
    assert after[ABORTED] - before[ABORTED] == 1
    # a fresh scrape a moment later: the request is not still generating
    time.sleep(0.5)
    assert server.metrics()[GENERATED] == after[GENERATED]


def test_non_streaming_client_disconnect_aborts(server, model_name):
    before = wait_settled(server)
    with RunningWatcher(server) as watcher, server.http() as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(
                "/v1/completions",
                json={"model": model_name, **LONG_REQUEST},
                timeout=httpx.Timeout(30, read=4),
            )
    assert watcher.peak == 1, "the request never ran"  # else the check below proves nothing
    after = wait_settled(server)
    generated = after[GENERATED] - before[GENERATED]
    assert 0 < generated < 1500, generated
    assert after[ABORTED] - before[ABORTED] == 1
    time.sleep(0.5)
    assert server.metrics()[GENERATED] == after[GENERATED]


def test_server_serves_after_aborts(server, model_name):
    response = server.openai().completions.create(
        model=model_name, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert response.choices[0].text
    wait_settled(server)
