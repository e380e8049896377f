"""``/v1/responses``: create (whole or streamed), retrieve, delete and list the input items of a
response (OpenAI's Responses API).

A request runs as the chat request it amounts to (``protocol/responses.py``) through the chat
handler's validation, template and tool / reasoning set-up (:meth:`OpenAIServingChat.prepare`);
the answer's pieces, split into reasoning, text and tool calls as a streamed chat answer is
(``ChoiceSplit``), become output items: a ``reasoning`` item, a ``message`` item with one
``output_text`` part, and a ``function_call`` item per call. ``responses_output.ResponseOutput``
builds the items and the stream's events in one pass, so a whole response and the last event of
its stream carry the same items.

A stream is OpenAI's event sequence (``event: TYPE`` and ``data: {...}`` with a
``sequence_number``): ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, ``response.content_part.added``, the deltas
(``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.function_call_arguments.delta``), their ``.done`` events and
``response.output_item.done``, and last ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it). A failure ends it with ``error`` and ``response.failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy.entrypoints.openai.errors import (
    BadRequestError,
    NotFoundError,
    OpenAIError,
    ServiceUnavailableError,
)
from fastdeploy.entrypoints.openai.event_streams import SSEResponse, run_until_disconnected, to_openai_error
from fastdeploy.entrypoints.openai.protocol.responses import (
    ResponsesRequest,
    input_items,
    new_id,
    responses_error,
)
from fastdeploy.entrypoints.openai.protocol.responses_objects import (
    ResponseObject,
    ResponseUsage,
    output_messages,
)
from fastdeploy.entrypoints.openai.responses_output import Event, ResponseOutput
from fastdeploy.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy.entrypoints.openai.serving_engine import StartedRequests

RUNNING = ("queued", "in_progress")
"""Statuses of a background response still being generated."""


@dataclass
class _Run:
    """One response being generated: what was asked, the response object so far, its engine request,
    the output it builds, and its input items (made once, so that their ids stay the same every time
    the response is stored)."""

    request: ResponsesRequest
    base: ResponseObject
    started: StartedRequests
    output: ResponseOutput
    input_items: list[dict[str, Any]]


class OpenAIServingResponses:
    """Handler of ``/v1/responses``, on top of the chat handler, with its stored responses."""

    CANCEL_POLL_S = 0.1
    """How often a background run checks for a cancel asked through another API server process."""
    CANCEL_WAIT_S = 10.0
    """How long a cancel waits for the run to stop (on whichever process runs it)."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore):
        self.chat = chat
        self.store = store
        self._background: dict[str, asyncio.Task] = {}
        """The background responses this process runs, by id."""

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        """Validate, run and answer one Responses request (streamed or whole)."""
        history: list[dict[str, Any]] = []
        if request.background and not self.store.enabled:
            raise BadRequestError(
                "background responses need the response store (FD_RESPONSES_STORE_MB is 0)",
                param="background",
            )
        if request.previous_response_id is not None:
            previous = await asyncio.to_thread(self.store.load, request.previous_response_id)
            if previous is not None and previous.response.get("status") in RUNNING:
                raise BadRequestError(
                    f"Previous response '{request.previous_response_id}' is still in progress",
                    param="previous_response_id",
                )
            found = (
                None
                if previous is None
                else await asyncio.to_thread(self.store.conversation, request.previous_response_id, previous)
            )
            if found is None:
                raise NotFoundError(  # (OpenAI's words and code; never stored, deleted, or dropped)
                    f"Previous response with id '{request.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = found
        try:
            prepared = await self.chat.prepare(request.to_chat_request(history))
        except BadRequestError as exc:
            raise responses_error(exc) from None
        response_id = new_id("resp")
        base = ResponseObject.of(response_id, prepared.model, request, prepared.prompts[0].params)
        base.store = request.stores and self.store.enabled
        output = ResponseOutput(prepared.options, prepared.prompts[0].params.logprobs)
        started = await self.chat.start_requests([response_id], prepared.prompts)
        run = _Run(request, base, started, output, input_items(request))
        if request.background:
            return JSONResponse(await self._start_background(run))
        if request.stream:
            return SSEResponse(self._stream(run), on_close=started.close)
        try:
            response = await run_until_disconnected(raw_request, self._collect(run))
        finally:
            await started.close()
        return JSONResponse(response)

    async def _collect(
        self, run: _Run, on_first: Callable[[], Awaitable[None]] | None = None
    ) -> dict[str, Any]:
        try:
            async with contextlib.aclosing(run.started.outputs()) as outputs:
                async for _, out in outputs:
                    if on_first is not None:
                        await on_first()
                        on_first = None
                    for c in out.outputs:
                        run.output.feed(c)
        except Exception as exc:
            raise to_openai_error(exc) from exc
        run.output.finish()
        return await self._finished(run)

    async def _stream(self, run: _Run) -> AsyncIterator[str]:
        sequence = 0

        def event(body: Event) -> str:
            nonlocal sequence
            body["sequence_number"] = sequence
            sequence += 1
            return f"event: {body['type']}\ndata: {json.dumps(body)}\n\n"

        yield event({"type": "response.created", "response": run.base.model_dump()})
        yield event({"type": "response.in_progress", "response": run.base.model_dump()})
        try:
            async with contextlib.aclosing(run.started.outputs()) as outputs:
                async for _, out in outputs:
                    for c in out.outputs:
                        for body in run.output.feed(c):
                            yield event(body)
            for body in run.output.finish():
                yield event(body)
            final = await self._finished(run)
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                final["status"], "response.failed"
            )
            yield event({"type": kind, "response": final})
        except Exception as exc:
            error = to_openai_error(exc)
            for body in run.output.abandon():
                yield event(body)
            yield event({"type": "error", "code": error.code, "message": error.message, "param": error.param})
            yield event({"type": "response.failed", "response": self._failed(run, error).model_dump()})

    async def _finished(self, run: _Run) -> dict[str, Any]:
        """The finished response object (stored when asked)."""
        output, tracker = run.output, run.started.tracker
        usage = tracker.usage()
        response = run.base.model_copy(update={"output": output.items, "completed_at": int(time.time())})
        response.usage = ResponseUsage.build(
            usage.prompt_tokens, sum(tracker.cached_tokens), usage.completion_tokens, output.reasoning_tokens
        )
        if output.finish_reason == "length":
            response.status, response.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        elif output.finish_reason in ("stop", "tool_calls"):
            response.status = "completed"
        else:
            response.status = "failed"
            response.error = {"code": "server_error", "message": "the request was aborted"}
        body = response.model_dump()
        if response.store:
            if not await self._save(run, body, self._turn(run)):
                body["store"] = False  # (logged by the store: the disk refused it)
        return body

    @staticmethod
    def _turn(run: _Run) -> list[dict[str, Any]]:
        """The run's turn as chat messages, for a later ``previous_response_id``: its input, then its
        output so far (none when it made none)."""
        return run.request.input_messages() + (output_messages(run.output.items) if run.output.items else [])

    @staticmethod
    def _failed(run: _Run, error: OpenAIError) -> ResponseObject:
        """The response of a run that failed with ``error``: its output so far (closed with
        ``ResponseOutput.abandon``), status ``failed``."""
        failed = run.base.model_copy(update={"status": "failed", "output": run.output.items})
        failed.error = {"code": error.code or "server_error", "message": error.message}
        return failed

    async def _save(
        self, run: _Run, response: dict[str, Any], messages: list[dict[str, Any]] | None = None
    ) -> bool:
        """Store ``response`` (a background one as it stands: its turn's messages come once it has
        ended); whether the store kept it."""
        stored = StoredResponse(
            response=response,
            messages=messages or [],
            input_items=run.input_items,
            previous_response_id=run.request.previous_response_id,
        )
        return await asyncio.to_thread(self.store.save, run.base.id, stored)

    # ---- background responses ---------------------------------------------------------

    async def _start_background(self, run: _Run) -> dict[str, Any]:
        """Store the response as ``queued`` and run it in a task of its own: the client polls
        ``GET /v1/responses/{id}`` and may cancel it (``POST /v1/responses/{id}/cancel``)."""
        queued = run.base.model_copy(update={"status": "queued"}).model_dump()
        try:
            if not await self._save(run, queued):
                raise ServiceUnavailableError(
                    "background responses cannot be stored now (the server's disk refused it)",
                    code="response_store_unavailable",
                )
        except BaseException:
            await run.started.close()
            raise
        response_id = run.base.id
        task = asyncio.create_task(self._run_background(run))
        self._background[response_id] = task
        task.add_done_callback(lambda _: self._background.pop(response_id, None))
        return queued

    async def _run_background(self, run: _Run) -> None:
        watcher = asyncio.create_task(self._watch_cancel(run.base.id, asyncio.current_task()))

        async def in_progress() -> None:
            await self._save(run, run.base.model_copy(update={"status": "in_progress"}).model_dump())

        try:
            await self._collect(run, on_first=in_progress)
        except asyncio.CancelledError:
            await run.started.close()  # (before the save: the engine request stops at once)
            run.output.abandon()
            cancelled = run.base.model_copy(update={"status": "cancelled", "output": run.output.items})
            # (with its turn: a conversation continued from it keeps its input, as vLLM's does)
            await self._save(run, cancelled.model_dump(), self._turn(run))
        except Exception as exc:  # the engine failed or the server is stopping
            run.output.abandon()
            await self._save(run, self._failed(run, to_openai_error(exc)).model_dump(), self._turn(run))
        finally:
            watcher.cancel()
            await run.started.close()
            await asyncio.to_thread(self.store.clear_cancel, run.base.id)

    async def _watch_cancel(self, response_id: str, task: asyncio.Task | None) -> None:
        """Cancel ``task`` once another process asks (the store's cancel marker)."""
        while task is not None:
            await asyncio.sleep(self.CANCEL_POLL_S)
            if await asyncio.to_thread(self.store.cancel_requested, response_id):
                task.cancel()
                return

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """``POST /v1/responses/{id}/cancel``: stop a background response (it ends ``cancelled``, with
        the output made so far); an ended one is returned as it is."""
        stored = await self._stored(response_id)
        if not stored.response.get("background"):
            raise BadRequestError("Cannot cancel a synchronous response.", param="response_id")
        if stored.response.get("status") not in RUNNING:
            return stored.response
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        else:  # another API server process runs it
            await asyncio.to_thread(self.store.request_cancel, response_id)
            deadline = time.monotonic() + self.CANCEL_WAIT_S
            while time.monotonic() < deadline:
                stored = await self._stored(response_id)
                if stored.response.get("status") not in RUNNING:
                    break
                await asyncio.sleep(self.CANCEL_POLL_S)
        return (await self._stored(response_id)).response

    # ---- stored responses -------------------------------------------------------------

    async def _stored(self, response_id: str) -> StoredResponse:
        stored = await asyncio.to_thread(self.store.load, response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: a stored response (404 if it is not stored)."""
        return (await self._stored(response_id)).response

    async def delete(self, response_id: str) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}``: forget a stored response (404 if it is not stored). A
        background response still running is cancelled first: left running, it would store itself
        again once it ends (the deleted response back from the dead) and keep the engine busy."""
        stored = await asyncio.to_thread(self.store.load, response_id)
        if stored is not None and stored.response.get("status") in RUNNING:
            await self.cancel(response_id)
        if not await asyncio.to_thread(self.store.delete, response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def list_input_items(
        self, response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: the input items of a stored response, a page at a time."""
        if order not in ("asc", "desc"):
            raise BadRequestError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        if not 1 <= limit <= 100:
            raise BadRequestError(f"limit must be in [1, 100], got {limit}", param="limit")
        items = (await self._stored(response_id)).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise BadRequestError(f"no input item with id '{after}'", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }


def _not_found(response_id: str) -> NotFoundError:
    """The 404 of an unknown response id, in OpenAI's (and vLLM's) words: "Response with id '...' not
    found." (clients and test suites match the sentence, its full stop included)."""
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
