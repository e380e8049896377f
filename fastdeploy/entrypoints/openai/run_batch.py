"""``fastdeploy run-batch``: a file of OpenAI Batch API requests run through the engine, offline.

The input is OpenAI's batch input format, one JSON object a line::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

and the output OpenAI's batch output format, one line per request in the input's order::

    {"id": "batch_req_...", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

A request the API refuses (a bad parameter, an unknown model) keeps its line: ``status_code`` is
the API's 4xx and ``body`` its error object, as OpenAI's batches report it. The file itself is
checked whole before the model loads (every line a JSON object with a unique ``custom_id``,
``method`` POST, a supported ``url``, an object ``body`` that does not ask to stream): a file
that fails is refused naming its first bad line, and nothing runs (OpenAI's batches fail
validation the same way; ``vllm run-batch`` exits non-zero too).

Each request goes through the same FastAPI app ``fastdeploy serve`` serves (in process, over
httpx's ASGI transport, no socket), so its validation, defaults and answers are the server's.
All requests are submitted at once (at most :data:`MAX_IN_FLIGHT` in flight) and the engine
batches them as it would concurrent clients.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any

BATCH_URLS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
"""The endpoints a batch line may name (OpenAI's batch endpoints that this server serves)."""
MAX_IN_FLIGHT = 1024
"""Most requests handed to the app at once (the rest wait their turn; memory stays bounded)."""


class BatchFileError(ValueError):
    """The input file is not a valid batch file: ``line`` (1-based) says where."""

    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}")
        self.line = line


@dataclass(frozen=True)
class BatchRequest:
    """One line of the input file."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BatchResult:
    """What one request got back from the app."""

    custom_id: str
    status_code: int
    body: Any
    request_id: str

    def output_line(self) -> str:
        """The request's line of the output file (OpenAI's batch output object)."""
        return json.dumps(
            {
                "id": f"batch_req_{uuid.uuid4().hex}",
                "custom_id": self.custom_id,
                "response": {
                    "status_code": self.status_code,
                    "request_id": self.request_id,
                    "body": self.body,
                },
                "error": None,
            },
            ensure_ascii=False,
        )


def parse_batch_file(text: str) -> list[BatchRequest]:
    """The requests of a batch file (blank lines skipped); :class:`BatchFileError` at the first bad line."""
    requests: list[BatchRequest] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip():
            request = _parse_line(number, raw)
            if request.custom_id in seen:
                raise BatchFileError(number, f"custom_id {request.custom_id!r} is used by an earlier line")
            seen.add(request.custom_id)
            requests.append(request)
    return requests


def _parse_line(number: int, raw: str) -> BatchRequest:
    """One non-blank line as a :class:`BatchRequest`, or :class:`BatchFileError` saying what is wrong."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BatchFileError(number, f"not JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # (an integer past Python's 4300 digits)
        raise BatchFileError(number, f"not JSON ({exc})") from None
    except RecursionError:
        raise BatchFileError(number, "not JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise BatchFileError(number, "must be a JSON object with custom_id, method, url and body")
    custom_id, method, url, body = (obj.get(key) for key in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchFileError(number, "custom_id must be a non-empty string")
    if method != "POST":
        raise BatchFileError(number, f"method must be 'POST', got {method!r}")
    if url not in BATCH_URLS:
        raise BatchFileError(number, f"url {url!r} is not one of {', '.join(BATCH_URLS)}")
    if not isinstance(body, dict):
        raise BatchFileError(number, "body must be a JSON object (the request's body)")
    if body.get("stream") is True:
        raise BatchFileError(
            number, "body.stream: a batch request cannot stream (remove stream or set it false)"
        )
    return BatchRequest(number, custom_id, url, body)


async def run_requests(app: Any, requests: list[BatchRequest]) -> list[BatchResult]:
    """Each request posted to ``app`` (an ASGI app), all at once up to :data:`MAX_IN_FLIGHT`; the
    results in the requests' order."""
    import httpx

    gate = asyncio.Semaphore(MAX_IN_FLIGHT)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:

        async def one(request: BatchRequest) -> BatchResult:
            async with gate:
                return await post_request(client, request)

        return list(await asyncio.gather(*(one(request) for request in requests)))


async def post_request(client: Any, request: BatchRequest) -> BatchResult:
    """``request`` POSTed with ``client`` (an ``httpx.AsyncClient`` on the app), and its answer."""
    reply = await client.post(request.url, json=request.body)
    try:
        body = reply.json()
    except ValueError:  # (an answer that is not JSON: kept as text)
        body = reply.text
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    return BatchResult(request.custom_id, reply.status_code, body, request_id or uuid.uuid4().hex)


def read_input(path: str) -> str:
    """The input file's text (``-``: standard input). Local files only: nothing is fetched."""
    if path == "-":
        return sys.stdin.read()
    if "://" in path:
        raise OSError(f"{path!r}: only local files (or - for standard input) are read; nothing is fetched")
    with open(path, encoding="utf-8") as f:
        return f.read()


def write_output(path: str, results: list[BatchResult]) -> None:
    """The output lines to ``path`` (``-``: standard output), written whole or not at all (a file is
    written beside its final name, then renamed)."""
    text = "".join(result.output_line() + "\n" for result in results)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(partial, path)


async def run_batch(app: Any, requests: list[BatchRequest], output: str) -> list[BatchResult]:
    """Run ``requests`` through ``app`` and write their results to ``output``; returns the results."""
    results = await run_requests(app, requests)
    write_output(output, results)
    return results
