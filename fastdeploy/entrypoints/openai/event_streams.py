"""Server-sent event streams and their failures, shared by every handler: the SSE events, a
streaming response that always closes its body, the disconnect watch of non-streaming requests,
and the OpenAI error any exception raised while serving maps to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from fastdeploy.core.sampling_params import SamplingParamsError
from fastdeploy.engine.input_processor import PromptTokenError, PromptTooLongError
from fastdeploy.engine.protocol import EngineDeadError, EngineRequestRejected
from fastdeploy.entrypoints.openai.errors import (
    BadRequestError,
    ClientDisconnectedError,
    InternalServerError,
    OpenAIError,
    ServiceUnavailableError,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event: ``data: {json}`` and a blank line."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Map any exception raised while serving to the error the client should see."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ClientDisconnect):  # the client left while its body was being read
        return ClientDisconnectedError("client disconnected")
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailableError(f"The engine is not available: {exc}", code="engine_dead")
    if isinstance(exc, SamplingParamsError):
        return BadRequestError(str(exc), param=exc.param)
    if isinstance(exc, PromptTooLongError):  # the engine's own length check
        return BadRequestError(str(exc), param="prompt", code="context_length_exceeded")
    if isinstance(exc, PromptTokenError):
        return BadRequestError(str(exc), param="prompt")
    if isinstance(exc, EngineRequestRejected):  # the engine core's own input checks
        return BadRequestError(str(exc))
    logger.exception("error while serving a request", exc_info=exc)
    return InternalServerError(f"Internal server error: {type(exc).__name__}: {exc}")


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its generator.

    Starlette cancels the streaming task when the client disconnects; closing
    the body generator here runs its ``finally`` even if the cancellation hit
    between two chunks, which is where the engine request is aborted.
    ``on_close`` runs after that, whatever happened: the engine requests were sent
    before the response started, and a body that never ran aborts nothing itself.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[str | bytes],
        on_close: Callable[[], Awaitable[None]] | None = None,
    ):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True), contextlib.suppress(RuntimeError):
                    await aclose()
            if self._on_close is not None:
                with anyio.CancelScope(shield=True):
                    await self._on_close()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it.

    Cancelling the work runs its cleanup, which aborts the engine requests.
    Raises :class:`ClientDisconnectedError` when the client left. The request
    body must have been read already.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.wait({task})
    raise ClientDisconnectedError("client disconnected")


def error_event(exc: BaseException) -> str:
    """The SSE event that ends a failed stream; the openai client raises an ``APIError`` on it."""
    return sse(to_openai_error(exc).body())
