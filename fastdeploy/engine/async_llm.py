"""The API server's engine client: engine core in its own process, outputs streamed back over ZMQ."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from fastdeploy import envs
from fastdeploy.config import EngineConfig
from fastdeploy.engine.core_proc import engine_core_main
from fastdeploy.engine.feature_mirror import FeatureMirror
from fastdeploy.engine.input_processor import InputProcessor, eos_ids_of
from fastdeploy.engine.ipc import (
    STOP_SIGNALS,
    ChildProcess,
    decode,
    encode,
    ipc_address,
    kill_process_group,
    new_ipc_dir,
    remove_ipc_dir,
)
from fastdeploy.engine.output_processor import OutputProcessor, RequestState
from fastdeploy.engine.outputs import RequestOutput
from fastdeploy.engine.protocol import EngineClient, EngineDeadError
from fastdeploy.engine.request import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.metrics import EngineMetrics
from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model
from fastdeploy.multimodal.items import MMItem

logger = logging.getLogger(__name__)

ENGINE_STOP_GRACE_S = 2.0
"""On shutdown, how long the engine core may take to leave after the shutdown message (it reads it
between steps), and again after SIGTERM, before it is killed."""


class EngineStartupError(RuntimeError):
    """The engine core failed to start (bad model, too little memory, ...)."""


class EngineGenerateError(RuntimeError):
    """The engine failed one request; the server stays up for the others."""


def _default_model_name(config: EngineConfig, source: Any) -> str:
    """The name the API serves the model under when none is given (the ``model_name`` metrics label).

    Must agree with ``http_server.default_served_model_names``: the embedded default
    model is served as ``DEFAULT_MODEL_NAME``, not under its .gguf file name.
    """
    if not config.model.model:
        from fastdeploy.model_executor.model_loader.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return source.display_name.removesuffix(".gguf")


class AsyncLLM(EngineClient):
    """Tokenizes and detokenizes here; schedules and runs the model in child processes.

    One asyncio task reads engine outputs and routes them to per-request
    queues; another watches the engine process. If the engine or a worker
    dies, every waiting request gets ``EngineDeadError`` and ``is_healthy``
    turns False.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.source = resolve_model(config.model)
        self.tokenizer = load_tokenizer(config.model, self.source)
        self.eos_token_ids = eos_ids_of(self.source.arch.eos_token_ids, self.tokenizer)
        self.vocab_size = self.source.arch.vocab_size
        self.arch = self.source.arch
        self._feature_mirror = FeatureMirror(config.cache.encoder_cache_memory)
        """What the engine core holds of the features sent to it (a repeated item goes without them)."""
        self.model_name = config.model.served_model_name or _default_model_name(config, self.source)
        self.metrics = EngineMetrics(self.model_name)
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        self._queues: dict[str, asyncio.Queue] = {}
        self._dead_reason: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False

        self._zmq = zmq.asyncio.Context()
        self._zmq_sync = zmq.Context()
        self._ipc_dir = new_ipc_dir()
        """This run's private socket directory (the engine core's and its workers' sockets too)."""
        self._ready = False
        self._proc: ChildProcess | None = None
        try:
            self._to_core = self._zmq_sync.socket(zmq.PUSH)  # sends never block the event loop: no HWM
            self._to_core.setsockopt(zmq.SNDHWM, 0)
            self._to_core.bind(ipc_address(self._ipc_dir, "in"))
            self._from_core = self._zmq.socket(zmq.PULL)
            self._from_core.bind(ipc_address(self._ipc_dir, "out"))
            self._proc = ChildProcess(
                engine_core_main, (config, self._ipc_dir), name="fastdeploy-engine-core", new_group=True
            )
            ready = self._wait_ready()
        except BaseException:  # a failed start, or SIGINT/SIGTERM meanwhile: nothing may be left behind
            self.shutdown()
            raise
        self._ready = True
        self.max_model_len = ready["max_model_len"]
        self.num_blocks = ready["num_blocks"]
        self.input_processor = InputProcessor(
            self.tokenizer, self.max_model_len, self.eos_token_ids, self.source.arch.vocab_size
        )
        try:  # inside the server's event loop: watch the engine from now on, not from the first request
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            self._ensure_tasks()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(config)

    @property
    def engine_pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _wait_ready(self) -> dict[str, Any]:
        """Block until the engine core reports ready (or failed / died / timed out)."""
        poller_socket = zmq.Socket.shadow(self._from_core.underlying)
        deadline = time.monotonic() + envs.FD_ENGINE_READY_TIMEOUT_S
        while True:
            STOP_SIGNALS.raise_if_received()
            if poller_socket.poll(200):
                message = decode(poller_socket.recv())
                if message["type"] == "ready":
                    return message
                if message["type"] == "failed":
                    logger.debug("engine start-up trace:\n%s", message.get("trace"))
                    raise EngineStartupError(f"the engine failed to start: {message['error']}")
            elif self._proc is not None and not self._proc.is_alive():
                raise EngineStartupError(
                    f"the engine process exited during start-up (exit code {self._proc.exitcode})"
                )
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"the engine did not start within {envs.FD_ENGINE_READY_TIMEOUT_S:.0f} s"
                )

    # ---- background tasks ------------------------------------------------------------

    def _ensure_tasks(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._read_outputs(), name="fastdeploy-output-reader"),
                asyncio.create_task(self._watch_engine(), name="fastdeploy-engine-watch"),
            ]

    async def _read_outputs(self) -> None:
        try:
            while True:
                message = decode(await self._from_core.recv())
                if message["type"] == "outputs":
                    self._handle_outputs(EngineCoreOutputs.from_wire({**message, "timestamp": time.time()}))
                elif message["type"] == "dead":
                    self._mark_dead(message["error"])
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave requests hanging on a reader bug
            logger.exception("engine output reader failed")
            self._mark_dead(f"engine output reader failed: {exc}")

    async def _watch_engine(self) -> None:
        while self.is_healthy:
            await asyncio.sleep(envs.FD_HEALTH_CHECK_INTERVAL_S)

    def _handle_outputs(self, core: EngineCoreOutputs) -> None:
        if core.stats is not None:
            self.metrics.on_scheduler_stats(core.stats)
        good: list[EngineCoreOutput] = []
        for out in core.outputs:
            if out.error is None:
                good.append(out)
                continue
            parent = self.output_processor.parent_of(out.request_id)
            if parent is not None:
                self.output_processor.remove_request(parent)
                self._put(parent, EngineGenerateError(out.error))
        outputs, to_abort, _ = self.output_processor.process(good, delta=True, now=core.timestamp)
        for output in outputs:
            self._put(output.request_id, output)
        if to_abort:
            self._send({"type": "abort", "ids": to_abort})

    def _put(self, request_id: str, item: Any) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        logger.error("engine is dead: %s", reason)
        self.metrics.on_scheduler_stats(SchedulerStats())  # nothing runs or waits any more
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))

    def _send(self, message: dict[str, Any]) -> None:
        """Queue a message for the engine core (never blocks; ZMQ buffers)."""
        self._to_core.send(encode(message))

    # ---- EngineClient ----------------------------------------------------------------

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is dead (the engine core or a worker exited), or None while it is alive."""
        return self._dead_reason

    @property
    def is_healthy(self) -> bool:
        """False once the engine core or a worker has died (or after shutdown).

        Checking also notices an engine core that has exited and fails the requests in flight.
        """
        if self._dead_reason is None and not self._closed and self._proc is not None:
            if not self._proc.is_alive():
                self._mark_dead(f"the engine core process exited (exit code {self._proc.exitcode})")
        return self._dead_reason is None and not self._closed

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        mm_items: list[MMItem] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        self._ensure_tasks()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.time()
        core_requests = self.input_processor.make_core_requests(
            request_id, prompt_token_ids, sampling_params, arrival, mm_items=mm_items
        )
        state = RequestState(request_id, prompt, prompt_token_ids, sampling_params, self.tokenizer, arrival)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(state)
        finished = False
        try:
            for core_request in core_requests:  # no await in between: the mirror sees the send order
                wire = core_request.to_wire()
                wire["mm_items"] = self._feature_mirror.strip(wire["mm_items"])
                self._send({"type": "add", "request": wire})
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        child_ids = self.output_processor.abort_request(request_id)
        if child_ids and self._dead_reason is None and not self._closed:
            self._send({"type": "abort", "ids": child_ids})

    async def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        self._abort_now(request_id)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError())

    def shutdown(self) -> None:
        """Stop the engine core and its workers, and remove the run's sockets; safe to call twice.

        Returns only once every engine process is gone: the engine core is asked to
        stop (once it is ready; it stops its workers first), then sent SIGTERM, then
        killed, each after :data:`ENGINE_STOP_GRACE_S`; whatever is left in its
        process group (a worker of a killed engine core) is killed last.
        """
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        try:
            self._stop_engine_processes()
            for sock in ("_to_core", "_from_core"):
                if hasattr(self, sock):
                    getattr(self, sock).close(linger=0)
            self._zmq.term()
            self._zmq_sync.term()
        finally:
            remove_ipc_dir(self._ipc_dir)

    def _stop_engine_processes(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if self._ready and proc.is_alive():
            try:
                self._to_core.send(encode({"type": "shutdown"}), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            proc.join(ENGINE_STOP_GRACE_S)
        proc.stop(ENGINE_STOP_GRACE_S)
        if not kill_process_group(proc.pid):
            logger.warning("an engine process outlived the engine core")
