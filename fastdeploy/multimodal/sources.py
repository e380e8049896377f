"""Read the bytes behind one feature URL: ``file://``, ``http(s)://`` or ``bos://bucket/key``.

Every reader is bounded: at most ``max_bytes`` are read (and, with a
:class:`RequestBytes`, at most its cap over all of a request's URLs), and one URL
takes at most about ``timeout_s``: an http(s) download reads what arrives as it
arrives (no chunk is waited for in full) and a watchdog shuts its socket down at
the deadline, so a peer that sends a byte at a time, or nothing, cannot hold it
longer. A reader also stops once ``cancel`` is set, which is how
:func:`fastdeploy.multimodal.fetch.fetch_features` stops the downloads of a
request that has already failed or whose client has gone. Only regular files are
read from ``file://`` paths (a FIFO would block). Every failure is a
:class:`FeatureFetchError` naming the URL.

``http(s)://`` URLs go through a :class:`~fastdeploy.multimodal.url_policy.MediaUrlPolicy`
(allowed hosts, no private addresses by default; checked and pinned at every
redirect hop), and every failed download answers the client with the same text,
:data:`HTTP_FETCH_FAILED` (the detail goes to the server log), so the error
cannot be used to probe which hosts and ports answer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from fastdeploy import envs
from fastdeploy.multimodal.inputs import FeatureFetchError
from fastdeploy.multimodal.url_policy import MediaUrlPolicy, MediaUrlRefused

logger = logging.getLogger(__name__)

SCHEMES: tuple[str, ...] = ("file", "http", "https", "bos")
CHUNK_BYTES = 1 << 20
BOS_READ_BYTES = 1 << 16
BOS_MAX_RETRIES = 2
"""Retries of one BOS GetObject on I/O errors, 5xx and expired requests (the SDK's policy)."""
HTTP_FETCH_FAILED = "no loadable feature file could be downloaded from it"
"""The reason of every failed http(s) download, whatever went wrong (no port-scan oracle)."""
URL_REFUSED = "the URL is not allowed by the server's media URL policy"
"""The reason of an http(s) URL (or redirect) refused by :class:`MediaUrlPolicy`."""


class FetchCancelled(Exception):
    """Raised inside a reader when its request was cancelled (another item failed)."""


class RequestBytes:
    """The bytes all downloads of one request may hold together (thread-safe): with several URLs
    downloading at once, each under its own ``max_bytes``, a request could otherwise keep
    gigabytes in the server."""

    def __init__(self, cap: int):
        self.cap = cap
        self._used = 0
        self._lock = threading.Lock()

    def take(self, url: str, size: int) -> None:
        """Count ``size`` more bytes; a :class:`FeatureFetchError` past the cap."""
        with self._lock:
            self._used += size
            used = self._used
        if used > self.cap:
            raise FeatureFetchError(
                url, f"the request's feature files exceed the limit of {self.cap} bytes together"
            )


class _Budget:
    """The limits of one read: byte cap, deadline, the request's byte total and cancel flag."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        max_bytes: int,
        cancel: threading.Event | None,
        request_bytes: RequestBytes | None = None,
    ):
        self.url, self.timeout_s, self.max_bytes, self.cancel = url, timeout_s, max_bytes, cancel
        self.request_bytes = request_bytes
        self.deadline = time.monotonic() + timeout_s

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def check_size(self, size: int | None) -> None:
        if size is not None and size > self.max_bytes:
            raise FeatureFetchError(self.url, f"{size} bytes exceeds the limit of {self.max_bytes} bytes")

    def collect(self, chunks: Iterator[bytes]) -> bytes:
        """Join ``chunks``, enforcing the byte caps, the deadline and cancellation between chunks.
        (One growing buffer, not a list of chunks: freed, it goes back to the system whole.)"""
        data = bytearray()
        for chunk in chunks:
            if self.cancelled():
                raise FetchCancelled(self.url)
            if self.expired():
                raise FeatureFetchError(self.url, f"timed out after {self.timeout_s:g} s")
            self.check_size(len(data) + len(chunk))
            if self.request_bytes is not None:
                self.request_bytes.take(self.url, len(chunk))
            data += chunk
        return bytes(data)


class _Watchdog:
    """Shuts a download's socket down at its deadline or once its request is cancelled, so that a
    read blocked on a peer that sends nothing returns at once (a read timeout alone would let a
    peer that sends a byte now and then hold the download, and its thread, indefinitely)."""

    POLL_S = 0.05

    def __init__(self, sock: socket.socket | None, budget: _Budget):
        self.sock, self.budget = sock, budget
        self.fired = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _Watchdog:
        if self.sock is not None:
            self._thread = threading.Thread(target=self._watch, name="fd-feature-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(self.POLL_S):
            if self.budget.cancelled() or self.budget.expired():
                self.fired = True
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
                return


def _response_socket(response: httpx.Response) -> socket.socket | None:
    """The socket under a streamed httpx response (None where the transport does not expose it)."""
    stream = response.extensions.get("network_stream")
    try:
        sock = stream.get_extra_info("socket") if stream is not None else None
    except Exception:  # another transport (tests' mocks): no watchdog, the read timeouts remain
        return None
    return sock if isinstance(sock, socket.socket) else None


def scheme_of(url: str) -> str:
    """The URL's scheme (lower case), or a :class:`FeatureFetchError` if it is not supported."""
    if not isinstance(url, str) or not url:
        raise FeatureFetchError(repr(url), "a feature URL must be a non-empty string")
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError as exc:  # e.g. "http://[::1" (an unclosed IPv6 address)
        raise FeatureFetchError(url, f"malformed URL: {exc}") from None
    if scheme not in SCHEMES:
        raise FeatureFetchError(url, f"unsupported URL scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    return scheme


def local_path(url: str, allowed_local_media_path: str | None) -> str:
    """The real path of a ``file://`` URL, refused unless it lies under ``allowed_local_media_path``."""
    if not allowed_local_media_path:
        raise FeatureFetchError(
            url, "file:// URLs are refused: the server was started without --allowed-local-media-path"
        )
    parts = urlsplit(url)  # (scheme_of has parsed it)
    if parts.netloc not in ("", "localhost"):
        raise FeatureFetchError(url, "file:// URLs must name a local path (file:///path)")
    try:
        path = os.path.realpath(unquote(parts.path))
    except ValueError as exc:  # an embedded NUL byte
        raise FeatureFetchError(url, f"malformed path: {exc}") from None
    root = os.path.realpath(allowed_local_media_path)
    if os.path.commonpath([path, root]) != root:
        raise FeatureFetchError(url, "the path lies outside --allowed-local-media-path")
    return path


def source_key(url: str, allowed_local_media_path: str | None) -> str:
    """What identifies a URL's content for the URL → ``mm_hash`` index of the encoder cache.

    Remote URLs are taken as immutable; a local file adds its size and
    modification time, so rewriting the file is noticed.
    """
    if scheme_of(url) != "file":
        return url
    path = local_path(url, allowed_local_media_path)
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise FeatureFetchError(url, f"cannot read the file: {exc.strerror}") from None
    return f"file://{path}#{stat.st_size}:{stat.st_mtime_ns}"


def _read_file(url: str, allowed_local_media_path: str | None, budget: _Budget) -> bytes:
    path = local_path(url, allowed_local_media_path)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):  # a FIFO or device would block or never end
            raise FeatureFetchError(url, "not a regular file")
        budget.check_size(info.st_size)
        with open(path, "rb") as f:
            return budget.collect(iter(lambda: f.read(CHUNK_BYTES), b""))
    except OSError as exc:
        raise FeatureFetchError(url, f"cannot read the file: {exc.strerror}") from None


def new_http_client() -> httpx.Client:
    """The client for feature downloads: direct connections, none reused.

    Every hop connects to an address pinned for one host name (with that name as
    TLS SNI), so a kept-alive connection must not serve another name that happens
    to resolve to the same address. ``HTTP(S)_PROXY`` is not used (an explicit
    transport turns it off): a proxy would resolve the name again, out of reach
    of the address check, and would receive the pinned address as the TLS name.
    """
    return httpx.Client(transport=httpx.HTTPTransport(limits=httpx.Limits(max_keepalive_connections=0)))


def http_fetch_failed(url: str, detail: str) -> FeatureFetchError:
    """The one client-facing error of every failed http(s) download; ``detail`` goes to the log only.

    Telling "connection refused" from "timed out" or "bad file" would let clients
    probe the server's network, so the client always reads the same text.
    """
    logger.warning("could not fetch feature URL %s: %s", url, detail)
    return FeatureFetchError(url, HTTP_FETCH_FAILED)


def _read_http(url: str, client: httpx.Client, budget: _Budget, policy: MediaUrlPolicy) -> bytes:
    """GET ``url``, following up to ``policy.max_redirects`` redirects, each hop checked and pinned.

    Every hop's host must pass the allow-list and resolve only to allowed
    addresses; the request goes to the checked address with the original
    ``Host`` header and TLS SNI / certificate check for the host name.
    """
    try:
        current = httpx.URL(url)
        for _ in range(policy.max_redirects + 1):
            if current.scheme not in ("http", "https"):
                raise MediaUrlRefused(f"redirect to a {current.scheme or 'relative'} URL: {current}")
            host = current.raw_host.decode("ascii")
            port = current.port or (443 if current.scheme == "https" else 80)
            address = policy.pin(host, port)
            # TLS keeps checking the certificate against the host name, not the address
            extensions = {"sni_hostname": host} if current.scheme == "https" and address != host else {}
            remaining = max(budget.deadline - time.monotonic(), 0.001)
            with client.stream(
                "GET",
                current.copy_with(host=address),
                # identity: nothing to decompress (a small gzip body can expand a thousandfold)
                headers={"Host": current.netloc.decode("ascii"), "Accept-Encoding": "identity"},
                timeout=remaining,
                follow_redirects=False,
                extensions=extensions,
            ) as response:
                location = response.headers.get("location")
                if response.is_redirect and location:
                    current = current.join(location)
                    continue
                if response.status_code != 200:
                    raise FeatureFetchError(url, f"HTTP {response.status_code} {response.reason_phrase}")
                length = response.headers.get("content-length")
                budget.check_size(int(length) if length and length.isdigit() else None)
                with _Watchdog(_response_socket(response), budget) as watchdog:
                    try:
                        data = budget.collect(response.iter_bytes())  # (no size: each read as it comes)
                    except httpx.HTTPError:
                        if not watchdog.fired:
                            raise
                    if watchdog.fired:  # (a body without a length just ends when the socket is shut)
                        if budget.cancelled():
                            raise FetchCancelled(url)
                        raise FeatureFetchError(url, f"timed out after {budget.timeout_s:g} s")
                    return data
        raise FeatureFetchError(url, f"more than {policy.max_redirects} redirects")
    except FetchCancelled:
        raise
    except MediaUrlRefused as exc:
        logger.warning("feature URL %s refused by the media URL policy: %s", url, exc)
        raise FeatureFetchError(url, URL_REFUSED) from None
    except FeatureFetchError as exc:
        raise http_fetch_failed(url, exc.reason) from None
    except httpx.TimeoutException:
        raise http_fetch_failed(url, f"timed out after {budget.timeout_s:g} s") from None
    except Exception as exc:  # connection refused, DNS failure, bad URL, TLS...: all look the same
        raise http_fetch_failed(url, f"{type(exc).__name__}: {exc}") from None


@functools.lru_cache(maxsize=4)
def _bos_client(endpoint: str, access_key: str, secret_key: str, timeout_ms: int) -> Any:
    """A ``baidubce`` BosClient (imported lazily: only bos:// URLs need the SDK)."""
    try:
        from baidubce.auth.bce_credentials import BceCredentials
        from baidubce.bce_client_configuration import BceClientConfiguration
        from baidubce.retry.retry_policy import BackOffRetryPolicy
        from baidubce.services.bos.bos_client import BosClient
    except ImportError as exc:  # pragma: no cover - the SDK is a declared dependency
        raise RuntimeError("bos:// feature URLs need bce-python-sdk: pip install bce-python-sdk") from exc
    config = BceClientConfiguration(
        credentials=BceCredentials(access_key, secret_key),
        endpoint=endpoint,
        connection_timeout_in_mills=timeout_ms,
        retry_policy=BackOffRetryPolicy(
            max_error_retry=BOS_MAX_RETRIES, max_delay_in_millis=2000, base_interval_in_millis=200
        ),
    )
    return BosClient(config)


def _bos_error(exc: Exception) -> str:
    """A one-line reason from a baidubce exception (the SDK's own text carries tracebacks)."""
    error = getattr(exc, "last_error", None) or exc
    status = getattr(error, "status_code", None)
    code = getattr(error, "code", None)
    code = code.decode() if isinstance(code, bytes) else code
    message = str(error.args[0] if error.args else error)
    message = message.decode() if isinstance(message, bytes) else message
    parts = ["BOS GetObject failed:", f"HTTP {status}" if status else "", code or "", message]
    return " ".join(part for part in parts if part)


def _read_bos(url: str, budget: _Budget) -> bytes:
    parts = urlsplit(url)
    bucket, key = parts.netloc, unquote(parts.path.lstrip("/"))
    if not bucket or not key:
        raise FeatureFetchError(url, "a BOS URL must be bos://bucket/key")
    endpoint, access_key, secret_key = envs.FD_BOS_ENDPOINT, envs.FD_BOS_ACCESS_KEY, envs.FD_BOS_SECRET_KEY
    if not (endpoint and access_key and secret_key):
        raise FeatureFetchError(
            url, "bos:// URLs need FD_BOS_ENDPOINT, FD_BOS_ACCESS_KEY and FD_BOS_SECRET_KEY set on the server"
        )
    client = _bos_client(endpoint, access_key, secret_key, max(1, int(budget.timeout_s * 1000)))
    try:
        response = client.get_object(bucket, key)
    except Exception as exc:  # BceServerError / BceHttpClientError / socket errors after retries
        raise FeatureFetchError(url, _bos_error(exc)) from None
    stream = response.data
    try:
        length = getattr(response.metadata, "content_length", None)
        budget.check_size(int(length) if length is not None else None)
        # small reads, so the deadline and the cancel flag are checked often (each read is bounded
        # by the client's socket timeout)
        return budget.collect(iter(lambda: stream.read(BOS_READ_BYTES), b""))
    except OSError as exc:
        raise FeatureFetchError(url, f"BOS read failed: {exc}") from None
    finally:
        stream.close()


def read_url(
    url: str,
    *,
    timeout_s: float,
    max_bytes: int,
    allowed_local_media_path: str | None = None,
    http_client: httpx.Client | None = None,
    cancel: threading.Event | None = None,
    url_policy: MediaUrlPolicy | None = None,
    request_bytes: RequestBytes | None = None,
) -> bytes:
    """The bytes at ``url`` (file, http(s) or bos), within the time and size limits.

    http(s) URLs are checked against ``url_policy`` (default: the strict
    :class:`MediaUrlPolicy`, no private addresses) at every redirect hop.
    ``request_bytes`` counts the bytes against the request's total.
    """
    scheme = scheme_of(url)
    budget = _Budget(url, timeout_s, max_bytes, cancel, request_bytes)
    if scheme == "file":
        return _read_file(url, allowed_local_media_path, budget)
    if scheme == "bos":
        return _read_bos(url, budget)
    policy = url_policy if url_policy is not None else MediaUrlPolicy()
    if http_client is not None:
        return _read_http(url, http_client, budget, policy)
    with new_http_client() as client:
        return _read_http(url, client, budget, policy)
