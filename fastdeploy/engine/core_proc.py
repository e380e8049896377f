"""The engine core process: receives requests over ZMQ, steps the engine, streams outputs back."""

from __future__ import annotations

import functools
import logging
import time
import traceback

import zmq

from fastdeploy import envs
from fastdeploy.config import EngineConfig
from fastdeploy.core.request import EngineCoreOutput, EngineCoreRequest, SchedulerStats, outputs_to_rows
from fastdeploy.engine.ipc import decode, encode, ipc_address
from fastdeploy.platforms.gc_heap import freeze_startup_heap

logger = logging.getLogger(__name__)


def input_socket_name(rank: int) -> str:
    """The name of the socket (in the run's ipc dir) on which the engine core of data-parallel ``rank``
    receives requests (it binds it; every API server's engine client connects to it)."""
    return f"in{rank}"


def output_socket_name(client: int) -> str:
    """The name of the socket (in the run's ipc dir) on which the engine client of API server ``client``
    receives its requests' outputs (it binds it; every engine core connects to it)."""
    return f"out{client}"


CONTROL_SOCKET_NAME = "ctl"
"""The socket on which whoever started the engine cores hears ``ready`` / ``failed`` from each."""


def engine_core_main(config: EngineConfig, ipc_dir: str, num_clients: int = 1) -> None:
    """Entry point of the engine core process (a :class:`~fastdeploy.engine.ipc.ChildProcess`).

    Its sockets, and its workers', live in the run's private ``ipc_dir``: ``in<rank>``
    (requests from every API server, fan-in), ``out<client>`` for each of the
    ``num_clients`` API servers (``--api-server-count``; each request's outputs go only to
    the client that sent it) and ``ctl`` (start-up reports to the process that started it).
    Messages in: ``{"type": "add", "request": ..., "client": i}``, ``{"type": "abort",
    "ids": [...]}``, ``{"type": "reset_prefix_cache", "token": t, "client": i}`` (answered to that
    client with ``{"type": "reset_prefix_cache", "ok": ..., "token": t}``), ``{"type": "shutdown"}``. Messages out, each with this core's ``rank``
    (``config.parallel.data_parallel_rank``): on ``ctl`` ``ready`` (once, with the resolved
    limits) or ``failed`` (start-up error); to the clients ``outputs`` (per step; the scheduler
    stats go to every client) and ``dead`` (a worker died, to every client; this process then
    exits). Whichever way it ends (shutdown message, SIGTERM, dead worker), its workers are
    stopped first.
    """
    rank = config.parallel.data_parallel_rank
    tag = f"engine{rank}" if config.parallel.data_parallel_size > 1 else "engine"
    logging.basicConfig(level=envs.FD_LOG_LEVEL, format=f"%(asctime)s %(levelname)s [{tag}] %(message)s")
    import torch

    torch.set_num_threads(1)  # this process only schedules; the worker owns the cores
    from fastdeploy.engine.core import EngineCore
    from fastdeploy.engine.multiproc_executor import MultiprocExecutor, WorkerDiedError
    from fastdeploy.model_executor.model_loader import resolve_model

    lockstep = config.parallel.expert_parallel_spans_replicas
    worker_init_method = join_replica_group(config) if lockstep else None
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(ipc_address(ipc_dir, input_socket_name(rank)))
    control = ctx.socket(zmq.PUSH)
    control.connect(ipc_address(ipc_dir, CONTROL_SOCKET_NAME))
    sockets = []
    for client in range(num_clients):
        socket = ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)  # a slow API server never blocks the engine's steps
        socket.connect(ipc_address(ipc_dir, output_socket_name(client)))
        sockets.append(socket)
    outbox = _Outbox(sockets, rank)
    core = None
    try:
        try:
            executor_cls = functools.partial(
                MultiprocExecutor, ipc_dir=ipc_dir, init_method=worker_init_method
            )
            core = EngineCore(config, resolve_model(config.model), executor_cls)
        except Exception as exc:
            control.send(
                encode(
                    {
                        "type": "failed",
                        "rank": rank,
                        "error": f"{type(exc).__name__}: {exc}",
                        "trace": traceback.format_exc(),
                    }
                )
            )
            return
        ready = {"type": "ready", "max_model_len": core.max_model_len, "num_blocks": core.num_blocks}
        freeze_startup_heap(f"engine core {rank}")
        control.send(encode({**ready, "rank": rank}))
        if lockstep:
            _run_lockstep_loop(core, inbox, outbox, WorkerDiedError)
        else:
            _run_loop(core, inbox, outbox, WorkerDiedError)
    finally:
        if core is not None:
            core.shutdown()
        for socket in (control, *sockets):
            socket.close(linger=1000)  # a last "failed" or "dead" still reaches the API servers
        inbox.close(linger=0)
        ctx.term()


