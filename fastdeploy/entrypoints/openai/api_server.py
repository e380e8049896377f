"""The FastAPI app of the OpenAI-compatible server, and running it with an engine.

:func:`build_app` wires the endpoint handlers to any :class:`EngineClient`
(the real ``AsyncLLM`` or a test double); :func:`run_server` builds the engine
from the CLI options, serves until SIGINT/SIGTERM and shuts the engine down.

Every error leaves as an OpenAI error body; the route class below converts
whatever a handler raises, so no request can take the server down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import inspect
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import fastdeploy
from fastdeploy.config import EngineConfig
from fastdeploy.engine.protocol import EngineClient
from fastdeploy.entrypoints.openai.errors import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    OpenAIError,
    ServiceUnavailableError,
    validation_error_to_openai,
)
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    parse_request,
    parse_tokenize_request,
)
from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fastdeploy.entrypoints.openai.serving_engine import ClientDisconnectedError, to_openai_error
from fastdeploy.entrypoints.openai.serving_tokenize import OpenAIServingTokenization

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0
"""On SIGINT/SIGTERM, how long responses may take to finish before uvicorn cancels them (generation
requests in flight are ended at once with a 503, see ``begin_shutdown``)."""


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


async def read_json(request: Request) -> Any:
    """The request body decoded as JSON; a 400 if it is not JSON."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"Invalid JSON body: {exc}", code="invalid_json") from None


def _api_key_dependency(api_key: str) -> Callable[[Request], Coroutine[Any, Any, None]]:
    expected = api_key.encode()

    async def check_api_key(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise AuthenticationError(
                "Missing or incorrect API key; send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )

    return check_api_key


def _metrics_registry() -> Any:
    """``fastdeploy.metrics.REGISTRY``, or prometheus_client's default registry until that exists."""
    try:
        from fastdeploy.metrics import REGISTRY
    except ImportError as exc:
        if exc.name not in ("fastdeploy.metrics", None) and not str(exc).startswith("cannot import name"):
            raise
        from prometheus_client import REGISTRY
    return REGISTRY


def build_app(
    engine_client: EngineClient, served_model_names: list[str], api_key: str | None = None
) -> FastAPI:
    """The FastAPI app serving ``engine_client`` under ``served_model_names`` (the first is the default).

    With ``api_key`` set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``;
    ``/health``, ``/metrics``, ``/version``, ``/tokenize`` and ``/detokenize`` stay open.
    ``app.state.begin_shutdown()`` ends the requests in flight with a 503 (the
    server calls it when it starts stopping).
    """
    app = FastAPI(title="FastDeploy", version=fastdeploy.__version__, docs_url="/docs", redoc_url=None)
    app.router.route_class = OpenAIRoute
    _install_exception_handlers(app)
    app.state.engine_client = engine_client

    executor = ThreadPoolExecutor(1, thread_name_prefix="fd-tokenizer")
    shutdown_event = asyncio.Event()
    app.state.begin_shutdown = shutdown_event.set
    completions = OpenAIServingCompletion(engine_client, served_model_names, executor, shutdown_event)
    chat = OpenAIServingChat(engine_client, served_model_names, executor, shutdown_event)
    tokenization = OpenAIServingTokenization(engine_client, served_model_names, executor, shutdown_event)

    v1 = APIRouter(
        prefix="/v1",
        route_class=OpenAIRoute,
        dependencies=[Depends(_api_key_dependency(api_key))] if api_key else [],
    )

    @v1.post("/completions")
    async def create_completion(raw_request: Request) -> Response:
        request = parse_request(CompletionRequest, await read_json(raw_request))
        return await completions.create_completion(request, raw_request)

    @v1.post("/chat/completions")
    async def create_chat_completion(raw_request: Request) -> Response:
        request = parse_request(ChatCompletionRequest, await read_json(raw_request))
        return await chat.create_chat_completion(request, raw_request)

    @v1.get("/models")
    async def list_models() -> Response:
        return JSONResponse(tokenization.list_models().model_dump())

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if engine_client.is_healthy:
            return Response(status_code=200)
        return error_response(ServiceUnavailableError("The engine is not healthy.", code="engine_dead"))

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(_metrics_registry()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": fastdeploy.__version__})

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> Response:
        request = parse_tokenize_request(await read_json(raw_request))
        return JSONResponse((await tokenization.tokenize(request)).model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> Response:
        request = parse_request(DetokenizeRequest, await read_json(raw_request))
        return JSONResponse((await tokenization.detokenize(request)).model_dump())

    return app


# --------------------------------------------------------------------------- running


def default_served_model_names(config: EngineConfig) -> list[str]:
    """``--served-model-name`` if given, else the model path's name (``.gguf`` dropped), else the default model's."""
    if config.model.served_model_name:
        return [config.model.served_model_name]
    if config.model.model:
        name = os.path.basename(os.path.normpath(config.model.model))
        return [name.removesuffix(".gguf") or config.model.model]
    from fastdeploy.model_executor.model_loader.default_model import DEFAULT_MODEL_NAME

    return [DEFAULT_MODEL_NAME]


class _Server(uvicorn.Server):
    """uvicorn's server, with signal handling the engine can rely on.

    uvicorn re-raises a captured SIGTERM after its shutdown, which would kill
    the process before the engine's children are stopped; here the signal only
    stops the server, and the caller shuts the engine down afterwards.
    """

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str, int], None] | None = None):
        super().__init__(config)
        self._on_ready = on_ready

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: Any = None) -> None:
        begin_shutdown = getattr(getattr(self.config.app, "state", None), "begin_shutdown", None)
        if begin_shutdown is not None:
            begin_shutdown()  # end streams cleanly instead of cutting them after the grace period
        await super().shutdown(sockets=sockets)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit and self._on_ready is not None:
            host, port = self.config.host, self.config.port
            for server in getattr(self, "servers", []):
                for sock in server.sockets or []:
                    port = sock.getsockname()[1]
                    break
            self._on_ready(host, port)


