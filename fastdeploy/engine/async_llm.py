"""The API server's engine client: engine cores in their own processes, outputs streamed back over ZMQ.

With ``--data-parallel-size N`` it runs N engine cores (each with its own workers and KV
cache) and sends each request to the least-loaded one (:class:`~fastdeploy.engine.dp_router.Router`).
With ``--api-server-count`` > 1 the ``fastdeploy serve`` process starts the engine cores and each
API server process's ``AsyncLLM`` attaches to them (:class:`~fastdeploy.engine.engine_cores.EngineAttachment`):
its requests go to the cores' shared input sockets, their outputs come back on its own socket, and
its router balances only its own requests over the ranks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from fastdeploy import envs
from fastdeploy.config import EngineConfig, as_list
from fastdeploy.core.mm_item import MMItem
from fastdeploy.core.outputs import RequestOutput, merge_delta_outputs
from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.core.request import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.core_proc import input_socket_name, output_socket_name
from fastdeploy.engine.dp_router import Route, Router, SharedRankLoads
from fastdeploy.engine.engine_cores import (
    EngineAttachment,
    EngineCores,
    EngineStartupError,
    WatchedProcess,
    which_rank,
    with_replica_init_method,
)
from fastdeploy.engine.feature_mirror import FeatureMirror
from fastdeploy.engine.input_processor import InputProcessor, eos_ids_of
from fastdeploy.engine.ipc import decode, encode, ipc_address, new_ipc_dir, remove_ipc_dir
from fastdeploy.engine.output_processor import OutputProcessor, RequestState
from fastdeploy.engine.parallel_layout import check_parallel_layout
from fastdeploy.engine.protocol import EngineClient, EngineDeadError, EngineRequestRejected
from fastdeploy.metrics import EngineMetrics
from fastdeploy.model_executor.model_loader import load_generation_defaults, load_tokenizer, resolve_model

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineRequestRejected", "EngineStartupError"]


def _has_tokens(output: RequestOutput) -> bool:
    return any(c.token_ids for c in output.outputs)


@dataclass
class _EngineCoreHandle:
    """The API server's side of one data-parallel rank's engine core process."""

    rank: int
    to_core: zmq.Socket
    """Requests, aborts and the shutdown message to this engine core (PUSH; never blocks: no HWM)."""
    feature_mirror: FeatureMirror
    """What this engine core holds of the features sent to it (a repeated item goes without them)."""
    proc: Any = field(default=None)
    """Its process (``ChildProcess`` or ``WatchedProcess``): ``is_alive()``, ``exitcode``."""

    def send(self, message: dict[str, Any]) -> None:
        """Queue a message for the engine core (never blocks; ZMQ buffers)."""
        self.to_core.send(encode(message))


def _default_model_name(config: EngineConfig, source: Any) -> str:
    """The name the API serves the model under when none is given (the ``model_name`` metrics label).

    Must agree with ``http_server.default_served_model_names``: the embedded default
    model is served as ``DEFAULT_MODEL_NAME``, not under its .gguf file name.
    """
    if not config.model.model:
        from fastdeploy.model_executor.model_loader.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return source.display_name.removesuffix(".gguf")


class _OutputStream:
    """The delta outputs of one request ``AsyncLLM.generate`` has sent: an async iterator.

    Outputs that wait when the consumer asks go out as one (``merge_delta_outputs``). The end
    of the request, an error (engine dead, aborted), cancellation while waiting, or
    :meth:`aclose` releases it: its queue and route are dropped and, unless it finished, its
    unfinished choices are aborted in the engine core.
    """

    def __init__(self, llm: AsyncLLM, request_id: str, queue: asyncio.Queue, route: Route):
        self._llm = llm
        self.request_id = request_id
        self._queue = queue
        self._route = route
        self._backlog: deque = deque()
        self._finished = False
        self._released = False

    def __aiter__(self) -> _OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._released:
            raise StopAsyncIteration
        queue, backlog = self._queue, self._backlog
        try:
            if not backlog:
                backlog.append(await queue.get())
            while not queue.empty():  # behind the engine: what waits goes out as one delta
                backlog.append(queue.get_nowait())
            item = backlog.popleft()
            if isinstance(item, BaseException):
                self._finished = True  # dead engine, or aborted by abort(): nothing left to abort
                raise item
            while backlog and not item.finished and not isinstance(backlog[0], BaseException):
                item = merge_delta_outputs(item, backlog.popleft())
        except BaseException:
            self.release()
            raise
        if item.finished:
            self._finished = True
            self.release()
        return item

    async def aclose(self) -> None:
        """Release the request now (aborting it if unfinished)."""
        self.release()

    def release(self) -> None:
        """Drop the request's queue and route; abort it in the engine unless it finished. Idempotent."""
        if self._released:
            return
        self._released = True
        llm = self._llm
        llm._queues.pop(self.request_id, None)
        if not self._finished:
            llm._abort_now(self.request_id, self._route.rank)
        llm._router.release(self.request_id, self._route)


