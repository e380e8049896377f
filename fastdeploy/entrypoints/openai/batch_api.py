"""OpenAI's Files and Batches APIs: batch input files uploaded, run through this server's own app in
the background, their answers given back as output and error files.

Routes (under ``/v1``, behind the API key like the others)::

    POST   /files                    multipart: file, purpose        -> a file object
    GET    /files, /files/{id}, /files/{id}/content; DELETE /files/{id}
    POST   /batches                  {input_file_id, endpoint, completion_window, metadata}
    GET    /batches, /batches/{id};  POST /batches/{id}/cancel

A batch's input file is checked and run as ``fastdeploy run-batch`` runs a file
(:mod:`.run_batch`: the same line checks, each line POSTed to the app in process, many at once,
the engine batching them); every line must name the batch's ``endpoint``. Lines answered 2xx go
to the output file and the others to the error file, in OpenAI's output format, as OpenAI splits
them. A file that fails the checks fails the batch (``errors`` names the line); a cancel stops
the lines not yet sent and keeps the answers of those that were.

State lives in one directory that every API server process of a server shares
(``FD_BATCH_STORE_DIR``, set by ``serve``; else a private temporary one): per file its bytes and a
JSON object, per batch a JSON object and a cancel marker. Only ids of this server's format name a
path, and nothing read back is executed or unpickled. A batch runs in the process that created it;
the others read its progress from the directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse, Response

from fastdeploy import envs
from fastdeploy.entrypoints.openai.errors import BadRequestError, NotFoundError
from fastdeploy.entrypoints.openai.id_directory import IdDirectory
from fastdeploy.entrypoints.openai.request_body import read_json
from fastdeploy.entrypoints.openai.run_batch import (
    BATCH_URLS,
    BatchFileError,
    BatchRequest,
    BatchResult,
    parse_batch_file,
    post_request,
)

FILE_PURPOSES = ("batch", "batch_output", "assistants", "fine-tune", "vision", "user_data", "evals")
"""The ``purpose`` values OpenAI's files take (only ``batch`` files are run)."""
COMPLETION_WINDOWS = ("24h",)
"""The ``completion_window`` values OpenAI's batches take."""
MAX_IN_FLIGHT = 256
"""Most lines of one batch in the app at once (the engine batches them)."""
CANCEL_POLL_S = 0.5
"""How often a running batch looks for a cancel (asked of any API server process)."""
logger = logging.getLogger(__name__)
_ID = {"file": re.compile(r"file-[0-9a-f]{32}"), "batch": re.compile(r"batch_[0-9a-f]{32}")}


