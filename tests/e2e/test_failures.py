"""Failure handling and shutdown, each on a server of its own (these tests kill or stop it).

- SIGKILL of the worker (or of the engine core) while a request streams, with
  ``--no-exit-on-engine-death``: the request ends with an error within seconds
  (never a hang), ``/health`` turns 503, new requests get 503s with an OpenAI
  error body, the server stays up past the moment it would otherwise exit, and
  it still stops cleanly (test_lifecycle.py: the default, exiting).
- SIGTERM / SIGINT while a request streams: the server exits with 143 / 130 and
  takes every child process (engine core, worker) with it (test_lifecycle.py:
  the same during start-up).
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from fastdeploy.entrypoints.openai.http_server import ENGINE_DEATH_EXIT_DELAY_S

DETECT_S = 10.0
LONG_STREAM_ARGS = {
    "prompt": "Tell me a very long story about a dragon.",
    "max_tokens": 1500,
    "temperature": 0,
    "extra_body": {"ignore_eos": True},
}


def start_long_stream(server, **overrides) -> tuple[threading.Thread, dict]:
    """Stream a long completion (``overrides``: of :data:`LONG_STREAM_ARGS`) in a thread; returns the
    thread and its result dict.

    The result holds ``chunks`` (received so far), ``started`` (an Event set after
    the first few chunks), and at the end ``error`` (the exception, if any),
    ``finished_at`` and ``finish_reason``.
    """
    result: dict = {"chunks": 0, "started": threading.Event(), "error": None, "finish_reason": None}

    def run() -> None:
        client = server.openai(timeout=60)
        try:
            stream = client.completions.create(
                model=server.model_name(), stream=True, **{**LONG_STREAM_ARGS, **overrides}
            )
            for chunk in stream:
                result["chunks"] += 1
                if result["chunks"] >= 3:
                    result["started"].set()
                for c in chunk.choices:
                    result["finish_reason"] = c.finish_reason or result["finish_reason"]
        except Exception as exc:  # what the test checks
            result["error"] = exc
        finally:
            result["finished_at"] = time.monotonic()
            result["started"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize(
    "victim",  # a killed worker with the default --exit-on-engine-death: test_lifecycle.py
    [pytest.param("worker", marks=pytest.mark.slow), "engine_core"],
)
def test_killed_engine_process_fails_requests_and_health(server_factory, victim):
    srv = server_factory("--no-exit-on-engine-death")
    model = srv.model_name()
    engine_core, worker = srv.engine_core(), srv.worker()

    thread, result = start_long_stream(srv)
    assert result["started"].wait(60), "the stream did not start"
    assert result["error"] is None, result["error"]

    killed_at = time.monotonic()
    (worker if victim == "worker" else engine_core).send_signal(signal.SIGKILL)

    # the pending request ends with an error, not a hang
    thread.join(DETECT_S + 5)
    assert not thread.is_alive(), "the pending request hangs after the worker died"
    assert result["finished_at"] - killed_at < DETECT_S
    assert isinstance(result["error"], openai.APIError), (result["error"], result["finish_reason"])
    assert result["finish_reason"] is None  # it did not "finish" normally

    # /health turns 503 (within the same 10 s)
    deadline = killed_at + DETECT_S
    while httpx.get(srv.url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health still 200 after the worker died"
        time.sleep(0.2)
    srv.check_error(httpx.get(srv.url + "/health", timeout=5), 503)

    # new requests are refused with a 503 and an OpenAI error body (none of them hangs)
    with srv.http(timeout=DETECT_S) as client:
        for path, body in [
            ("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 4}),
            ("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 4, "stream": True}),
            ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}]}),
            (
                "/v1/chat/completions",
                {"model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
            ),
        ]:
            error = srv.check_error(client.post(path, json=body), 503)
            assert error["type"] == "service_unavailable_error"
    with pytest.raises(openai.InternalServerError) as info:
        srv.openai().completions.create(model=model, prompt="Hi", max_tokens=4)
    assert info.value.status_code == 503

    # the engine core and worker do not outlive each other
    assert srv.wait_exited([engine_core, worker], DETECT_S), [engine_core, worker]

    # the API server itself stays up (past the moment it would exit by default), answering 503
    time.sleep(max(0.0, killed_at + ENGINE_DEATH_EXIT_DELAY_S + 1 - time.monotonic()))
    assert srv.proc.poll() is None, srv.log()
    srv.check_error(httpx.get(srv.url + "/health", timeout=5), 503)

    # and SIGTERM still stops it, leaving no process behind
    assert srv.send_signal_and_wait(signal.SIGTERM) == 128 + signal.SIGTERM


@pytest.mark.parametrize(
    "sig",  # SIGINT takes the same stop path as SIGTERM (tests/e2e/test_lifecycle.py sends both at start-up)
    [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
    ids=["SIGTERM", "SIGINT"],
)
def test_signal_stops_every_child_process(server_factory, sig):
    srv = server_factory()
    children = srv.descendants()
    names = {p.pid: " ".join(p.cmdline()) for p in children}
    assert len(children) >= 2, names  # at least the engine core and its worker
    assert srv.worker().pid in names

    thread, result = start_long_stream(srv)
    assert result["started"].wait(60), "the stream did not start"

    code = srv.send_signal_and_wait(sig)  # asserts the server exited and every child is gone
    assert code == 128 + sig, srv.log()
    assert srv.wait_exited(children, 0), names

    # the client in flight was answered (an error or the end of the stream), not left hanging
    thread.join(15)
    assert not thread.is_alive()
    assert result["finish_reason"] is None  # 1500 tokens could not have finished
    # ... and it was told why: the stream ends with a 503 "shutting down" error event
    assert isinstance(result["error"], openai.APIError), result["error"]


def test_shutdown_timeout_lets_the_requests_in_flight_finish(server_factory):
    """``--shutdown-timeout``: after SIGTERM the stream in flight runs to its end while the server takes
    no new connection; then it exits with 143 and leaves no process behind."""
    srv = server_factory("--shutdown-timeout", "60")
    streaming, result = start_long_stream(srv, max_tokens=100)
    assert result["started"].wait(60) and result["error"] is None, result["error"]
    stopped: dict = {}
    stopping = threading.Thread(
        target=lambda: stopped.update(code=srv.send_signal_and_wait(signal.SIGTERM, 90))
    )
    stopping.start()
    time.sleep(1.0)
    with pytest.raises(httpx.TransportError):  # no new connection while it drains
        httpx.get(srv.url + "/health", timeout=5)
    streaming.join(60)
    assert result["error"] is None and result["finish_reason"] == "length", (result, srv.log())
    assert result["chunks"] >= 100
    stopping.join(60)
    assert stopped.get("code") == 128 + signal.SIGTERM, srv.log()