class AsyncLLM(EngineClient):
    """Tokenizes and detokenizes here; schedules and runs the model in child processes.

    One engine core process per data-parallel rank (``--data-parallel-size``), all
    started at once (:class:`EngineCores`), or those another process started (``attach``:
    this is one of several API server processes); each request goes to one of them
    (:class:`Router`). Their outputs for this client come on one socket: one asyncio task
    reads them and routes them to per-request queues; another watches the engine
    processes. If any engine core or worker dies, every waiting request gets
    ``EngineDeadError`` and ``is_healthy`` turns False.
    """

    def __init__(self, config: EngineConfig, attach: EngineAttachment | None = None):
        self.source = resolve_model(config.model)
        check_parallel_layout(config, self.source.arch)  # before any process starts
        if attach is None:
            config = with_replica_init_method(config)
        self.config = config
        self.attachment = attach
        self.tokenizer = load_tokenizer(config.model, self.source)
        self.generation_defaults = load_generation_defaults(config.model, self.source)
        """Sampling defaults of requests that leave them unset (``--generation-config``)."""
        self.eos_token_ids = eos_ids_of(self.source.arch.eos_token_ids, self.tokenizer)
        self.vocab_size = self.source.arch.vocab_size
        self.max_logprobs = config.model.max_logprobs
        """Most logprobs a request may ask for per token (``--max-logprobs``; -1: no bound)."""
        self.arch = self.source.arch
        self.pooler = self.source.pooler
        num_ranks = config.parallel.data_parallel_size
        self.client_index = attach.client_index if attach is not None else 0
        num_clients = attach.num_clients if attach is not None else 1
        self.model_name = next(iter(as_list(config.model.served_model_name)), None) or _default_model_name(
            config, self.source
        )
        # the engine cores' interval counters reach every client: client 0 alone adds them up
        self.metrics = EngineMetrics(self.model_name, num_ranks, engine_counters=self.client_index == 0)
        shared_loads = None
        if attach is not None and num_clients > 1 and num_ranks > 1:  # balance with the other API servers
            path = os.path.join(attach.ipc_dir, "dp_rank_loads")
            shared_loads = SharedRankLoads(path, num_clients, self.client_index, num_ranks)
        self._router = Router(
            num_ranks, config.cache.block_size if config.cache.enable_prefix_caching else None, shared_loads
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        self._queues: dict[str, asyncio.Queue] = {}
        self._resets: dict[int, tuple[asyncio.Future, list[bool]]] = {}
        """Prefix-cache resets waiting for the engine cores' answers: token → (result, answers so far)."""
        self._dead_reason: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False

        self._zmq = zmq.asyncio.Context()
        self._zmq_sync = zmq.Context()
        self._ipc_dir = attach.ipc_dir if attach is not None else new_ipc_dir()
        """This run's private socket directory (the engine core's and its workers' sockets too)."""
        self._engine_cores: EngineCores | None = None
        """The engine core processes, when this client started them."""
        self._cores: list[_EngineCoreHandle] = []
        """One per data-parallel rank, in rank order."""
        # the mirror needs the one sender per engine core that sees every item in order: with several
        # API servers each sends every item's features (engine/feature_mirror.py)
        mirror_gib = config.cache.encoder_cache_memory if num_clients == 1 else 0.0
        try:
            self._from_core = self._zmq.socket(zmq.PULL)
            self._from_core.bind(ipc_address(self._ipc_dir, output_socket_name(self.client_index)))
            for rank in range(num_ranks):
                core = _EngineCoreHandle(rank, self._zmq_sync.socket(zmq.PUSH), FeatureMirror(mirror_gib))
                self._cores.append(core)
                core.to_core.setsockopt(zmq.SNDHWM, 0)  # sends never block the event loop
                core.to_core.connect(ipc_address(self._ipc_dir, input_socket_name(rank)))
            if attach is None:
                self._engine_cores = EngineCores(config, self._ipc_dir)
                for core, proc in zip(self._cores, self._engine_cores.procs):
                    core.proc = proc
                ready = self._engine_cores.wait_ready()
            else:
                for core, pid in zip(self._cores, attach.core_pids):
                    core.proc = WatchedProcess(pid)
                ready = {"max_model_len": attach.max_model_len, "num_blocks": attach.num_blocks}
        except BaseException:  # a failed start, or SIGINT/SIGTERM meanwhile: nothing may be left behind
            self.shutdown()
            raise
        self.max_model_len = ready["max_model_len"]
        self.num_blocks = ready["num_blocks"]
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.max_model_len,
            self.eos_token_ids,
            self.source.arch.vocab_size,
            max_logprobs=config.model.max_logprobs,
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
        return which_rank(rank, len(self._cores))

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
                elif message["type"] == "reset_prefix_cache":
                    self._on_reset_answer(message["token"], bool(message["ok"]))
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
                self._put(parent, EngineRequestRejected(out.error))
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
        for done, _ in self._resets.values():
            if not done.done():
                done.set_result(False)

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
                    code = core.proc.exitcode
                    self._mark_dead(
                        f"the engine core process{self._which(core.rank)} exited"
                        + (f" (exit code {code})" if code is not None else "")
                    )
                    break
        return self._dead_reason is None and not self._closed

    def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        mm_items: list[MMItem] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Send the request to an engine core now, on this call (not on the first iteration: a burst's
        prefills need not wait for each stream to start), and return its delta outputs as an async
        iterator. Its end, an error, or ``aclose()`` before the end releases the request (aborting
        it in the engine if unfinished); whoever calls this must do one of them."""
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
        stream = _OutputStream(self, request_id, queue, route)
        core = self._cores[route.rank]
        try:
            for core_request in core_requests:  # no await in between: the mirror sees the send order
                wire = core_request.to_wire()
                wire["mm_items"] = core.feature_mirror.strip(wire["mm_items"])
                core.send({"type": "add", "request": wire, "client": self.client_index})
        except BaseException:
            stream.release()
            raise
        state.timeline.queued = time.monotonic()
        return stream

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

    async def reset_prefix_cache(self, timeout_s: float = 30.0) -> bool:
        """Forget every engine core's cached prefixes (SGLang's ``/flush_cache``, vLLM's
        ``/reset_prefix_cache``); only done where no request runs or waits. Whether every core reset."""
        self._ensure_tasks()
        if self._dead_reason is not None or not self._cores:
            return False
        token = max(self._resets, default=0) + 1
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._resets[token] = (done, [])
        try:
            for core in self._cores:
                core.send({"type": "reset_prefix_cache", "token": token, "client": self.client_index})
            return await asyncio.wait_for(done, timeout_s)
        except asyncio.TimeoutError:
            return False
        finally:
            self._resets.pop(token, None)

    def _on_reset_answer(self, token: int, ok: bool) -> None:
        waiting = self._resets.get(token)
        if waiting is None:
            return
        done, answers = waiting
        answers.append(ok)
        if len(answers) == len(self._cores) and not done.done():
            done.set_result(all(answers))

    def shutdown(self) -> None:
        """Stop the engine cores this client started and their workers, and remove the run's sockets
        (an attached client only closes its own sockets); safe to call twice.

        Returns only once every engine process it started is gone (:meth:`EngineCores.stop`).
        """
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        try:
            if self._engine_cores is not None:
                self._engine_cores.stop()
            for core in self._cores:
                core.to_core.close(linger=0)
                if isinstance(core.proc, WatchedProcess):
                    core.proc.close()
            if hasattr(self, "_from_core"):
                self._from_core.close(linger=0)
            self._zmq.term()
            self._zmq_sync.term()
        finally:
            if self._router.shared is not None:
                self._router.shared.close()
            if self.attachment is None:
                remove_ipc_dir(self._ipc_dir)
