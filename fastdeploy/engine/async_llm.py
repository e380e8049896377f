"""The API server's engine client: engine cores in their own processes, outputs streamed back over ZMQ.

With ``--data-parallel-size N`` it runs N engine cores (each with its own workers and KV
cache) and sends each request to the least-loaded one (:class:`~fastdeploy.engine.dp_router.Router`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from fastdeploy import envs
from fastdeploy.config import EngineConfig
from fastdeploy.core.mm_item import MMItem
from fastdeploy.core.outputs import RequestOutput, merge_delta_outputs
from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.core.request import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.distributed import free_port_init_method
from fastdeploy.engine.core_proc import engine_core_main, input_socket_name
from fastdeploy.engine.dp_router import Router
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
from fastdeploy.engine.parallel_layout import check_parallel_layout
from fastdeploy.engine.protocol import EngineClient, EngineDeadError
from fastdeploy.metrics import EngineMetrics
from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

logger = logging.getLogger(__name__)

ENGINE_STOP_GRACE_S = 2.0
"""On shutdown, how long the engine core may take to leave after the shutdown message (it reads it
between steps), and again after SIGTERM, before it is killed."""


def _has_tokens(output: RequestOutput) -> bool:
    return any(c.token_ids for c in output.outputs)


class EngineStartupError(RuntimeError):
    """The engine core failed to start (bad model, too little memory, ...)."""


class EngineGenerateError(RuntimeError):
    """The engine failed one request; the server stays up for the others."""


@dataclass
class _EngineCoreHandle:
    """The API server's side of one data-parallel rank's engine core process."""

    rank: int
    to_core: zmq.Socket
    """Requests, aborts and the shutdown message to this engine core (PUSH; never blocks: no HWM)."""
    feature_mirror: FeatureMirror
    """What this engine core holds of the features sent to it (a repeated item goes without them)."""
    proc: ChildProcess | None = field(default=None)

    def send(self, message: dict[str, Any]) -> None:
        """Queue a message for the engine core (never blocks; ZMQ buffers)."""
        self.to_core.send(encode(message))


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """A copy of ``config`` for the engine core of data-parallel ``rank`` (its workers pick their devices
    from it)."""
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_rank=rank))


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

    One engine core process per data-parallel rank (``--data-parallel-size``), all
    started at once; each request goes to one of them (:class:`Router`). They share
    one output socket: one asyncio task reads the outputs of all and routes them to
    per-request queues; another watches the engine processes. If any engine core or
    worker dies, every waiting request gets ``EngineDeadError`` and ``is_healthy``
    turns False.
    """

    def __init__(self, config: EngineConfig):
        self.source = resolve_model(config.model)
        check_parallel_layout(config, self.source.arch)  # before any process starts
        if config.parallel.expert_parallel_spans_replicas and not config.parallel.data_parallel_init_method:
            parallel = dataclasses.replace(config.parallel, data_parallel_init_method=free_port_init_method())
            config = dataclasses.replace(config, parallel=parallel)  # where the lockstep engine cores meet
        self.config = config
        self.tokenizer = load_tokenizer(config.model, self.source)
        self.eos_token_ids = eos_ids_of(self.source.arch.eos_token_ids, self.tokenizer)
        self.vocab_size = self.source.arch.vocab_size
        self.arch = self.source.arch
        self.pooler = self.source.pooler
        num_ranks = config.parallel.data_parallel_size
        self.model_name = config.model.served_model_name or _default_model_name(config, self.source)
        self.metrics = EngineMetrics(self.model_name, num_ranks)
        self._router = Router(
            num_ranks, config.cache.block_size if config.cache.enable_prefix_caching else None
        )
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
        self._cores: list[_EngineCoreHandle] = []
        """One per data-parallel rank, in rank order."""
        try:
            self._from_core = self._zmq.socket(zmq.PULL)
            self._from_core.bind(ipc_address(self._ipc_dir, "out"))
            for rank in range(num_ranks):
                core = _EngineCoreHandle(
                    rank, self._zmq_sync.socket(zmq.PUSH), FeatureMirror(config.cache.encoder_cache_memory)
                )
                self._cores.append(core)
                core.to_core.setsockopt(zmq.SNDHWM, 0)  # sends never block the event loop
                core.to_core.bind(ipc_address(self._ipc_dir, input_socket_name(rank)))
            for core in self._cores:  # all start now and load their models side by side
                name = "fastdeploy-engine-core" + (f"-{core.rank}" if num_ranks > 1 else "")
                args = (rank_config(config, core.rank), self._ipc_dir)
                core.proc = ChildProcess(engine_core_main, args, name=name, new_group=True)
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
        """The process id of the (rank 0) engine core."""
        proc = self._cores[0].proc if self._cores else None
        return None if proc is None else proc.pid

    def _which(self, rank: int) -> str:
        """`` of data-parallel rank N`` for messages about one engine core, when there are several."""
        return f" of data-parallel rank {rank}" if len(self._cores) > 1 else ""

    def _wait_ready(self) -> dict[str, Any]:
        """Block until every engine core reports ready (or one failed / died / the time is up).

        Returns rank 0's message (all ranks run the same model with the same limits).
        """
        poller_socket = zmq.Socket.shadow(self._from_core.underlying)
        deadline = time.monotonic() + envs.FD_ENGINE_READY_TIMEOUT_S
        ready: dict[int, dict[str, Any]] = {}
        while len(ready) < len(self._cores):
            STOP_SIGNALS.raise_if_received()
            if poller_socket.poll(200):
                message = decode(poller_socket.recv())
                if message["type"] == "ready":
                    ready[message["rank"]] = message
                elif message["type"] == "failed":
                    logger.debug("engine start-up trace:\n%s", message.get("trace"))
                    which = self._which(message["rank"])
                    raise EngineStartupError(f"the engine{which} failed to start: {message['error']}")
            else:
                for core in self._cores:
                    if core.proc is not None and not core.proc.is_alive():
                        raise EngineStartupError(
                            f"the engine process{self._which(core.rank)} exited during start-up "
                            f"(exit code {core.proc.exitcode})"
                        )
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"the engine did not start within {envs.FD_ENGINE_READY_TIMEOUT_S:.0f} s"
                )
        return ready[0]

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
                    received = time.monotonic()
                    outputs = EngineCoreOutputs.from_wire({**message, "timestamp": time.time()})
                    self._handle_outputs(outputs, message["rank"], message.get("sent"), received)
                elif message["type"] == "dead":
                    which = self._which(message["rank"])
                    self._mark_dead(f"{message['error']} (engine core{which})" if which else message["error"])
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave requests hanging on a reader bug
            logger.exception("engine output reader failed")
            self._mark_dead(f"engine output reader failed: {exc}")

    async def _watch_engine(self) -> None:
        while self.is_healthy:
            await asyncio.sleep(envs.FD_HEALTH_CHECK_INTERVAL_S)

    def _handle_outputs(
        self, core: EngineCoreOutputs, rank: int, sent: float | None = None, received: float | None = None
    ) -> None:
        """Deliver one message of outputs from the engine core of ``rank`` (``sent``: when the engine
        core sent it, ``received``: when it was read; ``time.monotonic()``, for the timelines)."""
        if core.stats is not None:
            self.metrics.on_scheduler_stats(core.stats, rank)
            self._router.on_kv_cache_usage(rank, core.stats.kv_cache_usage)
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
        detokenized = time.monotonic()
        for output in outputs:
            output.sent_at = sent
            timeline = output.timeline
            if timeline is not None and timeline.first_token_sent is None and _has_tokens(output):
                timeline.first_token_sent = sent
                timeline.first_token_received = received
                timeline.first_token_detokenized = detokenized
            self._put(output.request_id, output)
        if to_abort:  # choices a stop string ended, all of this rank
            self._cores[rank].send({"type": "abort", "ids": to_abort})

    def _put(self, request_id: str, item: Any) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        logger.error("engine is dead: %s", reason)
        for rank in range(len(self._cores)):  # nothing runs or waits any more
            self.metrics.on_scheduler_gauges(SchedulerStats(), rank)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))

    # ---- EngineClient ----------------------------------------------------------------

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is dead (an engine core or a worker exited), or None while it is alive."""
        return self._dead_reason

    @property
    def is_healthy(self) -> bool:
        """False once any engine core or worker has died (or after shutdown).

        Checking also notices an engine core that has exited and fails the requests in flight.
        """
        if self._dead_reason is None and not self._closed:
            for core in self._cores:
                if core.proc is not None and not core.proc.is_alive():
                    self._mark_dead(
                        f"the engine core process{self._which(core.rank)} exited (exit code {core.proc.exitcode})"
                    )
                    break
        return self._dead_reason is None and not self._closed

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        mm_items: list[MMItem] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        self._ensure_tasks()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.time()
        core_requests = self.input_processor.make_core_requests(
            request_id,
            prompt_token_ids,
            sampling_params,
            arrival,
            mm_items=mm_items,
            pooling_params=pooling_params,
        )
        state = RequestState(request_id, prompt, prompt_token_ids, sampling_params, self.tokenizer, arrival)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(state)
        route = self._router.route(request_id, len(core_requests), prompt_token_ids)
        core = self._cores[route.rank]
        finished = False
        try:
            for core_request in core_requests:  # no await in between: the mirror sees the send order
                wire = core_request.to_wire()
                wire["mm_items"] = core.feature_mirror.strip(wire["mm_items"])
                core.send({"type": "add", "request": wire})
            state.timeline.queued = time.monotonic()
            backlog: deque = deque()
            while True:
                if not backlog:
                    backlog.append(await queue.get())
                while not queue.empty():  # behind the engine: what waits goes out as one delta
                    backlog.append(queue.get_nowait())
                item = backlog.popleft()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                while backlog and not item.finished and not isinstance(backlog[0], BaseException):
                    item = merge_delta_outputs(item, backlog.popleft())
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_now(request_id, route.rank)
            self._router.release(request_id, route)

    def _abort_now(self, request_id: str, rank: int | None) -> None:
        """Abort a request's unfinished choices in the engine core of ``rank`` (None: not known, all)."""
        child_ids = self.output_processor.abort_request(request_id)
        if child_ids and self._dead_reason is None and not self._closed:
            for core in self._cores if rank is None else [self._cores[rank]]:
                core.send({"type": "abort", "ids": child_ids})

    async def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        self._abort_now(request_id, self._router.rank_of(request_id))
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError())

    def shutdown(self) -> None:
        """Stop the engine cores and their workers, and remove the run's sockets; safe to call twice.

        Returns only once every engine process is gone: the engine cores are asked to
        stop (once they are ready; each stops its workers first), then sent SIGTERM, then
        killed, each step after :data:`ENGINE_STOP_GRACE_S` for all of them together;
        whatever is left in their process groups (a worker of a killed engine core) is killed last.
        """
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        try:
            self._stop_engine_processes()
            for core in self._cores:
                core.to_core.close(linger=0)
            if hasattr(self, "_from_core"):
                self._from_core.close(linger=0)
            self._zmq.term()
            self._zmq_sync.term()
        finally:
            remove_ipc_dir(self._ipc_dir)

    def _stop_engine_processes(self) -> None:
        procs = [core.proc for core in self._cores if core.proc is not None]
        if self._ready:
            for core in self._cores:
                if core.proc is not None and core.proc.is_alive():
                    with contextlib.suppress(zmq.ZMQError):
                        core.to_core.send(encode({"type": "shutdown"}), zmq.NOBLOCK)
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
