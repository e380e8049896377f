"""Runs the workers in their own processes (one per tensor-parallel rank) and talks to them over ZMQ.

Every call goes to every rank (they run the same steps in lockstep, joined by
torch.distributed); rank 0's reply is the result.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from fastdeploy import envs
from fastdeploy.config import EngineConfig
from fastdeploy.core.step_io import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from fastdeploy.distributed import free_port_init_method
from fastdeploy.engine.core import WorkerStepError
from fastdeploy.engine.ipc import ChildProcess, decode, encode, ipc_address
from fastdeploy.model_executor.model_loader import ModelSource


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


def _worker_main(config: EngineConfig, source: ModelSource, max_model_len: int, place: WorkerPlace) -> None:
    """Entry point of a worker process (a :class:`~fastdeploy.engine.ipc.ChildProcess`): load, then serve calls."""
    logging.basicConfig(
        level=envs.FD_LOG_LEVEL, format=f"%(asctime)s %(levelname)s [worker {place.rank}] %(message)s"
    )
    ctx = zmq.Context()
    socket = ctx.socket(zmq.PAIR)
    socket.connect(place.address)
    try:
        _serve_calls(config, source, max_model_len, place, socket)
    finally:
        socket.close(linger=1000)  # the last reply (a start-up error) still reaches the engine core
        ctx.term()


def _serve_calls(
    config: EngineConfig, source: ModelSource, max_model_len: int, place: WorkerPlace, socket: zmq.Socket
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
        method, args = decode(socket.recv())
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
            socket.send(encode({"ok": result}))
        except Exception:
            socket.send(encode({"error": traceback.format_exc()}))


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
        (expert parallelism over data-parallel replicas); else a free port is taken for TP > 1."""
        size = config.parallel.tensor_parallel_size
        if init_method is None and size > 1:
            init_method = free_port_init_method()
        dp_rank = config.parallel.data_parallel_rank
        places = [
            WorkerPlace(r, init_method, ipc_address(ipc_dir, f"worker{dp_rank}-{r}")) for r in range(size)
        ]
        self._ready = False
        self._sockets: list[zmq.Socket] = []
        self._procs: list[ChildProcess] = []
        try:
            for place in places:
                socket = zmq.Context.instance().socket(zmq.PAIR)
                socket.bind(place.address)
                self._sockets.append(socket)
            for place in places:  # all ranks start together: they meet in init_process_group
                self._procs.append(
                    ChildProcess(
                        _worker_main,
                        (config, source, max_model_len, place),
                        name=f"fastdeploy-worker-{place.rank}" if size > 1 else "fastdeploy-worker",
                    )
                )
            self._gather(timeout_s=envs.FD_ENGINE_READY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self._ready = True

    def _wait_reply(self, socket: zmq.Socket, timeout_s: float | None = None) -> Any:
        interval_ms = int(envs.FD_HEALTH_CHECK_INTERVAL_S * 1000)
        waited = 0.0
        while not socket.poll(interval_ms):
            self.check_health()
            waited += interval_ms / 1000
            if timeout_s is not None and waited > timeout_s:
                raise TimeoutError(f"a worker did not answer within {timeout_s:.0f} s")
        return decode(socket.recv())

    def _gather(self, timeout_s: float | None = None) -> list[Any]:
        """Every rank's reply, in rank order; the first error (rank order) is raised after all replied."""
        replies = [self._wait_reply(socket, timeout_s) for socket in self._sockets]
        for reply in replies:
            if "error" in reply:
                raise WorkerStepError(reply["error"])
        return [reply["ok"] for reply in replies]

    def _call(self, method: str, *args: Any) -> list[Any]:
        frame = encode([method, list(args)])
        for socket in self._sockets:
            socket.send(frame)
        return self._gather()

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
        """Sample the step just launched with ``execute_model_overlap``, under ``grammar``."""
        self._call("sample_tokens", dataclasses.asdict(grammar))

    def check_health(self) -> None:
        """Raises :class:`WorkerDiedError` if any worker process has exited."""
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise WorkerDiedError(f"the worker process of rank {rank} exited (exit code {proc.exitcode})")

    @property
    def worker_pid(self) -> int | None:
        return self._procs[0].pid if self._procs else None

    def shutdown(self) -> None:
        """Stop the workers and reap them: the shutdown message (a ready worker reads it between steps),
        then SIGTERM, then SIGKILL, each after :data:`WORKER_STOP_GRACE_S`. Safe to call twice."""
        if self._ready:
            for socket, proc in zip(self._sockets, self._procs):
                if proc.is_alive():
                    try:
                        socket.send(encode(["shutdown", []]), zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
            for proc in self._procs:
                proc.join(WORKER_STOP_GRACE_S)
        for proc in self._procs:
            proc.stop(WORKER_STOP_GRACE_S)
        self._ready = False
        for socket in self._sockets:
            socket.close(linger=0)
