"""The FastAPI app of the OpenAI-compatible server.

:func:`build_app` wires the endpoint handlers to any :class:`EngineClient`
(the real ``AsyncLLM`` or a test double); running it is
:mod:`fastdeploy.entrypoints.openai.http_server`'s job.

Every error leaves as an OpenAI error body; the route class below converts
whatever a handler raises, so no request can take the server down.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import fastdeploy
from fastdeploy.config import ServerConfig, as_list
from fastdeploy.engine.protocol import EngineClient
from fastdeploy.entrypoints.openai.batch_api import batch_router
from fastdeploy.entrypoints.openai.errors import (
    AuthenticationError,
    BadRequestError,
    ClientDisconnectedError,
    NotFoundError,
    OpenAIError,
    ServiceUnavailableError,
    validation_error_to_openai,
)
from fastdeploy.entrypoints.openai.event_streams import to_openai_error
from fastdeploy.entrypoints.openai.openapi import add_openapi_routes, json_body
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ResponsesRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse_request,
    parse_tokenize_request,
)
from fastdeploy.entrypoints.openai.reasoning import get_reasoning_parser
from fastdeploy.entrypoints.openai.request_body import BodySizeLimitMiddleware, read_json
from fastdeploy.entrypoints.openai.request_ids import RequestIdHeaderMiddleware
from fastdeploy.entrypoints.openai.responses_store import ResponseStore
from fastdeploy.entrypoints.openai.server_load import ServerLoad, ServerLoadMiddleware
from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fastdeploy.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, check_generation_model
from fastdeploy.entrypoints.openai.serving_engine import ServerStop
from fastdeploy.entrypoints.openai.serving_generate import OpenAIServingGenerate
from fastdeploy.entrypoints.openai.serving_responses import OpenAIServingResponses
from fastdeploy.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from fastdeploy.entrypoints.openai.sglang_api import sglang_router
from fastdeploy.entrypoints.openai.tokenizer_lanes import TokenizerLanes
from fastdeploy.entrypoints.openai.tool_parsers import get_tool_parser
from fastdeploy.metrics import api_server_request_counter, exposition
from fastdeploy.platforms.backend import backend_info

logger = logging.getLogger(__name__)
PROMETHEUS_TEXT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""``/metrics``' Content-Type: the Prometheus text format the body is (docs/metrics.md)."""

# --------------------------------------------------------------------------- errors


def error_response(exc: OpenAIError) -> Response:
    """The HTTP response of an error (nothing for a client that already left)."""
    if isinstance(exc, ClientDisconnectedError):
        return Response(status_code=exc.status_code)
    return JSONResponse(exc.body(), status_code=exc.status_code)