class _Outbox:
    """The sockets to the API servers' engine clients, tagging every message with the sender's rank.

    With one client everything goes to it. With several, :meth:`send_outputs` sends each
    request's outputs to the client that added it (:meth:`own`, forgotten once the request
    finishes) and the scheduler stats to every client; :meth:`send` (``dead``) goes to all.
    """

    def __init__(self, sockets: list[zmq.Socket], rank: int):
        self.sockets = sockets
        self.rank = rank
        self._owners: dict[str, int] = {}
        """Engine request id → index of the client that added it (several clients only)."""

    def own(self, request_id: str, client: int) -> None:
        """Record that ``client`` added the request (its outputs go there)."""
        if len(self.sockets) > 1:
            self._owners[request_id] = client

    def send(self, message: dict, client: int | None = None) -> None:
        """Send ``message`` to ``client``, or to every client."""
        message["rank"] = self.rank
        frame = encode(message)
        for socket in self.sockets if client is None else (self.sockets[client],):
            socket.send(frame)

    def send_outputs(self, outputs: list[EngineCoreOutput], stats: SchedulerStats | None) -> None:
        """One ``outputs`` message per client with outputs (to every client when there are stats)."""
        stats_wire = vars(stats) if stats is not None else None  # flat: packed as it is
        if len(self.sockets) == 1:
            self.send(_outputs_message(outputs, stats_wire), 0)
            return
        per_client: list[list[EngineCoreOutput]] = [[] for _ in self.sockets]
        for output in outputs:
            owner = self._owners.get(output.request_id, 0)
            if output.finish_reason is not None:
                self._owners.pop(output.request_id, None)
            per_client[owner].append(output)
        for client, mine in enumerate(per_client):
            if mine or stats_wire is not None:
                self.send(_outputs_message(mine, stats_wire), client)


def _outputs_message(outputs: list[EngineCoreOutput], stats_wire: dict | None) -> dict:
    return {
        "type": "outputs",
        "outputs": outputs_to_rows(outputs),
        "stats": stats_wire,
        "sent": time.monotonic(),
    }


def _receive(core, inbox, outbox: _Outbox, timeout_ms: int) -> bool:
    """Apply the messages waiting (the first within ``timeout_ms``); True when one was ``shutdown``."""
    while inbox.poll(timeout_ms):
        message = decode(inbox.recv())
        kind = message["type"]
        if kind == "add":
            request = EngineCoreRequest.from_wire(message["request"])
            outbox.own(request.request_id, message.get("client", 0))
            try:
                core.add_request(request)
            except ValueError as exc:
                _send_outputs(outbox, [_rejected(request.request_id, str(exc))], None)
        elif kind == "abort":
            outputs = core.abort_requests(message["ids"])
            _send_outputs(outbox, outputs.outputs, None)
        elif kind == "reset_prefix_cache":
            reply = {"type": "reset_prefix_cache", "ok": core.reset_prefix_cache(), "token": message["token"]}
            outbox.send(reply, message.get("client", 0))
        elif kind == "shutdown":
            return True
        timeout_ms = 0
    return False


def _run_loop(core, inbox, outbox: _Outbox, worker_died_error: type[Exception]) -> None:
    idle_poll_ms = int(envs.FD_HEALTH_CHECK_INTERVAL_S * 1000)
    reported_idle = True
    while True:
        if _receive(core, inbox, outbox, 0 if core.has_unfinished_requests() else idle_poll_ms):
            return
        try:
            if core.has_unfinished_requests():
                outputs = core.step()
                _send_outputs(outbox, outputs.outputs, outputs.stats)
                reported_idle = False
            else:
                core.executor.check_health()
                if not reported_idle:  # one last snapshot so gauges settle at idle values
                    _send_outputs(outbox, [], core.scheduler.make_stats())
                    reported_idle = True
        except worker_died_error as exc:
            logger.error("%s", exc)
            outbox.send({"type": "dead", "error": str(exc)})
            return


LOCKSTEP_IDLE_POLL_MS = 5
"""How long an idle engine core of a lockstep group waits for requests before the next "has work" exchange."""


def join_replica_group(config: EngineConfig) -> str:
    """Join the engine cores of every data-parallel replica (gloo, at ``data_parallel_init_method``)
    and agree on where their workers meet (rank 0 picks a free port): returned as ``tcp://...``."""
    import torch.distributed as dist

    from fastdeploy.distributed import free_port_init_method

    parallel = config.parallel
    dist.init_process_group(
        "gloo",
        init_method=parallel.data_parallel_init_method,
        world_size=parallel.data_parallel_size,
        rank=parallel.data_parallel_rank,
    )
    chosen = [free_port_init_method() if parallel.data_parallel_rank == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def _run_lockstep_loop(core, inbox, outbox: _Outbox, worker_died_error: type[Exception]) -> None:
    """The loop of an engine core whose MoE layers span the data-parallel replicas: before every
    step the engine cores all-reduce (has work, shutting down); while any has work every one
    steps (an idle one with nothing scheduled: its workers run a dummy forward), so the
    workers' MoE collectives always meet. A shutdown of one stops all; a dead peer fails this one."""
    import torch
    import torch.distributed as dist

    reported_idle = True
    try:
        while True:
            busy = core.has_unfinished_requests()
            stopping = _receive(core, inbox, outbox, 0 if busy else LOCKSTEP_IDLE_POLL_MS)
            flags = torch.tensor([int(core.has_unfinished_requests()), int(stopping)])
            try:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            except RuntimeError as exc:
                raise worker_died_error(
                    f"an engine core of another data-parallel replica stopped: {exc}"
                ) from None
            if flags[1]:
                return
            if flags[0]:
                had_work = core.has_unfinished_requests()
                outputs = core.step(even_if_idle=True)
                if had_work or outputs.outputs:
                    _send_outputs(outbox, outputs.outputs, outputs.stats)
                    reported_idle = False
                    continue
            core.executor.check_health()
            if not reported_idle:
                _send_outputs(outbox, [], core.scheduler.make_stats())
                reported_idle = True
    except worker_died_error as exc:
        logger.error("%s", exc)
        outbox.send({"type": "dead", "error": str(exc)})
    finally:
        dist.destroy_process_group()


def _rejected(request_id: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], "abort", None, 0, error=message)


def _send_outputs(outbox: _Outbox, outputs: list[EngineCoreOutput], stats: SchedulerStats | None) -> None:
    outbox.send_outputs(outputs, stats)
