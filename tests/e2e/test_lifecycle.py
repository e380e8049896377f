"""Process lifecycle of ``fastdeploy serve``, each test on a server of its own.

- SIGINT to the whole process group (Ctrl-C at a terminal) or SIGTERM to the
  server (a supervisor) early in start-up, and again while the worker loads the
  model: the server exits within seconds with 130 / 143, prints no traceback and
  leaves no process and no socket file behind.
- An idle server stops within about a second, and the ``/health`` and ``/metrics``
  polls stay out of the access log.
- A worker killed mid-stream: the stream ends with an error event, ``/health``
  and new requests get 503 within 2 s, and the server exits non-zero within 10 s
  (``--exit-on-engine-death``, the default; test_failures.py covers
  ``--no-exit-on-engine-death``).
- A model path that does not exist: exit 2 with one line on stderr, before
  any process starts.

Every server here gets a fresh ``TMPDIR``, so that socket files left behind show.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.e2e.test_failures import start_long_stream

STARTUP_STOP_S = 3.0
"""A signal during start-up stops everything within this many seconds."""
IDLE_STOP_S = 1.5
"""An idle server stops within this many seconds of SIGTERM."""
HEALTH_503_S = 2.0
ENGINE_DEATH_EXIT_S = 10.0


@pytest.fixture(autouse=True)
def server_tmpdir(monkeypatch) -> Iterator[Path]:
    """A fresh (short: socket paths are limited) ``TMPDIR`` for the servers this test starts."""
    path = Path(tempfile.mkdtemp(prefix="fd-lc-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ipc_leftovers(tmpdir: Path) -> list[str]:
    """Socket files and ``fastdeploy-*`` entries under ``tmpdir``."""
    return sorted(str(p) for p in tmpdir.rglob("*") if p.is_socket() or p.name.startswith("fastdeploy-"))


def worker_started(srv) -> bool:
    """Whether the engine core has started its worker (a grandchild of the server): the model is loading."""
    try:
        return any(child.children() for child in psutil.Process(srv.proc.pid).children())
    except psutil.Error:  # a process exited meanwhile
        return False


def wait_until(condition, timeout: float, srv, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert srv.proc.poll() is None, f"server exited while waiting for {what}:\n{srv.log()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n{srv.log()}"
        time.sleep(0.05)


@pytest.mark.parametrize("phase", ["importing", "loading"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_during_startup_stops_everything(server_factory, server_tmpdir, sig, phase):
    srv = server_factory(wait=False, new_session=True)
    if phase == "importing":
        time.sleep(1.0)  # the server is still importing its modules
    else:  # the worker process exists: the model is loading
        wait_until(lambda: worker_started(srv), 120, srv, "worker process")
    assert srv.proc.poll() is None, srv.log()

    started = time.monotonic()
    # Ctrl-C at a terminal reaches the whole foreground process group; a supervisor signals the server
    code = srv.send_signal_and_wait(sig, timeout=STARTUP_STOP_S + 10, group=sig == signal.SIGINT)
    elapsed = time.monotonic() - started

    log = srv.log(tail=1_000_000)
    assert code == 128 + sig, log
    assert elapsed < STARTUP_STOP_S, (elapsed, log)
    assert "Traceback" not in log, log
    assert "ready at" not in log, log
    assert ipc_leftovers(server_tmpdir) == []


def test_idle_shutdown_is_fast_and_clean(server_factory, server_tmpdir):
    srv = server_factory()
    assert ipc_leftovers(server_tmpdir), "the server keeps no sockets in TMPDIR: the check below is void"
    with srv.http() as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
            assert client.get("/metrics").status_code == 200
        body = {"model": srv.model_name(), "prompt": "Hello", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
        body = {"model": srv.model_name(), "input": "Hello", "max_output_tokens": 2}
        assert client.post("/v1/responses", json=body).status_code == 200  # stored in TMPDIR
    srv.wait_idle()
    assert list(server_tmpdir.glob("fastdeploy-responses-*/resp_*.json"))

    started = time.monotonic()
    code = srv.send_signal_and_wait(signal.SIGTERM)  # also asserts every child process is gone
    elapsed = time.monotonic() - started

    log = srv.log(tail=1_000_000)
    assert code == 128 + signal.SIGTERM, log
    assert elapsed < IDLE_STOP_S, (elapsed, log)
    assert ipc_leftovers(server_tmpdir) == []
    assert '"POST /v1/completions HTTP/1.1" 200' in log  # the access log is on ...
    assert '"GET /health' not in log and '"GET /metrics' not in log, log  # ... without the polls


def test_worker_killed_mid_stream_server_exits(server_factory, server_tmpdir):
    srv = server_factory()  # --exit-on-engine-death is the default
    model = srv.model_name()
    worker = srv.worker()
    thread, result = start_long_stream(srv)
    assert result["started"].wait(60), "the stream did not start"
    assert result["error"] is None, result["error"]

    killed_at = time.monotonic()
    worker.send_signal(signal.SIGKILL)

    # /health turns 503 within 2 s, and new requests are refused with a 503
    while httpx.get(srv.url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() - killed_at < HEALTH_503_S, "/health still 200 after the worker died"
        time.sleep(0.05)
    with srv.http(timeout=5) as client:
        response = client.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert srv.check_error(response, 503)["type"] == "service_unavailable_error"

    # the stream in flight ended with an error event saying the engine died
    thread.join(5)
    assert not thread.is_alive(), "the stream hangs after the worker died"
    assert isinstance(result["error"], openai.APIError), (result["error"], result["finish_reason"])
    assert result["error"].body["code"] == "engine_dead", result["error"].body
    assert result["finish_reason"] is None

    # and the server exits, non-zero, within 10 s of the kill, leaving nothing behind
    code = srv.wait_exit(timeout=ENGINE_DEATH_EXIT_S - (time.monotonic() - killed_at))
    assert code not in (0, None) and code > 0, (code, srv.log())
    assert ipc_leftovers(server_tmpdir) == []


def test_missing_model_path_is_a_usage_error(tmp_path):
    missing = str(tmp_path / "no-such-model")
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", "--model", missing],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("fastdeploy serve: error:") and missing in lines[0], lines
    assert run.stdout == ""
    assert time.monotonic() - started < 30  # refused before any model or process is loaded


def test_https_with_a_key_and_a_certificate(server_factory, tmp_path, monkeypatch):
    """``--ssl-keyfile`` / ``--ssl-certfile``: the server answers HTTPS (a self-signed certificate for
    127.0.0.1, which the client is told to trust) and says so in its ready line."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # httpx (and the openai client) trust it
    srv = server_factory("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), wait=False)
    srv.url = srv.url.replace("http://", "https://")
    srv.wait_healthy()
    assert f"FastDeploy API server ready at https://127.0.0.1:{srv.port}" in srv.log()
    reply = srv.openai().completions.create(model=srv.model_name(), prompt="Hi", max_tokens=2)
    assert reply.choices[0].text is not None
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on that port
        httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5)


