"""Starting, watching and stopping the engine core processes (one per data-parallel rank).

Whoever starts the engine cores holds an :class:`EngineCores`: ``AsyncLLM`` itself with one
API server, the ``fastdeploy serve`` process with ``--api-server-count`` > 1 (its API server
processes then attach to the running engine cores with an :class:`EngineAttachment`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import signal
import time
from dataclasses import dataclass
from typing import Any

import zmq

from fastdeploy import envs
from fastdeploy.config import EngineConfig
from fastdeploy.distributed import free_port_init_method
from fastdeploy.engine.core_proc import CONTROL_SOCKET_NAME, engine_core_main, input_socket_name
from fastdeploy.engine.ipc import STOP_SIGNALS, ChildProcess, decode, encode, ipc_address, kill_process_group

logger = logging.getLogger(__name__)

ENGINE_STOP_GRACE_S = 2.0
"""On shutdown, how long the engine core may take to leave after the shutdown message (it reads it
between steps), and again after SIGTERM, before it is killed."""


class EngineStartupError(RuntimeError):
    """The engine core failed to start (bad model, too little memory, ...)."""


@dataclass(frozen=True)
class EngineAttachment:
    """What an API server process needs to talk to engine cores another process started."""

    ipc_dir: str
    """The run's socket directory (``in<rank>``, ``out<client>``)."""
    client_index: int
    """This API server's index, 0 to ``num_clients`` - 1 (its output socket is ``out<client_index>``)."""
    num_clients: int
    """API server processes (``--api-server-count``)."""
    core_pids: tuple[int, ...]
    """The engine core processes, by data-parallel rank (watched for exits)."""
    max_model_len: int
    num_blocks: int


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """A copy of ``config`` for the engine core of data-parallel ``rank`` (its workers pick their devices
    from it)."""
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_rank=rank))


def with_replica_init_method(config: EngineConfig) -> EngineConfig:
    """``config`` with a free ``data_parallel_init_method`` where the engine cores of a lockstep group
    meet (MoE layers spanning the replicas) and none was given; else ``config`` as it is."""
    parallel = config.parallel
    if parallel.expert_parallel_spans_replicas and not parallel.data_parallel_init_method:
        parallel = dataclasses.replace(parallel, data_parallel_init_method=free_port_init_method())
        return dataclasses.replace(config, parallel=parallel)
    return config


def which_rank(rank: int, num_ranks: int) -> str:
    """`` of data-parallel rank N`` for messages about one engine core, when there are several."""
    return f" of data-parallel rank {rank}" if num_ranks > 1 else ""


class EngineCores:
    """The engine core processes of one run, started at once (they load their models side by side).

    ``num_clients``: the API server processes that will send requests (each binds its own
    output socket in ``ipc_dir``). :meth:`wait_ready` blocks until every core reports ready;
    :meth:`stop` returns only once every engine process is gone.
    """

    def __init__(self, config: EngineConfig, ipc_dir: str, num_clients: int = 1):
        self.num_ranks = config.parallel.data_parallel_size
        self.procs: list[ChildProcess] = []
        self.ready = False
        self._ctx = zmq.Context()
        self._control = self._ctx.socket(zmq.PULL)
        self._control.bind(ipc_address(ipc_dir, CONTROL_SOCKET_NAME))
        self._to_cores = []
        """Per rank, a socket for the shutdown message."""
        try:
            for rank in range(self.num_ranks):
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.connect(ipc_address(ipc_dir, input_socket_name(rank)))
                self._to_cores.append(sock)
            for rank in range(self.num_ranks):
                name = "fastdeploy-engine-core" + (f"-{rank}" if self.num_ranks > 1 else "")
                args = (rank_config(config, rank), ipc_dir, num_clients)
                self.procs.append(ChildProcess(engine_core_main, args, name=name, new_group=True))
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(proc.pid for proc in self.procs)

    def _which(self, rank: int) -> str:
        return which_rank(rank, self.num_ranks)

    def wait_ready(self) -> dict[str, Any]:
        """Block until every engine core reports ready (or one failed / died / the time is up).

        Returns rank 0's message (all ranks run the same model with the same limits:
        ``max_model_len``, ``num_blocks``). SIGINT/SIGTERM meanwhile raise ``KeyboardInterrupt``.
        """
        deadline = time.monotonic() + envs.FD_ENGINE_READY_TIMEOUT_S
        ready: dict[int, dict[str, Any]] = {}
        while len(ready) < self.num_ranks:
            STOP_SIGNALS.raise_if_received()
            if self._control.poll(200):
                message = decode(self._control.recv())
                if message["type"] == "ready":
                    ready[message["rank"]] = message
                elif message["type"] == "failed":
                    logger.debug("engine start-up trace:\n%s", message.get("trace"))
                    which = self._which(message["rank"])
                    raise EngineStartupError(f"the engine{which} failed to start: {message['error']}")
            else:
                dead = self.dead()
                if dead is not None:
                    raise EngineStartupError(f"{dead} during start-up")
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"the engine did not start within {envs.FD_ENGINE_READY_TIMEOUT_S:.0f} s"
                )
        self.ready = True
        return ready[0]

    def dead(self) -> str | None:
        """Which engine core process has exited (with its exit code), or None while all run."""
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                return f"the engine core process{self._which(rank)} exited (exit code {proc.exitcode})"
        return None

    def stop(self) -> None:
        """Stop the engine cores and their workers; safe to call twice.

        The engine cores are asked to stop (once they are ready; each stops its workers
        first), then sent SIGTERM, then killed, each step after :data:`ENGINE_STOP_GRACE_S`
        for all of them together; whatever is left in their process groups (a worker of a
        killed engine core) is killed last.
        """
        procs = self.procs
        if self.ready:
            for proc, sock in zip(procs, self._to_cores):
                if proc.is_alive():
                    with contextlib.suppress(zmq.ZMQError):
                        sock.send(encode({"type": "shutdown"}), zmq.NOBLOCK)
            deadline = time.monotonic() + ENGINE_STOP_GRACE_S
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:  # SIGTERM to all at once: each stops its workers in parallel with the others
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + ENGINE_STOP_GRACE_S
        for proc in procs:
            proc.stop(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if not kill_process_group(proc.pid):
                logger.warning("an engine process outlived its engine core (pid %d)", proc.pid)
        self.procs = []
        if not self._ctx.closed:
            for sock in (self._control, *self._to_cores):
                sock.close(linger=0)
            self._ctx.term()


class WatchedProcess:
    """A process this one did not start, watched for its exit (a pidfd on Linux, else ``kill(pid, 0)``,
    which cannot tell a zombie from a live process). Its exit code is not known here."""

    exitcode = None

    def __init__(self, pid: int):
        self.pid = pid
        self._pidfd: int | None = None
        self._gone = False
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except (AttributeError, OSError):
            pass

    def is_alive(self) -> bool:
        if self._gone:
            return False
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]  # readable once the process exited
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