class OpenAIRoute(APIRoute):
    """A route whose failures, whatever they are, become OpenAI error responses."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except StarletteHTTPException:
                raise
            except RequestValidationError as exc:
                return error_response(validation_error_to_openai(list(exc.errors())))
            except Exception as exc:
                return error_response(to_openai_error(exc))

        return handle


def _install_exception_handlers(app: FastAPI) -> None:
    async def on_openai_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return error_response(exc)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error_to_openai(list(exc.errors())))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            err: OpenAIError = NotFoundError(f"Not found: {request.method} {request.url.path}")
        else:
            err = OpenAIError(str(exc.detail))
            err.status_code = exc.status_code
            err.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def on_any_error(request: Request, exc: Exception) -> Response:
        return error_response(to_openai_error(exc))

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_any_error)


# --------------------------------------------------------------------------- app


def _api_key_dependency(api_keys: list[str]) -> Callable[[Request], Coroutine[Any, Any, None]]:
    expected = [key.encode() for key in api_keys]

    async def check_api_key(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        sent = token.strip().encode()
        matches = [hmac.compare_digest(sent, key) for key in expected]  # (every key compared: no early exit)
        if scheme.lower() != "bearer" or not any(matches):
            raise AuthenticationError(
                "Missing or incorrect API key; send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )

    return check_api_key


def build_app(
    engine_client: EngineClient,
    served_model_names: list[str],
    server: ServerConfig | None = None,
    api_server_index: int = 0,
) -> FastAPI:
    """The FastAPI app serving ``engine_client`` under ``served_model_names`` (the first is the default).

    ``server`` sets the limits of each request, how unknown request fields are
    treated (``strict_request_fields``), the reasoning and tool-call parsers of chat answers (an
    unknown name is a ``ValueError`` listing the known ones) and the API key: with a key set,
    every route needs ``Authorization: Bearer <key>`` except ``/health`` (and ``/ping``, ``/health_generate``),
    ``/metrics``, ``/load`` and ``/version`` (what load balancers and Prometheus poll).
    ``app.state.begin_drain()`` refuses new requests (and ``/health``) with a 503 while those in
    flight go on (``--shutdown-timeout``); ``app.state.begin_shutdown()`` ends the requests in flight
    with a 503 too (the server calls it when it stops). ``api_server_index``: which of the
    ``--api-server-count`` processes this app runs in (the ``api_server`` label of
    ``fastdeploy:api_server_requests``).
    """
    server = server or ServerConfig()
    app = FastAPI(
        title="FastDeploy",
        version=fastdeploy.__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.root_path = server.root_path.rstrip("/")  # (as vLLM: /PREFIX/v1/... and /v1/... both answer)
    app.router.route_class = OpenAIRoute
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=server.max_request_body_bytes)
    if server.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    load = ServerLoad()
    if server.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, load=load)
    if server.allowed_origins:  # browsers on these origins may read the answers (CORS)
        app.add_middleware(
            CORSMiddleware,
            allow_origins=server.allowed_origins,
            allow_methods=server.allowed_methods,
            allow_headers=server.allowed_headers,
            allow_credentials=server.allow_credentials,
        )
    _install_exception_handlers(app)
    app.state.engine_client = engine_client
    api_keys = as_list(server.api_key)
    auth = [Depends(_api_key_dependency(api_keys))] if api_keys else []
    strict = server.strict_request_fields

    tokenizers = TokenizerLanes()
    stop = ServerStop()
    app.state.begin_drain = stop.refusing.set
    app.state.begin_shutdown = stop.ending.set
    completions = OpenAIServingCompletion(
        engine_client,
        served_model_names,
        tokenizers,
        stop,
        max_prompts_per_request=server.max_prompts_per_request,
        return_tokens_as_token_ids=server.return_tokens_as_token_ids,
        force_include_usage=server.enable_force_include_usage,
    )
    reasoning_parser = get_reasoning_parser(server.reasoning_parser) if server.reasoning_parser else None
    if server.tool_call_parser:
        get_tool_parser(server.tool_call_parser)  # an unknown name fails here, with the list of names
    chat = OpenAIServingChat(
        engine_client,
        served_model_names,
        tokenizers,
        stop,
        reasoning_parser=reasoning_parser,
        tool_call_parser=server.tool_call_parser,
        return_tokens_as_token_ids=server.return_tokens_as_token_ids,
        force_include_usage=server.enable_force_include_usage,
        exclude_tools_when_tool_choice_none=server.exclude_tools_when_tool_choice_none,
        chat_template_content_format=server.chat_template_content_format,
        trust_request_chat_template=server.trust_request_chat_template,
    )
    tokenization = OpenAIServingTokenization(engine_client, served_model_names, tokenizers, stop, chat=chat)
    embeddings = OpenAIServingEmbedding(
        engine_client,
        served_model_names,
        tokenizers,
        stop,
        max_prompts_per_request=server.max_prompts_per_request,
    )

    native = OpenAIServingGenerate(
        engine_client,
        served_model_names,
        tokenizers,
        stop,
        max_prompts_per_request=server.max_prompts_per_request,
    )
    responses = OpenAIServingResponses(chat, ResponseStore())
    app.state.responses_store = responses.store

    received = api_server_request_counter(served_model_names[0], api_server_index)
    v1 = APIRouter(prefix="/v1", route_class=OpenAIRoute, dependencies=auth)

    async def completion(data: Any, raw_request: Request) -> Response:
        request = parse_request(CompletionRequest, data, strict_fields=strict)
        check_generation_model(engine_client)
        return await completions.create_completion(request, raw_request)

    async def chat_completion(data: Any, raw_request: Request) -> Response:
        request = parse_request(ChatCompletionRequest, data, strict_fields=strict)
        check_generation_model(engine_client)
        return await chat.create_chat_completion(request, raw_request)

    async def embedding(data: Any, raw_request: Request) -> Response:
        request = parse_request(EmbeddingRequest, data, strict_fields=strict)
        return await embeddings.create_embedding(request, raw_request)

    @v1.post("/completions", openapi_extra=json_body(CompletionRequest))
    async def create_completion(raw_request: Request) -> Response:
        raw_request.state.received = time.monotonic()  # the request timeline's start
        received.inc()
        return await completion(await read_json(raw_request), raw_request)

    @v1.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def create_chat_completion(raw_request: Request) -> Response:
        raw_request.state.received = time.monotonic()
        received.inc()
        return await chat_completion(await read_json(raw_request), raw_request)

    @v1.post("/responses", openapi_extra=json_body(ResponsesRequest))
    async def create_response(raw_request: Request) -> Response:
        raw_request.state.received = time.monotonic()
        received.inc()
        request = parse_request(ResponsesRequest, await read_json(raw_request), strict_fields=strict)
        check_generation_model(engine_client)
        return await responses.create_response(request, raw_request)

    @v1.get("/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False) -> Response:
        if stream:  # (OpenAI streams a background response's events here; we do not, so say so)
            raise BadRequestError(
                "streaming a stored response is not supported: poll GET /v1/responses/{id}", param="stream"
            )
        return JSONResponse(await responses.retrieve(response_id))

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return JSONResponse(await responses.delete(response_id))

    @v1.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return JSONResponse(await responses.cancel(response_id))

    @v1.get("/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> Response:
        return JSONResponse(await responses.list_input_items(response_id, order, limit, after))

    @v1.post("/embeddings", openapi_extra=json_body(EmbeddingRequest))
    async def create_embedding(raw_request: Request) -> Response:
        received.inc()
        return await embedding(await read_json(raw_request), raw_request)

    @v1.get("/models")
    async def list_models() -> Response:
        return JSONResponse(tokenization.list_models().model_dump())

    @v1.get("/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        return JSONResponse(tokenization.retrieve_model(model).model_dump())

    app.include_router(v1)
    app.include_router(batch_router(auth, OpenAIRoute))
    sagemaker = APIRouter(route_class=OpenAIRoute, dependencies=auth)

    @sagemaker.post("/invocations")
    async def invocations(raw_request: Request) -> Response:
        """SageMaker's inference route (as vLLM serves it): a chat completion, completion or
        embedding request, told apart by its ``messages``, ``prompt`` or ``input``."""
        raw_request.state.received = time.monotonic()
        received.inc()
        data = await read_json(raw_request)
        kind = next(
            (key for key in ("messages", "prompt", "input") if isinstance(data, dict) and key in data), None
        )
        if kind is None:
            raise BadRequestError(
                "/invocations takes a chat completion (messages), completion (prompt) or embedding (input) "
                "request body"
            )
        return await {"messages": chat_completion, "prompt": completion, "input": embedding}[kind](
            data, raw_request
        )

    app.include_router(sagemaker)
    app.include_router(sglang_router(native, auth, OpenAIRoute, received.inc, strict))

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: load balancers' and monitors' probes)
    @app.api_route(
        "/health_generate", methods=["GET", "HEAD"]
    )  # SGLang's (its launcher polls it): as /health
    @app.api_route("/ping", methods=["GET", "POST", "HEAD"])  # SageMaker's health check, as vLLM answers it
    async def health() -> Response:
        if stop.stopping:  # (load balancers stop sending requests to a draining server)
            return error_response(
                ServiceUnavailableError("The server is shutting down.", code="shutting_down")
            )
        if engine_client.is_healthy:
            return Response(status_code=200)
        return error_response(ServiceUnavailableError("The engine is not healthy.", code="engine_dead"))

    @app.get("/metrics")
    async def metrics() -> Response:
        # the classic text format's type, whatever prometheus_client's newest (1.0.0 from 0.22 on) is
        return Response(exposition(), media_type=PROMETHEUS_TEXT_TYPE)

    @app.get("/load")
    async def server_load() -> Response:
        return JSONResponse({"server_load": load.in_flight})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": fastdeploy.__version__, **backend_info()})

    @app.post("/v1/tokenize", dependencies=auth, include_in_schema=False)  # (SGLang's path too)
    @app.post(
        "/tokenize",
        dependencies=auth,
        openapi_extra=json_body(TokenizeCompletionRequest | TokenizeChatRequest, "TokenizeRequest"),
    )
    async def tokenize(raw_request: Request) -> Response:
        request = parse_tokenize_request(await read_json(raw_request), strict_fields=strict)
        # token_strs stays in the body, null when not asked (vLLM's clients read it)
        return JSONResponse((await tokenization.tokenize(request)).model_dump())

    if server.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info", dependencies=auth)
        async def tokenizer_info() -> Response:
            return JSONResponse(tokenization.tokenizer_info())

    @app.post("/v1/detokenize", dependencies=auth, include_in_schema=False)
    @app.post("/detokenize", dependencies=auth, openapi_extra=json_body(DetokenizeRequest))
    async def detokenize(raw_request: Request) -> Response:
        request = parse_request(DetokenizeRequest, await read_json(raw_request), strict_fields=strict)
        return JSONResponse((await tokenization.detokenize(request)).model_dump())

    add_openapi_routes(app, auth)
    return app
