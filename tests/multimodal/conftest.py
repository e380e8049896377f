"""Local HTTP servers for the feature fetch tests: a plain file server with per-file delays,
redirects and request counts, and a BOS endpoint that checks the BCE v1 signature of GetObject.

The file servers listen on loopback, which the default media URL policy refuses: tests
that fetch from them pass ``url_policy=MediaUrlPolicy(allow_private=True)``."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import json
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, unquote, urlsplit

import pytest


class _Server(ThreadingHTTPServer):
    """A threading server whose handler threads are named (so tests can tell them apart) and daemons."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1", port: int = 0):
        super().__init__((host, port), handler)
        self.files: dict[str, bytes] = {}
        self.redirects: dict[str, str] = {}
        self.hosts: list[str] = []
        """The Host header of every request, in order."""
        self.delays: dict[str, float] = {}
        self.default_delay = 0.0
        self.drips: dict[str, float] = {}
        """Paths answered with a large Content-Length, then one byte every so many seconds."""
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def process_request(self, request, client_address):
        thread = threading.Thread(
            target=self.process_request_thread, args=(request, client_address), name="test-server-handler"
        )
        thread.daemon = True
        thread.start()

    def handle_error(self, request, client_address):
        """Stay quiet when a client hung up mid-response (a cancelled download)."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        """``http://<host>:<port>``."""
        return f"http://{self.server_address[0]}:{self.server_address[1]}"

    @property
    def port(self) -> int:
        return self.server_address[1]

    def count(self, path: str, host: str | None = None) -> None:
        """Count one request for ``path`` and note its Host header."""
        with self.lock:
            self.counts[path] += 1
            self.hosts.append(host or "")


class FileHandler(BaseHTTPRequestHandler):
    """GET /<name>: a 302 to ``redirects[name]``, else the bytes of ``files[name]`` after its delay; else 404."""

    server: _Server

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        self.server.count(path, self.headers.get("Host"))
        if path in self.server.redirects:
            self.send_response(302)
            self.send_header("Location", self.server.redirects[path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if path in self.server.drips:  # a peer that keeps the download alive and sends nothing of use
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
            while True:
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(self.server.drips[path])
        time.sleep(self.server.delays.get(path, self.server.default_delay))
        body = self.server.files.get(path)
        if body is None:
            self.send_error(404, "Not Found")
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


BOS_AK, BOS_SK = "test-access-key", "test-secret-key"


def _normalize(value: str) -> str:
    """BCE's URI encoding: everything but unreserved characters is percent-encoded."""
    return quote(value, safe="-_.~")


def bce_v1_signature_ok(method: str, path: str, query: str, headers: dict[str, str], auth: str) -> bool:
    """Check a ``bce-auth-v1`` Authorization header, reimplemented from the BCE v1 spec."""
    parts = auth.split("/")
    if len(parts) != 6 or parts[0] != "bce-auth-v1" or parts[1] != BOS_AK:
        return False
    prefix = "/".join(parts[:4])
    signed = parts[4].split(";") if parts[4] else ["host", "content-md5", "content-length", "content-type"]
    canonical_headers = sorted(
        f"{_normalize(name)}:{_normalize(value.strip())}"
        for name, value in ((k.lower(), v) for k, v in headers.items())
        if value.strip() and (name.startswith("x-bce-") or name in signed)
    )
    query_pairs = sorted(
        f"{_normalize(unquote(k))}={_normalize(unquote(v))}"
        for k, _, v in (p.partition("=") for p in query.split("&") if p)
    )
    request = "\n".join([method, path, "&".join(query_pairs), "\n".join(canonical_headers)])
    signing_key = hmac.new(BOS_SK.encode(), prefix.encode(), hashlib.sha256).hexdigest()
    expected = hmac.new(signing_key.encode(), request.encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, parts[5])


class BosHandler(FileHandler):
    """Path-style BOS GetObject: ``GET /<bucket>/<key>`` with a valid BCE v1 signature."""

    def _bos_error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"code": code, "message": message, "requestId": "test-request"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-bce-request-id", "test-request")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        split = urlsplit(self.path)
        self.server.count(split.path)
        auth = self.headers.get("Authorization", "")
        if not bce_v1_signature_ok("GET", split.path, split.query, dict(self.headers.items()), auth):
            self._bos_error(403, "AccessDenied", "signature mismatch")
            return
        time.sleep(self.server.delays.get(split.path, self.server.default_delay))
        body = self.server.files.get(unquote(split.path))
        if body is None:
            self._bos_error(404, "NoSuchKey", "The specified key does not exist.")
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", hashlib.md5(body).hexdigest())
        self.send_header("x-bce-request-id", "test-request")
        self.end_headers()
        self.wfile.write(body)


def _serve(
    handler: type[BaseHTTPRequestHandler],
    host: str = "127.0.0.1",
    port: int = 0,
    tls: ssl.SSLContext | None = None,
) -> Iterator[_Server]:
    server = _Server(handler, host, port)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="test-server", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def feature_server() -> Iterator[_Server]:
    """A file server: set ``server.files["/name.npy"] = bytes`` and ``server.delays[...]``."""
    yield from _serve(FileHandler)


@pytest.fixture
def serve_files() -> Iterator[Callable[..., _Server]]:
    """``serve_files(host="127.0.0.1", port=0, tls=None)``: start another file server (HTTPS with ``tls``)."""
    with contextlib.ExitStack() as stack:

        def start(host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None) -> _Server:
            serving = _serve(FileHandler, host, port, tls)
            server = next(serving)
            stack.callback(lambda: next(serving, None))
            return server

        yield start


@pytest.fixture
def bos_server(monkeypatch) -> Iterator[_Server]:
    """A BOS endpoint; FD_BOS_* point at it. Objects live at ``files["/bucket/key"]``."""
    for server in _serve(BosHandler):
        monkeypatch.setenv("FD_BOS_ENDPOINT", server.url)
        monkeypatch.setenv("FD_BOS_ACCESS_KEY", BOS_AK)
        monkeypatch.setenv("FD_BOS_SECRET_KEY", BOS_SK)
        yield server