def _print_ready(host: str, port: int) -> None:
    shown = f"[{host}]" if ":" in host else host
    print(f"FastDeploy API server ready at http://{shown}:{port}", flush=True)


class BindError(OSError):
    """The server's address cannot be bound (port in use, unknown host, no permission)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound (not yet listening) to ``host:port``; a :class:`BindError` if that fails.

    Binding before the model loads makes a taken port fail in a second, not after the load.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise BindError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise BindError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


async def serve_http(
    app: FastAPI,
    host: str,
    port: int,
    *,
    sock: socket.socket | None = None,
    on_ready: Callable[[str, int], None] | None = _print_ready,
    log_level: str | None = None,
) -> None:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM; ``on_ready(host, port)`` once it accepts connections.

    ``sock`` is a socket from :func:`bind_socket` (else uvicorn binds ``host:port`` itself).
    """
    if log_level is None:
        from fastdeploy import envs

        log_level = str(envs.FD_LOG_LEVEL).lower()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = _Server(config, on_ready=on_ready)
    await server.serve(sockets=[sock] if sock is not None else None)


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _signals_handled_by(handler: Any) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM go to ``handler`` (main thread only; restored after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (signal.SIGINT, signal.SIGTERM)
    original = {sig: signal.signal(sig, handler) for sig in handled}
    try:
        yield
    finally:
        for sig, previous in original.items():
            signal.signal(sig, previous)


async def run_server(args: argparse.Namespace) -> None:
    """Build the engine from parsed ``serve`` options, serve HTTP, and always shut the engine down.

    The port is bound first (a busy port fails before the model loads). While
    the engine loads, SIGINT/SIGTERM raise ``KeyboardInterrupt``; while serving
    they stop the server gracefully; either way ``engine.shutdown()`` runs, with
    further signals ignored so that no child process is left behind.
    """
    from fastdeploy.entrypoints.cli.args import engine_config_from_args, resolve_args

    args = resolve_args(args)
    config = engine_config_from_args(args)
    served_model_names = default_served_model_names(config)
    sock = bind_socket(args.host, args.port)
    engine: Any = None
    try:
        # Blocking code inside the event loop does not see asyncio's SIGINT
        # handling, and SIGTERM would kill the process without cleanup.
        with _signals_handled_by(_raise_keyboard_interrupt):
            from fastdeploy.engine.async_llm import AsyncLLM

            engine = AsyncLLM.from_config(config)
            if inspect.isawaitable(engine):
                engine = await engine
        app = build_app(engine, served_model_names, args.api_key)
        await serve_http(app, args.host, args.port, sock=sock)
    finally:
        sock.close()
        if engine is not None:
            logger.info("shutting down the engine")
            with _signals_handled_by(signal.SIG_IGN):  # let the cleanup finish
                engine.shutdown()
