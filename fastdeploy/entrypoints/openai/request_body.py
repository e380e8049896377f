"""Reading request bodies safely: a size limit, a JSON content type, and JSON Python can hold.

- :class:`BodySizeLimitMiddleware` refuses a body over the limit with 413 before
  it is buffered (by ``Content-Length``, and by counting the bytes of a chunked
  body as they arrive), on every route.
- :func:`read_json` decodes a JSON route's body: 415 unless it is sent as
  JSON, 400 for JSON that is invalid, nested deeper than :data:`MAX_JSON_DEPTH`, or
  holds a string with a lone UTF-16 surrogate (``"\\ud800"``), which no
  tokenizer or encoder downstream accepts; the 400 names the field.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastdeploy.entrypoints.openai.errors import (
    BadRequestError,
    ClientDisconnectedError,
    RequestTooLargeError,
    UnsupportedMediaTypeError,
    is_valid_unicode,
)

JSON_MEDIA_TYPES = ("application/json",)
MAX_JSON_DEPTH = 128
"""Most levels of nesting a request body may have. The decoder takes up to Python's recursion
limit, but what handles the value afterwards (``dataclasses.asdict`` of the engine request, the
response store, schema checks) recurses a few frames a level and would fail past a few hundred,
a 500; no request of the API nests near this deep."""


def _too_large(limit: int) -> RequestTooLargeError:
    return RequestTooLargeError(
        f"Payload Too Large: the request body is larger than this server accepts ({limit} bytes; "
        "--max-request-body-bytes).",
        code="request_too_large",
    )


class BodySizeLimitMiddleware:
    """ASGI middleware: HTTP request bodies over ``max_bytes`` end in a 413 before they are read."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _too_large(self.max_bytes)  # the route turns it into the 413
            return message

        await self.app(scope, counting_receive, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(_too_large(self.max_bytes).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def check_json_content_type(request: Request) -> None:
    """415 unless the body is declared as JSON (or not declared at all).

    Browsers send cross-site form posts as ``text/plain``, form or multipart
    bodies without a preflight; refusing them keeps a page from driving a
    local server that has no API key.
    """
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type in JSON_MEDIA_TYPES or media_type.endswith("+json"):
        return
    raise UnsupportedMediaTypeError(
        f"Unsupported Content-Type {media_type or content_type!r}; send the body as application/json.",
        code="unsupported_media_type",
    )


def lone_surrogate_path(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string holding a lone surrogate, or None.

    Keys are checked too (the path then ends at the key). Iterative, so any
    depth the JSON decoder accepted is fine.
    """
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not is_valid_unicode(item):
                return path or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else str(key)
                if not is_valid_unicode(key):
                    return child_path
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def json_depth(value: Any) -> int:
    """Levels of nesting of a decoded JSON value (a scalar: 0). Iterative, as
    :func:`lone_surrogate_path`."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in children)
    return deepest


async def read_json(request: Request) -> Any:
    """The request body decoded as JSON (415, 413 or 400 when it cannot be)."""
    check_json_content_type(request)
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientDisconnectedError("client disconnected before sending its body") from None
    try:
        value = json.loads(raw)
    except ValueError as exc:  # (bad JSON or UTF-8, or an integer past Python's 4300 digits)
        raise BadRequestError(f"Invalid JSON body: {exc}", code="invalid_json") from None
    except RecursionError:
        raise BadRequestError("Invalid JSON body: nested too deeply", code="invalid_json") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise BadRequestError(
            f"Invalid JSON body: nested too deeply (more than {MAX_JSON_DEPTH} levels)", code="invalid_json"
        )
    path = lone_surrogate_path(value)
    if path is not None:
        raise BadRequestError(
            f"{path}: the string holds a lone UTF-16 surrogate, which is not valid Unicode text",
            param=path,
            code="invalid_unicode",
        )
    return value
