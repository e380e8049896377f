"""Runs the workers in their own processes (one per tensor-parallel rank) and talks to them over ZMQ.

Every call goes to every rank (they run the same steps in lockstep, joined by
torch.distributed); rank 0's reply is the result. Workers on this host get their calls on
``ipc://`` sockets; over several hosts (``--nnodes``) those of other hosts, started there by
``fastdeploy serve --headless`` (``engine/headless.py``), on ``tcp://`` sockets (msgpack frames,
as locally: nothing is unpickled).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import traceback
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from fastdeploy import envs
from fastdeploy.config import EngineConfig
from fastdeploy.core.step_io import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from fastdeploy.distributed import free_port_init_method
from fastdeploy.distributed.multinode import (
    CONFIG_KEY,
    NodeLayout,
    connect_store,
    host_store,
    node_error_key,
    node_layout,
    resolve_ip,
    worker_address_key,
)
from fastdeploy.engine.core import WorkerStepError
from fastdeploy.engine.ipc import ChildProcess, decode, encode, ipc_address
from fastdeploy.model_executor.model_loader import ModelSource
from fastdeploy.platforms.gc_heap import freeze_startup_heap

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process exited; the engine cannot continue."""


WORKER_STOP_GRACE_S = 1.0
"""How long a worker may take to leave after the shutdown message, then after SIGTERM, before it is killed."""


@dataclass(frozen=True)
class WorkerPlace:
    """Where one worker process sits: its tensor-parallel rank, the group's rendezvous and its socket."""

    rank: int
    init_method: str | None
    """``tcp://host:port`` of the tensor-parallel group (None at one rank)."""
    address: str
    """The engine core's socket for this worker: ``ipc://`` on the same host, ``tcp://`` from another."""


LOST_ENGINE_EXIT_CODE = 3
"""Exit status of a remote worker whose engine core went away without a shutdown message."""

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000
"""ZMQ heartbeats on the TCP sockets of remote workers: a peer silent this long (a host gone without
closing its connections) counts as disconnected."""


def _set_heartbeat(socket: zmq.Socket) -> None:
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def _disconnected(monitor: zmq.Socket | None) -> bool:
    """Whether the monitor of a TCP socket has reported a lost connection (reads what is waiting)."""
    while monitor is not None and monitor.poll(0):
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            return True
    return False


def worker_main(config: EngineConfig, source: ModelSource, max_model_len: int, place: WorkerPlace) -> None:
    """Entry point of a worker process (a :class:`~fastdeploy.engine.ipc.ChildProcess`): load, then serve calls."""
    logging.basicConfig(
        level=envs.FD_LOG_LEVEL, format=f"%(asctime)s %(levelname)s [worker {place.rank}] %(message)s"
    )
    ctx = zmq.Context()
    socket = ctx.socket(zmq.PAIR)
    remote = place.address.startswith("tcp://")  # on another host than its engine core
    if remote:
        _set_heartbeat(socket)
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED) if remote else None
    socket.connect(place.address)
    try:
        _serve_calls(config, source, max_model_len, place, socket, monitor)
    finally:
        if monitor is not None:
            socket.disable_monitor()
            monitor.close(linger=0)
        socket.close(linger=1000)  # the last reply (a start-up error) still reaches the engine core
        ctx.term()


def _next_call(socket: zmq.Socket, monitor: zmq.Socket | None) -> Any:
    """The next call from the engine core; None when a remote engine core's connection is lost."""
    if monitor is None:
        return decode(socket.recv())
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if socket in ready:
            return decode(socket.recv())
        if _disconnected(monitor):
            logger.error("lost the connection to the engine core; leaving")
            return None


def _serve_calls(
    config: EngineConfig,
    source: ModelSource,
    max_model_len: int,
    place: WorkerPlace,
    socket: zmq.Socket,
    monitor: zmq.Socket | None = None,
) -> None:
    from fastdeploy.worker.worker import Worker

    try:
        worker = Worker(config, source, max_model_len, rank=place.rank, init_method=place.init_method)
        worker.load_model()
    except Exception:
        socket.send(encode({"error": traceback.format_exc()}))
        return
    socket.send(encode({"ok": "ready"}))
    while True:
        call = _next_call(socket, monitor)
        if call is None:
            raise SystemExit(LOST_ENGINE_EXIT_CODE)  # the engine core is gone without a shutdown message
        method, args = call
        if method == "shutdown":
            return
        try:
            if method == "execute_model":
                result = worker.execute_model(SchedulerOutput.from_wire(args[0])).to_wire()
            elif method == "execute_model_overlap":
                output = worker.execute_model_overlap(SchedulerOutput.from_wire(args[0]))
                result = None if output is None else output.to_wire()
            elif method == "sample_tokens":
                result = worker.sample_tokens(GrammarBitmask(**args[0]))
            else:
                result = getattr(worker, method)(*args)
                if method == "initialize_cache":  # the last start-up call (KV cache, CUDA graphs)
                    freeze_startup_heap(f"worker {place.rank}")
            socket.send(encode({"ok": result}))
        except Exception:
            socket.send(encode({"error": traceback.format_exc()}))


