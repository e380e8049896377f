"""Running the OpenAI-compatible server: bind, load the engine, serve with uvicorn, shut down.

:func:`run_server` builds the engine from the CLI options, serves the app of
:func:`~fastdeploy.entrypoints.openai.api_server.build_app` until SIGINT/SIGTERM
(or until the engine dies, with ``exit_on_engine_death``) and always shuts the
engine down. Signals follow :data:`fastdeploy.engine.ipc.STOP_SIGNALS`: while
the engine loads they interrupt the load, while serving they stop the server
gracefully, and during the cleanup they are ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import inspect
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

from fastdeploy.config import EngineConfig, as_list
from fastdeploy.engine.ipc import STOP_SIGNALS
from fastdeploy.engine.protocol import EngineClient
from fastdeploy.entrypoints.openai.api_server import build_app
from fastdeploy.platforms.backend import backend_version
from fastdeploy.platforms.gc_heap import freeze_startup_heap

if TYPE_CHECKING:
    from fastdeploy.engine.engine_cores import EngineAttachment

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 3.0
"""On SIGINT/SIGTERM, how long responses may take to finish before uvicorn cancels them (generation
requests in flight are ended at once with a 503, see ``begin_shutdown``; an idle server stops at once)."""

ENGINE_DEATH_EXIT_DELAY_S = 3.0
"""With ``exit_on_engine_death``, how long the server goes on after the engine died before it exits:
streams in flight end with an error event at once, and meanwhile ``/health`` and new requests get 503."""

EXIT_ENGINE_DEAD = 1
"""Exit status of ``fastdeploy serve`` when the engine died."""

QUIET_ACCESS_LOG_PATHS = frozenset({"/health", "/health_generate", "/ping", "/metrics"})
"""Paths polled by health checkers and Prometheus: kept out of uvicorn's access log."""

# --------------------------------------------------------------------------- running


def default_served_model_names(config: EngineConfig) -> list[str]:
    """``--served-model-name`` if given, else the model path's name (``.gguf`` dropped), else the default model's."""
    if as_list(config.model.served_model_name):
        return as_list(config.model.served_model_name)
    if config.model.model:
        name = os.path.basename(os.path.normpath(config.model.model))
        return [name.removesuffix(".gguf") or config.model.model]
    from fastdeploy.model_executor.model_loader.default_model import DEFAULT_MODEL_NAME

    return [DEFAULT_MODEL_NAME]


class QuietPathsFilter(logging.Filter):
    """Drops uvicorn access-log records of :data:`QUIET_ACCESS_LOG_PATHS` (each scrape would be a line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in QUIET_ACCESS_LOG_PATHS
        return True


def quiet_access_log() -> None:
    """Install :class:`QuietPathsFilter` on uvicorn's access logger (once)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QuietPathsFilter) for f in access.filters):
        access.addFilter(QuietPathsFilter())