class BatchStore:
    """Files and batches in a directory (module docstring); its methods touch the disk only."""

    def __init__(self, directory: str | None = None):
        self._files = IdDirectory(directory or envs.FD_BATCH_STORE_DIR, "fastdeploy-batches-")

    def _path(self, kind: str, object_id: str, suffix: str = ".json") -> str | None:
        return self._files.path(_ID[kind], object_id, suffix)

    def _read(self, kind: str, object_id: str) -> dict[str, Any] | None:
        obj = self._files.read_json(self._path(kind, object_id))
        return obj if isinstance(obj, dict) else None

    def _all(self, kind: str) -> list[dict[str, Any]]:
        found = (self._read(kind, object_id) for object_id in self._files.ids(_ID[kind]))
        return sorted((obj for obj in found if obj is not None), key=lambda o: o["created_at"], reverse=True)

    def stored_bytes(self) -> int:
        """Bytes of the files in the directory (every process's)."""
        return self._files.size(".data")

    def save_file(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        """Store ``data``; its file object. A 400 when the directory's files would pass
        ``FD_BATCH_STORE_MB`` (nothing is dropped to make room: files are the clients' to delete)."""
        limit = int(envs.FD_BATCH_STORE_MB * 2**20)
        if self.stored_bytes() + len(data) > limit:
            raise BadRequestError(
                f"the server's file storage is full ({envs.FD_BATCH_STORE_MB:g} MiB, FD_BATCH_STORE_MB): "
                "delete files first",
                param="file",
            )
        file_id = f"file-{uuid.uuid4().hex}"
        obj = {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
               "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
               "status_details": None}  # fmt: skip
        self._files.write(self._path("file", file_id, ".data"), data)
        self._files.write(self._path("file", file_id), json.dumps(obj).encode())
        return obj

    def file(self, file_id: str) -> dict[str, Any]:
        """The file object of ``file_id`` (404 if unknown)."""
        obj = self._read("file", file_id)
        if obj is None:
            raise NotFoundError(f"No such File object: {file_id}", param="file_id")
        return obj

    def file_content(self, file_id: str) -> bytes:
        """The bytes of ``file_id`` (404 if unknown)."""
        self.file(file_id)
        data = self._files.read_bytes(self._path("file", file_id, ".data"))
        if data is None:
            raise NotFoundError(f"No such File object: {file_id}", param="file_id")
        return data

    def files(self) -> list[dict[str, Any]]:
        """Every file object, newest first."""
        return self._all("file")

    def delete_file(self, file_id: str) -> dict[str, Any]:
        """Forget ``file_id`` (404 if unknown)."""
        self.file(file_id)
        for suffix in (".json", ".data"):
            self._files.remove(self._path("file", file_id, suffix))
        return {"id": file_id, "object": "file", "deleted": True}

    def save_batch(self, batch: dict[str, Any]) -> None:
        """Store (or update) a batch object."""
        self._files.write(self._path("batch", batch["id"]), json.dumps(batch).encode())

    def batch(self, batch_id: str) -> dict[str, Any]:
        """The batch object of ``batch_id`` (404 if unknown)."""
        obj = self._read("batch", batch_id)
        if obj is None:
            raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id")
        return obj

    def batches(self) -> list[dict[str, Any]]:
        """Every batch object, newest first."""
        return self._all("batch")

    def request_cancel(self, batch_id: str) -> None:
        """Ask the process running ``batch_id`` to stop (a marker it polls)."""
        self._files.set_marker(_ID["batch"], batch_id, "cancel")

    def cancel_requested(self, batch_id: str) -> bool:
        """Whether a cancel of ``batch_id`` was asked."""
        return self._files.has_marker(_ID["batch"], batch_id, "cancel")

    def close(self) -> None:
        """Remove the private directory (a shared one belongs to ``serve``)."""
        self._files.close()


def new_batch(
    input_file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None
) -> dict[str, Any]:
    """A batch object as OpenAI's API returns it, just created."""
    now = int(time.time())
    return {
        "id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
        "input_file_id": input_file_id, "completion_window": window, "status": "validating",
        "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
        "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
        "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
    }  # fmt: skip


async def run_batch_job(app: Any, store: BatchStore, batch_id: str, headers: dict[str, str]) -> None:
    """Check and run batch ``batch_id`` through ``app``, updating its object as it goes (module
    docstring); ``headers``: what each line's request carries (the caller's API key). An unexpected
    failure fails the batch (logged), never leaves it running."""
    try:
        await _run_batch_job(app, store, batch_id, headers)
    except Exception as exc:  # noqa: BLE001 - reported in the batch object
        logger.exception("batch %s failed", batch_id)
        batch = store.batch(batch_id)
        batch["errors"] = {"object": "list", "data": [
            {"code": "server_error", "message": f"the batch failed: {exc}", "param": None, "line": None}]}  # fmt: skip
        batch.update(status="failed", failed_at=int(time.time()))
        store.save_batch(batch)


async def _run_batch_job(app: Any, store: BatchStore, batch_id: str, headers: dict[str, str]) -> None:
    batch = store.batch(batch_id)
    try:
        requests = parse_batch_file(store.file_content(batch["input_file_id"]).decode("utf-8"))
        wrong = next((r for r in requests if r.url != batch["endpoint"]), None)
        if wrong is not None:
            raise BatchFileError(
                wrong.line, f"url {wrong.url!r} is not the batch's endpoint {batch['endpoint']!r}"
            )
        if not requests:
            raise BatchFileError(1, "the file has no requests")
    except (BatchFileError, UnicodeDecodeError, NotFoundError) as exc:
        line = exc.line if isinstance(exc, BatchFileError) else None
        batch["errors"] = {"object": "list", "data": [
            {"code": "invalid_request", "message": str(exc), "param": None, "line": line}]}  # fmt: skip
        batch.update(status="failed", failed_at=int(time.time()))
        store.save_batch(batch)
        return
    batch.update(status="in_progress", in_progress_at=int(time.time()))
    batch["request_counts"]["total"] = len(requests)
    store.save_batch(batch)
    results = await _run_lines(app, store, batch, requests, headers)
    batch.update(finalizing_at=int(time.time()))
    ok = [r for r in results if r is not None and 200 <= r.status_code < 300]
    failed = [r for r in results if r is not None and not 200 <= r.status_code < 300]
    name = batch["input_file_id"]
    for key, lines, kind in (("output_file_id", ok, "output"), ("error_file_id", failed, "error")):
        if lines:  # (a full storage fails the batch: run_batch_job reports it)
            data = "".join(r.output_line() + "\n" for r in lines).encode()
            batch[key] = store.save_file(data, f"{name}_{kind}.jsonl", "batch_output")["id"]
    batch["request_counts"].update(completed=len(ok), failed=len(failed))
    cancelled = store.cancel_requested(batch_id)
    batch.update(status="cancelled" if cancelled else "completed")
    batch["cancelled_at" if cancelled else "completed_at"] = int(time.time())
    store.save_batch(batch)


async def _run_lines(
    app: Any, store: BatchStore, batch: dict[str, Any], requests: list[BatchRequest], headers: dict[str, str]
) -> list[BatchResult | None]:
    """Each line's answer, progress saved every poll; None for the lines a cancel stopped (those in
    flight are abandoned, which aborts their requests in the engine, and the rest are not sent)."""
    import httpx

    gate = asyncio.Semaphore(MAX_IN_FLIGHT)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://batch", timeout=None, headers=headers
    ) as client:

        async def one(request: BatchRequest) -> BatchResult:
            async with gate:
                try:
                    result = await post_request(client, request)
                except Exception as exc:  # noqa: BLE001 - the line fails, the batch goes on
                    error = {"error": {"message": f"the request failed: {exc}", "type": "server_error",
                                       "param": None, "code": None}}  # fmt: skip
                    result = BatchResult(request.custom_id, 500, error, uuid.uuid4().hex)
            counts = batch["request_counts"]
            counts["completed" if 200 <= result.status_code < 300 else "failed"] += 1
            return result

        tasks = [asyncio.create_task(one(request)) for request in requests]
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=CANCEL_POLL_S)
            store.save_batch(batch)  # the progress, for every process (at most once a poll)
            if pending and store.cancel_requested(batch["id"]):
                batch.update(status="cancelling", cancelling_at=batch["cancelling_at"] or int(time.time()))
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
        return [task.result() if task.done() and not task.cancelled() else None for task in tasks]


