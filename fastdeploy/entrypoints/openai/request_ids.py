"""Request ids a client can name: the ``X-Request-Id`` header, as vLLM reads it.

A gateway or client that sends ``X-Request-Id: abc`` gets ``chatcmpl-abc`` (``cmpl-abc``,
``embd-abc``) as the answer's ``id``, so its logs and ours name the request alike. The engine
needs ids unique among the requests in flight, which a client's header need not be (retries,
fan-out), so a client-named request runs under the id plus a random suffix.

With ``serve --enable-request-id-headers`` every answer also carries an ``X-Request-Id`` header
(:class:`RequestIdHeaderMiddleware`): the request's own, or a new one.
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
MAX_CLIENT_ID_CHARS = 128
"""A longer header (or one with characters outside printable ASCII) is not used as an id."""


def client_request_id(value: str | None) -> str | None:
    """``value``, a request's ``X-Request-Id``, when it can name the request (printable ASCII, 1-128
    characters, no spaces), else None."""
    if not value or len(value) > MAX_CLIENT_ID_CHARS or not all("!" <= c <= "~" for c in value):
        return None
    return value


def api_request_id(prefix: str, raw_request: Request | None) -> tuple[str, str]:
    """``(the answer's id, the base of its engine request ids)`` for a request answered under
    ``prefix`` (``chatcmpl``, ``cmpl``, ``embd``): ``PREFIX-<X-Request-Id>`` and that id with a
    random suffix when the client names it, else ``PREFIX-<32 hex digits>`` for both."""
    named = client_request_id(raw_request.headers.get(REQUEST_ID_HEADER) if raw_request is not None else None)
    if named is None:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        return request_id, request_id
    request_id = f"{prefix}-{named}"
    return request_id, f"{request_id}.{uuid.uuid4().hex[:12]}"


class RequestIdHeaderMiddleware:
    """ASGI middleware (``--enable-request-id-headers``): each HTTP answer carries ``X-Request-Id``,
    the request's own header when it sent one, else a new 32-hex-digit id (vLLM's flag)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.encode())
        value = sent if sent else uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER.encode()
                ]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER.encode(), value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