class _Server(uvicorn.Server):
    """uvicorn's server, with the signal handling and the engine watch the engine relies on.

    uvicorn re-raises a captured SIGTERM after its shutdown, which would kill
    the process before the engine's children are stopped; here a signal only
    stops the server (through :data:`STOP_SIGNALS`, which keeps it for the exit
    status), and the caller shuts the engine down afterwards. With an
    ``engine`` to watch and ``exit_on_engine_death``, the server also stops
    :data:`ENGINE_DEATH_EXIT_DELAY_S` after the engine died (:attr:`engine_died`).
    """

    def __init__(
        self,
        config: uvicorn.Config,
        on_ready: Callable[[str, int, str], None] | None = None,
        engine: EngineClient | None = None,
        exit_on_engine_death: bool = False,
        drain_s: float = 0.0,
    ):
        super().__init__(config)
        self._on_ready = on_ready
        self._engine = engine
        self._exit_on_engine_death = exit_on_engine_death
        self._drain_s = drain_s
        self._engine_dead_since: float | None = None
        self.engine_died = False
        """Whether the server stopped because the engine died."""

    def capture_signals(self):  # type: ignore[override]
        return STOP_SIGNALS.calling(lambda signum: self.handle_exit(signum, None))

    async def on_tick(self, counter: int) -> bool:
        # every 0.1 s: is_healthy also fails the requests in flight of an engine that has just died
        if self._engine is not None and self._engine_dead_since is None and not self._engine.is_healthy:
            self._engine_dead_since = time.monotonic()
            reason = getattr(self._engine, "dead_reason", None) or "unknown cause"
            if self._exit_on_engine_death:
                logger.error("the engine died (%s); exiting in %.0f s", reason, ENGINE_DEATH_EXIT_DELAY_S)
            else:
                logger.error("the engine died (%s); answering 503 until stopped", reason)
        if (
            self._exit_on_engine_death
            and self._engine_dead_since is not None
            and time.monotonic() - self._engine_dead_since >= ENGINE_DEATH_EXIT_DELAY_S
        ):
            self.engine_died = self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: Any = None) -> None:
        state = getattr(self.config.app, "state", None)
        if self._drain_s > 0 and not self.engine_died:
            await self._drain(state)
        begin_shutdown = getattr(state, "begin_shutdown", None)
        if begin_shutdown is not None:
            begin_shutdown()  # end streams cleanly instead of cutting them after the grace period
        await super().shutdown(sockets=sockets)

    async def _drain(self, state: Any) -> None:
        """``--shutdown-timeout``: accept no new connection, refuse new requests (and /health) with a
        503, and wait up to ``drain_s`` for the requests in flight (a second SIGINT ends the wait)."""
        for server in getattr(self, "servers", []):
            server.close()
        begin_drain = getattr(state, "begin_drain", None)
        if begin_drain is not None:
            begin_drain()
        deadline = time.monotonic() + self._drain_s
        if self.server_state.tasks:
            logger.info(
                "stopping: %d requests in flight, waiting up to %.0f s for them (--shutdown-timeout)",
                len(self.server_state.tasks), self._drain_s,
            )  # fmt: skip
        while self.server_state.tasks and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.server_state.tasks:
            logger.warning("stopping: %d requests still in flight end now", len(self.server_state.tasks))

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit and self._on_ready is not None:
            host, port = self.config.host, self.config.port
            scheme = "https" if self.config.is_ssl else "http"
            for server in getattr(self, "servers", []):
                for sock in server.sockets or []:
                    name = sock.getsockname()
                    if isinstance(name, str):  # a Unix domain socket: its path
                        host, port, scheme = name, 0, "unix"
                    else:
                        port = name[1]
                    break
            self._on_ready(host, port, scheme)


def _print_ready(host: str, port: int, scheme: str = "http") -> None:
    """The ready line; ``scheme`` ``unix``: ``host`` is the socket's path."""
    if scheme == "unix":
        print(f"FastDeploy API server ready at unix:{host}", flush=True)
        return
    shown = f"[{host}]" if ":" in host else host
    print(f"FastDeploy API server ready at {scheme}://{shown}:{port}", flush=True)


class BindError(OSError):
    """The server's address cannot be bound (port in use, unknown host, no permission)."""


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound (not yet listening) to ``host:port``; a :class:`BindError` if that fails.

    Binding before the model loads makes a taken port fail in a second, not after the load.
    ``reuse_port``: with ``SO_REUSEPORT``, so that several sockets (one per API server process)
    share the port and the kernel spreads the connections over them.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise BindError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise BindError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def bind_unix_socket(path: str) -> socket.socket:
    """A Unix domain stream socket bound (not yet listening) to ``path`` (``--uds``, as vLLM's);
    a :class:`BindError` if that fails.

    A socket file already at ``path`` (left by a server that did not remove it) is replaced, as
    uvicorn's own ``--uds`` does; any other file there is an error, never deleted.
    """
    if os.path.exists(path) and not stat.S_ISSOCK(os.stat(path).st_mode):
        raise BindError(errno.EEXIST, f"cannot listen on unix:{path}: a file that is not a socket is there")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.exists(path):
            os.unlink(path)
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise BindError(exc.errno, f"cannot listen on unix:{path}: {exc.strerror or exc}") from None
    return sock


def bind_listen_socket(host: str, port: int, uds: str | None) -> socket.socket:
    """The server's socket: on the Unix domain socket ``uds`` (``--uds``) if given, else on ``host:port``."""
    return bind_unix_socket(uds) if uds else bind_socket(host, port)