def _wait_healthy_on_uds(srv, path: Path) -> httpx.Client:
    """A client over the Unix domain socket ``path`` once ``/health`` answers 200 there."""
    client = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost", timeout=60
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.log()
        try:
            if client.get("/health").status_code == 200:
                return client
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no /health on unix:{path}:\n{srv.log()}")


def test_serves_on_a_unix_domain_socket(server_factory, tmp_path):
    """``--uds PATH`` (vLLM's flag, vLLM's test_uds): HTTP on that socket instead of the TCP port, a
    stale socket file there replaced, and the file removed when the server stops."""
    import socket as socket_module

    path = tmp_path / "fd.sock"
    stale = socket_module.socket(socket_module.AF_UNIX)
    stale.bind(str(path))  # a socket file left by an earlier server
    stale.close()
    srv = server_factory("--uds", str(path), wait=False)
    client = _wait_healthy_on_uds(srv, path)
    try:
        assert "version" in client.get("/version").json()
        model = client.get("/v1/models").json()["data"][0]["id"]
        reply = client.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    finally:
        client.close()
    assert f"FastDeploy API server ready at unix:{path}" in srv.log()
    with pytest.raises(httpx.HTTPError):  # nothing on the TCP port
        httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5)
    srv.remember_descendants()
    assert srv.send_signal_and_wait(signal.SIGTERM) == 143
    assert not path.exists()