def batch_router(auth: list[Any], route_class: type[APIRoute] = APIRoute) -> APIRouter:
    """The ``/v1/files`` and ``/v1/batches`` routes (module docstring), one :class:`BatchStore` a
    process; ``route_class``: the app's (its failures become OpenAI error bodies)."""
    router = APIRouter(prefix="/v1", dependencies=auth, route_class=route_class)
    store = BatchStore()
    running: set[asyncio.Task] = set()

    @router.post("/files")
    async def upload_file(file: UploadFile, purpose: str = Form(...)) -> Response:
        if purpose not in FILE_PURPOSES:
            raise BadRequestError(
                f"purpose must be one of {', '.join(FILE_PURPOSES)}, got {purpose!r}", param="purpose"
            )
        data = await file.read()
        return JSONResponse(store.save_file(data, file.filename or "upload", purpose))

    @router.get("/files")
    async def list_files(purpose: str | None = None) -> Response:
        files = [f for f in store.files() if purpose is None or f["purpose"] == purpose]
        return JSONResponse({"object": "list", "data": files, "has_more": False})

    @router.get("/files/{file_id}")
    async def retrieve_file(file_id: str) -> Response:
        return JSONResponse(store.file(file_id))

    @router.get("/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        return Response(store.file_content(file_id), media_type="application/octet-stream")

    @router.delete("/files/{file_id}")
    async def delete_file(file_id: str) -> Response:
        return JSONResponse(store.delete_file(file_id))

    @router.post("/batches")
    async def create_batch(raw_request: Request) -> Response:
        body = await read_json(raw_request)
        if not isinstance(body, dict):
            raise BadRequestError("the body must be a JSON object")
        input_file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        window, metadata = body.get("completion_window"), body.get("metadata")
        if not isinstance(input_file_id, str):
            raise BadRequestError("input_file_id must be the id of an uploaded file", param="input_file_id")
        if store.file(input_file_id)["purpose"] != "batch":
            raise BadRequestError(
                f"file {input_file_id} was not uploaded with purpose 'batch'", param="input_file_id"
            )
        if endpoint not in BATCH_URLS:
            raise BadRequestError(
                f"endpoint must be one of {', '.join(BATCH_URLS)}, got {endpoint!r}", param="endpoint"
            )
        if window not in COMPLETION_WINDOWS:
            raise BadRequestError(
                f"completion_window must be '24h', got {window!r}", param="completion_window"
            )
        if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
        ):
            raise BadRequestError("metadata must be an object of strings", param="metadata")
        batch = new_batch(input_file_id, endpoint, window, metadata)
        store.save_batch(batch)
        key = raw_request.headers.get("authorization")
        task = asyncio.create_task(
            run_batch_job(raw_request.app, store, batch["id"], {"authorization": key} if key else {})
        )
        running.add(task)
        task.add_done_callback(running.discard)
        return JSONResponse(batch)

    @router.get("/batches")
    async def list_batches(limit: int = 20, after: str | None = None) -> Response:
        batches = store.batches()
        if after is not None:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1 :] if after in ids else []
        page = batches[: max(1, min(limit, 100))]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": len(batches) > len(page)})  # fmt: skip

    @router.get("/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> Response:
        return JSONResponse(store.batch(batch_id))

    @router.post("/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> Response:
        batch = store.batch(batch_id)
        if batch["status"] in ("validating", "in_progress"):
            store.request_cancel(batch_id)
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            store.save_batch(batch)  # (the running process keeps it so as its lines end)
        return JSONResponse(batch)

    return router
