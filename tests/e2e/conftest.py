"""Fixtures of the end-to-end tests: real ``fastdeploy serve`` processes on 127.0.0.1.

One server (``server``) is shared by the whole session: it is started with
``--api-key`` so that every test also exercises authentication, and every client
sends the key. Tests that kill or stop a server start their own through
``server_factory``. Stopping a server with SIGTERM or SIGINT checks that every
process it started (engine core, worker, multiprocessing helpers) is gone.

Servers run with one intra-op thread: on a busy 2-core machine OpenMP's spinning
threads make a 2-thread worker many times slower, and one is nearly as fast when idle.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

API_KEY = "e2e-test-key"
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
SERVER_ARGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--kv-cache-memory",
    "0.25",
    "--dtype",
    "float32",  # exact greedy comparisons (batched vs alone) need fp32
    "--num-threads",
    "1",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """``fastdeploy serve`` in a subprocess: start, wait for ``/health``, stop and check for orphans."""

    def __init__(
        self,
        log_path: Path,
        *extra_args: str,
        api_key: str | None = None,
        wait: bool = True,
        new_session: bool = False,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.max_model_len = MAX_MODEL_LEN
        self.log_path = log_path
        cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *SERVER_ARGS, *extra_args]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        # new_session: the server leads a process group of its own, as a command started from a shell
        # does; send_signal_and_wait(group=True) then signals the whole group, like Ctrl-C at a terminal
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=new_session
        )
        self._descendants: dict[int, psutil.Process] = {}
        if wait:
            self.wait_healthy()

    # ---- lifecycle -------------------------------------------------------------------

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def wait_healthy(self) -> None:
        """Wait for ``/health`` to answer 200; on failure stop the server and raise with its log."""
        try:
            self._wait_healthy()
        except BaseException:
            self.stop(check=False)
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during start-up:\n{self.log()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.remember_descendants()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy within {START_TIMEOUT_S:.0f} s:\n{self.log()}")

    def wait_exit(self, timeout: float) -> int:
        """Wait for the server to exit by itself (e.g. after its engine died) and check for orphans."""
        self.remember_descendants()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server still running after {timeout:.0f} s:\n{self.log()}") from None
        finally:
            if self.proc.poll() is not None:
                self._log.close()
        procs = list(self._descendants.values())
        alive = [p for p in procs if not self.wait_exited([p], 0)]
        assert not alive, f"processes left after the server exited: {alive}\n{self.log()}"
        return code

    def descendants(self) -> list[psutil.Process]:
        """Every live process below the server process (engine core, worker, resource tracker)."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def remember_descendants(self) -> None:
        """Record the current children, so that :meth:`stop` can check they are gone afterwards."""
        for p in self.descendants():
            self._descendants.setdefault(p.pid, p)

    def engine_core(self) -> psutil.Process:
        """The engine core process: the server's child that itself has a child (the worker)."""
        for child in psutil.Process(self.proc.pid).children():
            if child.children():
                return child
        raise AssertionError(f"no engine core process among {self.descendants()}")

    def worker(self) -> psutil.Process:
        """The worker process: the engine core's only child."""
        children = self.engine_core().children()
        assert len(children) == 1, children
        return children[0]

    def send_signal_and_wait(self, sig: int, timeout: float = STOP_TIMEOUT_S, group: bool = False) -> int:
        """Signal the server process, wait for it to exit, and assert every child it had is gone.

        ``group``: signal its whole process group, like Ctrl-C at a terminal (needs ``new_session``).
        """
        self.remember_descendants()
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(
                f"server did not exit within {timeout:.0f} s of {sig!r}:\n{self.log()}"
            ) from None
        finally:
            self._log.close()
        # children may take a moment to notice (resource tracker: EOF on its pipe)
        procs = list(self._descendants.values())
        if not self.wait_exited(procs, timeout=10):
            alive = [p for p in procs if not self.wait_exited([p], 0)]
            for p in alive:
                p.kill()
            raise AssertionError(f"orphaned processes after {sig!r}: {alive}\n{self.log()}")
        return code

    @staticmethod
    def wait_exited(procs: list[psutil.Process], timeout: float) -> bool:
        """Whether every process has exited within ``timeout`` (a zombie has: it only waits to be reaped)."""

        def exited(p: psutil.Process) -> bool:
            try:
                return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        deadline = time.monotonic() + timeout
        while not all(exited(p) for p in procs):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def stop(self, check: bool = True) -> None:
        """SIGTERM the server; with ``check``, fail if it or any of its children outlives it."""
        if check:
            self.send_signal_and_wait(signal.SIGTERM)
            return
        self.remember_descendants()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        for p in self._descendants.values():
            try:
                p.kill()
            except psutil.Error:
                pass

    # ---- clients ---------------------------------------------------------------------

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def async_http(self, timeout: float = 120.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=timeout)

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def tokenize(self, prompt: str | None = None, **kwargs) -> dict:
        """``POST /tokenize`` of a prompt (or ``messages=[...]``); the decoded response."""
        body = {**kwargs, **({"prompt": prompt} if prompt is not None else {})}
        with self.http() as client:
            response = client.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    def model_name(self) -> str:
        with self.http() as client:
            return client.get("/v1/models").json()["data"][0]["id"]

    # ---- response checks (static: usable without a server) -----------------------------

    @staticmethod
    def check_error(response: httpx.Response, status: int) -> dict:
        """Assert an OpenAI error response with ``status``; return its ``error`` object."""
        assert response.status_code == status, (response.status_code, response.text)
        body = response.json()
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
        assert isinstance(error["type"], str) and error["type"], error
        return error

    @staticmethod
    def sse_events(lines) -> list:
        """Decoded ``data:`` payloads of SSE lines (``[DONE]`` kept as the string)."""
        events = []
        for line in lines:
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
        return events

    # ---- metrics ---------------------------------------------------------------------

    def metrics_text(self) -> str:
        response = httpx.get(self.url + "/metrics", timeout=30)
        assert response.status_code == 200, response.text
        return response.text

    def metrics(self) -> dict[str, float]:
        """``{sample name{labels}: value}`` of every sample, the ``model_name`` label dropped."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
                key = sample.name + (
                    "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else ""
                )
                out[key] = out.get(key, 0.0) + sample.value
        return out

    def wait_idle(self, timeout: float = 5.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and the KV cache is empty; return the last scrape."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m.get("fastdeploy:num_requests_running") == 0
                and m.get("fastdeploy:num_requests_waiting") == 0
                and m.get("fastdeploy:kv_cache_usage_perc") == 0
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> RemoteServer:
    """The shared server (default model, ``--api-key``), stopped with SIGTERM and checked for orphans."""
    srv = RemoteServer(tmp_path_factory.mktemp("server") / "server.log", api_key=API_KEY)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def model_name(server) -> str:
    return server.model_name()


@pytest.fixture
def server_factory(tmp_path):
    """Start dedicated servers: ``server_factory(*args, api_key=None, wait=True, new_session=False)``.

    Any server the test leaves running is stopped (without the orphan check) afterwards.
    """
    started: list[RemoteServer] = []

    def start(
        *args: str, api_key: str | None = None, wait: bool = True, new_session: bool = False
    ) -> RemoteServer:
        srv = RemoteServer(
            tmp_path / f"server{len(started)}.log", *args, api_key=api_key, wait=wait, new_session=new_session
        )
        started.append(srv)
        return srv

    yield start
    for srv in started:
        if srv.proc.poll() is None or not srv._log.closed:
            srv.stop(check=False)
