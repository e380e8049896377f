"""``fastdeploy serve --api-server-count N`` (N > 1): N API server processes sharing one port
(or, with ``--uds``, one Unix domain socket).

The ``serve`` process binds N sockets to the port with ``SO_REUSEPORT`` (before the model
loads, so a taken port fails at once), starts the engine cores (every data-parallel rank)
and waits until they are ready, then starts N API server processes, each handed one of the
sockets and attached to the running engine cores as client ``0..N-1``
(:class:`~fastdeploy.engine.engine_cores.EngineAttachment`). The kernel spreads the incoming
connections over the N listening sockets (by a hash of the connection's addresses), so a burst
of connections lands on every process even while one event loop is busy; one socket shared by
all would go to whichever process wakes first and drains the accept queue.

The ``serve`` process then only watches: an API server that exits, or an engine core that
exits (with ``exit_on_engine_death``, the default), stops everything with one log line and exit
status 1; SIGINT/SIGTERM stop the API servers (which end their streams) and then the engine
cores, and the status is 130/143. The API servers' metrics are summed over the processes
(``fastdeploy.metrics``, prometheus_client's multiprocess mode in a private directory).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time

from fastdeploy.engine.ipc import STOP_SIGNALS, ChildProcess, kill_process_group, new_ipc_dir, remove_ipc_dir
from fastdeploy.entrypoints.openai.http_server import (
    GRACEFUL_SHUTDOWN_S,
    bind_socket,
    bind_unix_socket,
    remove_socket_file,
)

logger = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 0.1
"""How often the ``serve`` process checks that its API servers and engine cores still run."""

API_SERVER_STOP_GRACE_S = GRACEFUL_SHUTDOWN_S + 3.0
"""On stopping, how long the API servers get after SIGTERM (their graceful HTTP shutdown plus their
engine client's) before they are killed."""

LISTEN_BACKLOG = 2048
"""Pending-connection queue of each API server socket (uvicorn's default)."""

EXIT_PROCESS_DIED = 1
"""Exit status when an API server or engine core process died."""


def bind_shared_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` sockets bound to ``host:port`` with ``SO_REUSEPORT`` (port 0: one free port for all).

    A plain bind first: it fails when anything listens there already, another group of
    ``SO_REUSEPORT`` sockets included, which the shared binds alone would join.
    """
    probe = bind_socket(host, port)
    port = probe.getsockname()[1]
    probe.close()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(bind_socket(host, port, reuse_port=True))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind_api_server_sockets(args: argparse.Namespace, count: int, uds: str | None) -> list[socket.socket]:
    """The ``count`` API servers' sockets: one ``SO_REUSEPORT`` socket each on ``--host``/``--port``,
    or on the ``--uds`` path ``uds`` the one Unix domain socket they all accept on (the kernel
    hands each connection to one of them)."""
    if uds:
        return [bind_unix_socket(uds)] * count
    return bind_shared_sockets(args.host, args.port, count)


def api_server_main(args: argparse.Namespace, attach, sock_fd: int) -> None:
    """Entry point of one API server process (a :class:`ChildProcess` of ``serve``): serve on the
    inherited socket ``sock_fd`` with an engine client attached to the running engine cores."""
    from fastdeploy.entrypoints.cli.serve import run_event_loop
    from fastdeploy.entrypoints.openai.http_server import run_server

    sock = socket.socket(fileno=sock_fd)
    with STOP_SIGNALS.installed():  # SIGTERM from serve: a graceful stop, as with one API server
        try:
            code = run_event_loop(run_server(args, attach=attach, sock=sock))
        except KeyboardInterrupt:  # stopped while attaching
            code = 0
    raise SystemExit(code)


def run_api_servers(args: argparse.Namespace) -> int:
    """Run the engine cores and ``--api-server-count`` API server processes until SIGINT/SIGTERM or a
    death; returns the exit status (1 after a death; SIGINT/SIGTERM raise ``KeyboardInterrupt``,
    which ``fastdeploy``'s ``main`` turns into 130/143, everything stopped first).
    """
    from fastdeploy.engine.engine_cores import EngineAttachment, EngineCores, with_replica_init_method
    from fastdeploy.engine.parallel_layout import check_parallel_layout
    from fastdeploy.entrypoints.cli.args import (
        engine_config_from_args,
        resolve_args,
        server_config_from_args,
    )
    from fastdeploy.metrics import MULTIPROC_DIR_ENV
    from fastdeploy.model_executor.model_loader import resolve_model

    args = resolve_args(args)
    config = engine_config_from_args(args)
    server_config = server_config_from_args(args)
    count = server_config.api_server_count
    uds = server_config.uds
    sockets = bind_api_server_sockets(args, count, uds)
    where = f"unix:{uds}" if uds else f"port {sockets[0].getsockname()[1]}"
    ipc_dir = new_ipc_dir()
    metrics_dir = tempfile.mkdtemp(prefix="fastdeploy-metrics-")
    responses_dir = tempfile.mkdtemp(prefix="fastdeploy-responses-")  # stored /v1/responses, shared
    batches_dir = tempfile.mkdtemp(prefix="fastdeploy-batches-")  # /v1/files and /v1/batches, shared
    cores: EngineCores | None = None
    servers: list[ChildProcess] = []
    try:
        check_parallel_layout(config, resolve_model(config.model).arch)
        config = with_replica_init_method(config)
        cores = EngineCores(config, ipc_dir, num_clients=count)
        ready = cores.wait_ready()
        env = {**os.environ, MULTIPROC_DIR_ENV: metrics_dir, "FD_RESPONSES_STORE_DIR": responses_dir,
               "FD_BATCH_STORE_DIR": batches_dir}  # fmt: skip
        options = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})  # picklable
        for sock in sockets:
            # Every socket listens before its API server starts: a connection the kernel hashes to a
            # process still starting waits in that socket's backlog. (A socket bound but not yet
            # listening takes no connections, so all of them went to the process up first.)
            sock.listen(LISTEN_BACKLOG)
        for index, sock in enumerate(sockets):
            attach = EngineAttachment(
                ipc_dir, index, count, cores.pids, ready["max_model_len"], ready["num_blocks"]
            )
            servers.append(
                ChildProcess(
                    api_server_main,
                    (options, attach, sock.fileno()),
                    name=f"fastdeploy-api-server-{index}",
                    new_group=True,
                    pass_fds=(sock.fileno(),),
                    env=env,
                )
            )
        for sock in sockets:  # each API server holds its own now
            sock.close()
        print(
            f"fastdeploy serve: {count} API server processes on {where} "
            f"(pids {', '.join(str(s.pid) for s in servers)}), "
            f"{cores.num_ranks} engine core{'s' if cores.num_ranks > 1 else ''}",
            flush=True,
        )
        return _supervise(cores, servers, server_config.exit_on_engine_death)
    finally:
        with STOP_SIGNALS.shielded():
            _stop_api_servers(servers, server_config.shutdown_timeout)
            if cores is not None:
                cores.stop()
            for sock in sockets:
                sock.close()
            if uds:
                remove_socket_file(uds)
            remove_ipc_dir(ipc_dir)
            shutil.rmtree(metrics_dir, ignore_errors=True)
            shutil.rmtree(responses_dir, ignore_errors=True)
            shutil.rmtree(batches_dir, ignore_errors=True)


def _supervise(cores, servers: list[ChildProcess], exit_on_engine_death: bool) -> int:
    """Wait until an API server exits (→ 1) or an engine core does (→ 1 with ``exit_on_engine_death``;
    without, the API servers answer 503 until stopped). SIGINT/SIGTERM raise ``KeyboardInterrupt``."""
    engine_dead = False
    while True:
        for index, server in enumerate(servers):
            if not server.is_alive():
                logger.error(
                    "API server %d (pid %d) exited (exit code %s); stopping the server",
                    index, server.pid, server.exitcode,
                )  # fmt: skip
                return EXIT_PROCESS_DIED
        dead = None if engine_dead else cores.dead()
        if dead is not None:
            if exit_on_engine_death:
                logger.error("%s; stopping the server", dead)
                return EXIT_PROCESS_DIED
            logger.error("%s; the API servers answer 503 until stopped", dead)
            engine_dead = True
        time.sleep(SUPERVISE_INTERVAL_S)


def _stop_api_servers(servers: list[ChildProcess], drain_s: float = 0.0) -> None:
    """SIGTERM every API server (each stops serving gracefully, letting its requests in flight
    finish for up to ``drain_s``: ``--shutdown-timeout``), wait, then kill what is left."""
    for server in servers:
        if server.is_alive():
            with contextlib.suppress(OSError):
                os.kill(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + drain_s + API_SERVER_STOP_GRACE_S
    for server in servers:
        server.stop(max(0.0, deadline - time.monotonic()))
    for server in servers:
        if not kill_process_group(server.pid):
            logger.warning("a process outlived its API server (pid %d)", server.pid)