@dataclass
class _RankHandle:
    """The engine core's end of one worker: its socket, and its process (on this host) or, for a worker
    on another host, the monitor that reports its connection lost."""

    rank: int
    socket: zmq.Socket
    node: int = 0
    proc: ChildProcess | None = None
    monitor: zmq.Socket | None = None


class MultiprocExecutor:
    """The engine core's handle on its worker processes, one per tensor-parallel rank.

    The workers' sockets live in the run's private ``ipc_dir``; the workers run in
    the engine core's process group, so the API server can sweep them all at the end.
    """

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        max_model_len: int,
        *,
        ipc_dir: str,
        init_method: str | None = None,
    ):
        """``init_method``: where the workers meet when their group is wider than this engine core's
        (expert parallelism over data-parallel replicas); else a free port is taken for TP > 1.
        Over several hosts (``--nnodes``) the workers meet in node 0's store instead, which the
        engine core of data-parallel rank 0 hosts; the workers of other hosts get their steps on
        ``tcp://master_addr:<port>`` sockets whose addresses this executor publishes there."""
        size = config.parallel.tensor_parallel_size
        dp_rank = config.parallel.data_parallel_rank
        layout = node_layout(config.parallel)
        if layout is not None:
            init_method = None
        elif init_method is None and size > 1:
            init_method = free_port_init_method()
        self._ready = False
        self._ranks: list[_RankHandle] = []
        self._unanswered = 0
        """Calls sent without waiting for the replies (``sample_tokens``): read before the next call."""
        self._store = None
        try:
            if layout is not None:
                self._store = self._join_store(config, layout)
            for rank in range(size):
                self._ranks.append(self._bind(rank, dp_rank * size + rank, layout, ipc_dir))
            for handle in self._ranks:  # all ranks start together: they meet in init_process_group
                if handle.node != 0:
                    continue  # started by `fastdeploy serve --headless` on its host
                place = WorkerPlace(
                    handle.rank, init_method, handle.socket.getsockopt_string(zmq.LAST_ENDPOINT)
                )
                handle.proc = ChildProcess(
                    worker_main,
                    (config, source, max_model_len, place),
                    name=f"fastdeploy-worker-{place.rank}" if size > 1 else "fastdeploy-worker",
                )
            self._gather(timeout_s=envs.FD_ENGINE_READY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self._ready = True

    @staticmethod
    def _join_store(config: EngineConfig, layout: NodeLayout) -> Any:
        """Node 0's store: hosted here by data-parallel rank 0 (with the config the other nodes check), joined
        by the others."""
        if config.parallel.data_parallel_rank != 0:
            return connect_store(layout, envs.FD_ENGINE_READY_TIMEOUT_S)
        store = host_store(layout)
        store.set(CONFIG_KEY, encode(dataclasses.asdict(config)))
        return store

    def _bind(self, rank: int, world_rank: int, layout: NodeLayout | None, ipc_dir: str) -> _RankHandle:
        """The socket of tensor-parallel ``rank``: ``ipc://`` on this host, else ``tcp://master_addr:<free port>``
        (published in the store for the worker's host)."""
        socket = zmq.Context.instance().socket(zmq.PAIR)
        if layout is None or layout.node_of(world_rank) == 0:
            handle = _RankHandle(rank, socket)
            socket.bind(ipc_address(ipc_dir, f"worker{world_rank}"))
            return handle
        _set_heartbeat(socket)
        handle = _RankHandle(rank, socket, node=layout.node_of(world_rank))
        handle.monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        socket.bind(f"tcp://{resolve_ip(layout.master_addr)}:*")
        self._store.set(worker_address_key(world_rank), socket.getsockopt_string(zmq.LAST_ENDPOINT))
        return handle

    def _wait_reply(self, handle: _RankHandle, timeout_s: float | None = None) -> Any:
        interval_ms = int(envs.FD_HEALTH_CHECK_INTERVAL_S * 1000)
        waited = 0.0
        while not handle.socket.poll(interval_ms):
            self.check_health()
            if timeout_s is not None:  # starting: a headless node may have given up
                self._check_nodes()
            waited += interval_ms / 1000
            if timeout_s is not None and waited > timeout_s:
                where = (
                    f" (node {handle.node}: is `fastdeploy serve --headless` running there?)"
                    if handle.node
                    else ""
                )
                raise TimeoutError(
                    f"the worker of rank {handle.rank}{where} did not answer within {timeout_s:.0f} s"
                )
        return decode(handle.socket.recv())

    def _check_nodes(self) -> None:
        """Raise the line with which a headless node of this executor's workers gave up, if one did."""
        for node in sorted({handle.node for handle in self._ranks if handle.node}):
            if self._store.check([node_error_key(node)]):
                raise RuntimeError(self._store.get(node_error_key(node)).decode())

    def _gather(self, timeout_s: float | None = None) -> list[Any]:
        """Every rank's reply, in rank order; the first error (rank order) is raised after all replied."""
        replies = [self._wait_reply(handle, timeout_s) for handle in self._ranks]
        for reply in replies:
            if "error" in reply:
                raise WorkerStepError(reply["error"])
        return [reply["ok"] for reply in replies]

    def _call(self, method: str, *args: Any) -> list[Any]:
        self._read_unanswered()
        self._send(method, *args)
        return self._gather()

    def _send(self, method: str, *args: Any) -> None:
        frame = encode([method, list(args)])
        for handle in self._ranks:
            handle.socket.send(frame)

    def _read_unanswered(self) -> None:
        """The replies of the calls sent without waiting (an error among them raises here)."""
        while self._unanswered:
            self._unanswered -= 1
            self._gather()

    worker_on_gpu_in_process = False
    """The workers are other processes: what they are handed crosses as bytes."""

    def determine_num_blocks(self) -> int:
        """The blocks every rank can hold (ranks with more heads need more memory per block)."""
        return min(self._call("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self._call("initialize_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput.from_wire(self._call("execute_model", scheduler_output.to_wire())[0])

    def execute_model_overlap(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch this step in the workers; the previous step's output comes back (or None)."""
        wire = self._call("execute_model_overlap", scheduler_output.to_wire())[0]
        return None if wire is None else ModelRunnerOutput.from_wire(wire)

    def sample_tokens(self, grammar: GrammarBitmask) -> None:
        """Sample the step just launched with ``execute_model_overlap``, under ``grammar``, without
        waiting: the workers lay out the mask and launch the sampling while the engine core returns
        the outputs and schedules; their replies are read before the next call (which a worker's
        error then fails)."""
        self._send("sample_tokens", grammar.to_wire())
        self._unanswered += 1

    def check_health(self) -> None:
        """Raises :class:`WorkerDiedError` if any worker process has exited, or a remote worker's connection
        was lost (its process ended, or its host went silent for :data:`HEARTBEAT_TIMEOUT_MS`)."""
        for handle in self._ranks:
            if handle.proc is not None and not handle.proc.is_alive():
                raise WorkerDiedError(
                    f"the worker process of rank {handle.rank} exited (exit code {handle.proc.exitcode})"
                )
            if _disconnected(handle.monitor):
                raise WorkerDiedError(
                    f"lost the connection to the worker of rank {handle.rank} on node {handle.node}"
                )

    @property
    def worker_pid(self) -> int | None:
        procs = [handle.proc for handle in self._ranks if handle.proc is not None]
        return procs[0].pid if procs else None

    def shutdown(self) -> None:
        """Stop the workers and reap them: the shutdown message (a ready worker reads it between steps),
        then SIGTERM, then SIGKILL, each after :data:`WORKER_STOP_GRACE_S`. Safe to call twice.

        Remote workers get the shutdown message whatever the state (one still loading reads it once
        loaded); their hosts' ``fastdeploy serve --headless`` exits when they have."""
        procs = [handle.proc for handle in self._ranks if handle.proc is not None]
        for handle in self._ranks:
            if handle.proc is None or (self._ready and handle.proc.is_alive()):  # remote, or local and ready
                with contextlib.suppress(zmq.ZMQError):
                    handle.socket.send(encode(["shutdown", []]), zmq.NOBLOCK)
        if self._ready:
            for proc in procs:
                proc.join(WORKER_STOP_GRACE_S)
        for proc in procs:
            proc.stop(WORKER_STOP_GRACE_S)
        self._ready = False
        for handle in self._ranks:
            if handle.monitor is not None:
                handle.socket.disable_monitor()
                handle.monitor.close(linger=0)
                handle.monitor = None
            handle.socket.close(linger=500 if handle.node else 0)  # the shutdown message still leaves
        self._ranks = []
        self._store = None  # data-parallel rank 0: the store closes, and the headless nodes notice