def remove_socket_file(path: str) -> None:
    """Remove the file of a Unix domain socket that is closed (nothing answers there any more)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)


async def serve_http(
    app: FastAPI,
    host: str,
    port: int,
    *,
    sock: socket.socket | None = None,
    on_ready: Callable[[str, int, str], None] | None = _print_ready,
    log_level: str | None = None,
    access_log: bool = True,
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
    engine: EngineClient | None = None,
    exit_on_engine_death: bool = False,
    drain_s: float = 0.0,
) -> bool:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM; ``on_ready(host, port, scheme)`` once it accepts connections.

    ``sock`` is a socket from :func:`bind_socket` (else uvicorn binds ``host:port`` itself).
    With an ``engine`` and ``exit_on_engine_death``, serving also ends soon after the
    engine dies; returns whether that is why it ended.
    """
    if log_level is None:
        from fastdeploy import envs

        log_level = str(envs.FD_LOG_LEVEL).lower()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile,
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    quiet_access_log()  # after uvicorn.Config, which configures uvicorn's loggers
    server = _Server(
        config, on_ready=on_ready, engine=engine, exit_on_engine_death=exit_on_engine_death, drain_s=drain_s
    )
    await server.serve(sockets=[sock] if sock is not None else None)
    return server.engine_died


async def start_engine(config: EngineConfig, attach: EngineAttachment | None = None) -> EngineClient:
    """The engine client of ``config``, its engine started (``attach``: attached to engine cores
    already running, as one of several API server processes)."""
    from fastdeploy.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(config) if attach is None else AsyncLLM(config, attach)
    return await engine if inspect.isawaitable(engine) else engine


def stop_served(app: FastAPI | None, engine: EngineClient | None) -> None:
    """Close what serving ``app`` (None: not built) over ``engine`` (None: not started) holds: its
    stored responses, then the engine (returns once every engine process is gone). Call it shielded
    from signals."""
    if app is not None:
        app.state.responses_store.close()
    if engine is not None:
        started = time.monotonic()
        engine.shutdown()
        logger.info("engine shut down in %.2f s", time.monotonic() - started)


async def run_server(
    args: argparse.Namespace, attach: EngineAttachment | None = None, sock: socket.socket | None = None
) -> int:
    """Build the engine from parsed ``serve`` options, serve HTTP, and always shut the engine down.

    ``attach`` and ``sock``: this is one of several API server processes
    (``--api-server-count``): its engine client attaches to engine cores already running
    and it serves on ``sock``, bound by the ``serve`` process (only API server 0 prints
    the ready line).

    Returns the exit status: :data:`EXIT_ENGINE_DEAD` when serving ended because
    the engine died, else ``128 + signal number`` of the signal that stopped it.
    The port (or the ``--uds`` socket) is bound first (a busy port fails before the model loads). A signal
    while the engine loads raises ``KeyboardInterrupt`` (see :data:`STOP_SIGNALS`).
    Either way ``engine.shutdown()`` runs, shielded from further signals, and
    returns only once every engine process is gone.
    """
    from fastdeploy.entrypoints.cli.args import engine_config_from_args, resolve_args, server_config_from_args

    args = resolve_args(args)
    config = engine_config_from_args(args)
    server_config = server_config_from_args(args)
    served_model_names = default_served_model_names(config)
    socket_file: str | None = None  # a --uds socket's file, removed on exit by its owner
    if sock is None:
        sock = bind_listen_socket(args.host, args.port, server_config.uds)
        socket_file = sock.getsockname() if sock.family == socket.AF_UNIX else None
    index = attach.client_index if attach is not None else 0
    engine: Any = None
    app: Any = None
    logger.info("tensor backend: %s", backend_version())
    try:
        engine = await start_engine(config, attach)
        app = build_app(engine, served_model_names, server_config, api_server_index=index)
        freeze_startup_heap("API server" if attach is None else f"API server {index}")
        STOP_SIGNALS.raise_if_received()  # a signal whose interrupt got lost while loading
        engine_died = await serve_http(
            app,
            args.host,
            args.port,
            sock=sock,
            on_ready=_print_ready if index == 0 else None,
            log_level=server_config.uvicorn_log_level,
            access_log=not server_config.disable_uvicorn_access_log,
            ssl_keyfile=server_config.ssl_keyfile,
            ssl_certfile=server_config.ssl_certfile,
            engine=engine,
            exit_on_engine_death=server_config.exit_on_engine_death,
            drain_s=server_config.shutdown_timeout,
        )
    finally:
        with STOP_SIGNALS.shielded():
            sock.close()
            if socket_file:
                remove_socket_file(socket_file)
            stop_served(app, engine)
    if engine_died:
        return EXIT_ENGINE_DEAD
    return STOP_SIGNALS.exit_code or 0
