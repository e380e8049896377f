"""Running the OpenAI-compatible server: bind, load the engine, serve with uvicorn, shut down.

:func:`run_server` builds the engine from the CLI options, serves the app of
:func:`~fastdeploy.entrypoints.openai.api_server.build_app` until SIGINT/SIGTERM
and always shuts the engine down.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from fastdeploy.config import EngineConfig
from fastdeploy.entrypoints.openai.api_server import build_app

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0
"""On SIGINT/SIGTERM, how long responses may take to finish before uvicorn cancels them (generation
requests in flight are ended at once with a 503, see ``begin_shutdown``)."""

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
    from fastdeploy.entrypoints.cli.args import engine_config_from_args, resolve_args, server_config_from_args

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
        app = build_app(engine, served_model_names, server_config_from_args(args))
        await serve_http(app, args.host, args.port, sock=sock)
    finally:
        sock.close()
        if engine is not None:
            logger.info("shutting down the engine")
            with _signals_handled_by(signal.SIG_IGN):  # let the cleanup finish
                engine.shutdown()
