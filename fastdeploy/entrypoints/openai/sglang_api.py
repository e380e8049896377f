"""The routes of SGLang's native API (:mod:`.serving_generate` answers them): ``/generate``,
``/abort_request``, ``/flush_cache`` (and vLLM's ``/reset_prefix_cache``), ``/get_model_info`` and
``/get_server_info`` (and their newer names ``/model_info``, ``/server_info``)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse, PlainTextResponse, Response

from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol import parse_request
from fastdeploy.entrypoints.openai.protocol.generate import GenerateRequest
from fastdeploy.entrypoints.openai.request_body import read_json
from fastdeploy.entrypoints.openai.serving_embedding import check_generation_model
from fastdeploy.entrypoints.openai.serving_generate import FLUSHED, NOT_FLUSHED, OpenAIServingGenerate


def sglang_router(
    native: OpenAIServingGenerate,
    auth: list[Any],
    route_class: type[APIRoute],
    count_request: Any,
    strict_fields: bool = False,
) -> APIRouter:
    """The routes (module docstring) behind ``auth``; ``count_request()`` counts a ``/generate``
    request as the other generation routes are counted; ``route_class``: the app's (its failures
    become error bodies)."""
    router = APIRouter(route_class=route_class, dependencies=auth)
    engine = native.engine

    @router.api_route("/generate", methods=["POST", "PUT"])
    async def generate(raw_request: Request) -> Response:
        raw_request.state.received = time.monotonic()
        count_request()
        request = parse_request(GenerateRequest, await read_json(raw_request), strict_fields=strict_fields)
        check_generation_model(engine)
        return await native.generate(request, raw_request)

    @router.post("/abort_request")
    async def abort_request(raw_request: Request) -> Response:
        data = await read_json(raw_request)
        rid = data.get("rid") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(rid, (str, type(None))):
            raise BadRequestError('the body must be {"rid": "<id>"} or {"abort_all": true}', param="rid")
        await native.abort(rid, data.get("abort_all") is True)
        return Response(status_code=200)

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await engine.reset_prefix_cache():
            return PlainTextResponse(FLUSHED)
        return PlainTextResponse(NOT_FLUSHED, status_code=400)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not await engine.reset_prefix_cache():
            raise BadRequestError(NOT_FLUSHED.strip())
        return Response(status_code=200)

    @router.get("/get_model_info")
    @router.get("/model_info")
    async def model_info() -> Response:
        return JSONResponse(native.model_info())

    @router.get("/get_server_info")
    @router.get("/server_info")
    async def server_info() -> Response:
        return JSONResponse(native.server_info())

    return router
