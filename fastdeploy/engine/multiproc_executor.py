"""Runs the worker in its own process and talks to it over ZMQ."""

from __future__ import annotations

import traceback
from typing import Any

import zmq

from fastdeploy import envs
from fastdeploy.config import EngineConfig
from fastdeploy.engine.core import WorkerStepError
from fastdeploy.engine.ipc import ChildProcess, decode, encode, ipc_address
from fastdeploy.model_executor.model_loader import ModelSource
from fastdeploy.scheduler.output import ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker process exited; the engine cannot continue."""


WORKER_STOP_GRACE_S = 1.0
"""How long a worker may take to leave after the shutdown message, then after SIGTERM, before it is killed."""


def _worker_main(config: EngineConfig, source: ModelSource, max_model_len: int, address: str) -> None:
    """Entry point of a worker process (a :class:`~fastdeploy.engine.ipc.ChildProcess`): load, then serve calls."""
    ctx = zmq.Context()
    socket = ctx.socket(zmq.PAIR)
    socket.connect(address)
    try:
        _serve_calls(config, source, max_model_len, socket)
    finally:
        socket.close(linger=1000)  # the last reply (a start-up error) still reaches the engine core
        ctx.term()


def _serve_calls(config: EngineConfig, source: ModelSource, max_model_len: int, socket: zmq.Socket) -> None:
    from fastdeploy.worker.worker import Worker

    try:
        worker = Worker(config, source, max_model_len)
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
            else:
                result = getattr(worker, method)(*args)
            socket.send(encode({"ok": result}))
        except Exception:
            socket.send(encode({"error": traceback.format_exc()}))


class MultiprocExecutor:
    """The engine core's handle on its worker process.

    The worker's socket lives in the run's private ``ipc_dir``; the worker runs in
    the engine core's process group, so the API server can sweep both at the end.
    """

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int, *, ipc_dir: str):
        if config.parallel.tensor_parallel_size != 1:
            raise NotImplementedError("tensor_parallel_size > 1 is not implemented yet")
        address = ipc_address(ipc_dir, "worker")
        self._ready = False
        self._socket = zmq.Context.instance().socket(zmq.PAIR)
        self._socket.bind(address)
        self._proc: ChildProcess | None = None
        try:
            self._proc = ChildProcess(
                _worker_main, (config, source, max_model_len, address), name="fastdeploy-worker"
            )
            self._wait_reply(timeout_s=envs.FD_ENGINE_READY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self._ready = True

    def _wait_reply(self, timeout_s: float | None = None) -> Any:
        interval_ms = int(envs.FD_HEALTH_CHECK_INTERVAL_S * 1000)
        waited = 0.0
        while not self._socket.poll(interval_ms):
            self.check_health()
            waited += interval_ms / 1000
            if timeout_s is not None and waited > timeout_s:
                raise TimeoutError(f"the worker did not answer within {timeout_s:.0f} s")
        reply = decode(self._socket.recv())
        if "error" in reply:
            raise WorkerStepError(reply["error"])
        return reply["ok"]

    def _call(self, method: str, *args: Any) -> Any:
        self._socket.send(encode([method, list(args)]))
        return self._wait_reply()

    def determine_num_blocks(self) -> int:
        return self._call("determine_num_blocks")

    def initialize_cache(self, num_blocks: int) -> None:
        self._call("initialize_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput.from_wire(self._call("execute_model", scheduler_output.to_wire()))

    def execute_model_overlap(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch this step in the worker; the previous step's output comes back (or None)."""
        wire = self._call("execute_model_overlap", scheduler_output.to_wire())
        return None if wire is None else ModelRunnerOutput.from_wire(wire)

    def check_health(self) -> None:
        """Raises :class:`WorkerDiedError` if the worker process has exited."""
        if self._proc is not None and not self._proc.is_alive():
            raise WorkerDiedError(f"the worker process exited (exit code {self._proc.exitcode})")

    @property
    def worker_pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def shutdown(self) -> None:
        """Stop the worker and reap it: the shutdown message (a ready worker reads it between steps),
        then SIGTERM, then SIGKILL, each after :data:`WORKER_STOP_GRACE_S`. Safe to call twice."""
        if self._proc is not None:
            if self._ready and self._proc.is_alive():
                try:
                    self._socket.send(encode(["shutdown", []]), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                self._proc.join(WORKER_STOP_GRACE_S)
            self._proc.stop(WORKER_STOP_GRACE_S)
        self._ready = False
        self._socket.close(linger=0)
