"""The engine core: scheduler + executor, advanced one step at a time."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

from fastdeploy import envs
from fastdeploy.config import EngineConfig
from fastdeploy.core.request import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Request,
    longest_prompt,
)
from fastdeploy.core.step_io import GrammarBitmask, SchedulerOutput
from fastdeploy.engine.feature_mirror import FeatureMirror
from fastdeploy.model_executor.model_loader import ModelSource
from fastdeploy.structured_output.grammar_processes import grammar_process_count

if TYPE_CHECKING:
    from fastdeploy.structured_output.manager import PendingBitmask, StructuredOutputManager


class WorkerStepError(RuntimeError):
    """A worker raised while executing a step; that step's requests fail, the engine goes on."""


logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, source: ModelSource) -> int:
    """``--max-model-len`` or the model's context length; never beyond what its rotary table covers."""
    limit = source.arch.max_position_embeddings
    wanted = config.model.max_model_len or limit
    if wanted > limit:
        raise ValueError(f"max_model_len {wanted} exceeds the model's context length {limit}")
    return wanted


def resolve_async_scheduling(config: EngineConfig) -> bool:
    """``--async-scheduling``, or by default on for a GPU and off for a CPU. Replicas whose MoE
    layers meet (expert parallelism over data-parallel replicas) overlap too: each engine core
    step sends exactly one forward to its workers, so the replicas' forwards stay paired."""
    if config.scheduler.async_scheduling is not None:
        return config.scheduler.async_scheduling
    from fastdeploy.platforms import resolve_device

    return resolve_device(config).type == "cuda"


def resolve_grammar_processes(config: EngineConfig) -> int:
    """The engine core's grammar processes: ``FD_GRAMMAR_PROCESSES``, or by default 8 on a GPU host
    with cores to spare (:func:`~fastdeploy.structured_output.grammar_processes.grammar_process_count`)."""
    from fastdeploy.platforms import resolve_device

    on_gpu = resolve_device(config).type == "cuda"
    return grammar_process_count(envs.FD_GRAMMAR_PROCESSES, config.parallel.data_parallel_size, on_gpu)


def resolve_scheduler_limits(config: EngineConfig, offline: bool = False) -> EngineConfig:
    """``config`` with the platform's defaults filled in for the limits left unset
    (``max_num_batched_tokens``: :func:`~fastdeploy.platforms.device.default_max_num_batched_tokens`;
    ``offline``: the ``LLM`` class's, which favour throughput)."""
    if config.scheduler.max_num_batched_tokens is not None:
        return config
    from fastdeploy.platforms import resolve_device
    from fastdeploy.platforms.device import default_max_num_batched_tokens

    budget = default_max_num_batched_tokens(resolve_device(config), offline)
    scheduler = dataclasses.replace(config.scheduler, max_num_batched_tokens=budget)
    return dataclasses.replace(config, scheduler=scheduler)


class KVCacheTooSmallError(RuntimeError):
    """The KV cache memory cannot hold even one sequence of max_model_len tokens."""


@dataclasses.dataclass
class GrammarReadyWaits:
    """How long structured-output requests waited, from arrival, for their grammar's compile (or
    the cache): a request of a new schema samples its first token no earlier (its prompt is
    prefilled meanwhile)."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, wait_s: float) -> None:
        """Count one request's wait."""
        self.count += 1
        self.total_s += wait_s
        self.max_s = max(self.max_s, wait_s)


class EngineCore:
    """Schedules, executes and updates; the same loop serves offline and online use."""

    GRAMMAR_WAIT_S = 0.01
    """How long an idle step waits for a grammar being compiled before returning (no busy loop)."""

    def __init__(self, config: EngineConfig, source: ModelSource, executor_cls):
        config = resolve_scheduler_limits(config)  # before the workers start: they size warm-ups by it
        self.config = config
        if envs.FD_SWITCH_INTERVAL_MS > 0:  # how long a thread may hold the GIL while others wait
            sys.setswitchinterval(envs.FD_SWITCH_INTERVAL_MS / 1000)
        self.source = source
        self.structured: StructuredOutputManager | None = None
        """Grammars and matchers of structured-output requests (made with the first such request, or at
        start-up with the grammar processes)."""
        self._awaiting_grammar: dict[str, tuple[Request, Future, float]] = {}
        """Structured-output requests whose grammar is being compiled (with when they came): in the
        scheduler, which prefills their prompts but their last token until the grammar is set."""
        self.grammar_ready_waits = GrammarReadyWaits()
        """How long structured-output requests waited for their grammar (benchmarks report it)."""
        self._grammar_failures: list[EngineCoreOutput] = []
        self.grammar_wait_s = 0.0
        """Time the engine loop has spent on grammar bitmasks: starting them and waiting for the
        manager's threads (benchmarks report it)."""
        self._pending_bitmask: PendingBitmask | None = None
        """With async scheduling, the bitmask of the step in flight, being made while the loop hands
        out the previous step's outputs and schedules the next (sampled before the next launch)."""
        self.max_model_len = resolve_max_model_len(config, source)
        processes = resolve_grammar_processes(config)
        self._grammar_processes_started: Future | None = None
        if processes and source.pooler is None:
            # started now, beside the model's load and warm-up (seconds each), not with the first
            # structured request, which would wait for them
            self.structured = self._new_structured_manager(processes)
            self._grammar_processes_started = self.structured.start_processes_soon()
        try:
            self.executor = executor_cls(config, source, self.max_model_len)
        except BaseException:
            if self.structured is not None:
                self.structured.shutdown()
            raise
        try:
            self._set_up(config)
        except BaseException:  # an error or SIGTERM while sizing the cache: the worker goes too
            self.shutdown()
            raise

    def _set_up(self, config: EngineConfig) -> None:
        from fastdeploy.scheduler.scheduler import Scheduler

        num_blocks = self.executor.determine_num_blocks()
        block_size = config.cache.block_size
        if num_blocks * block_size < self.max_model_len:
            raise KVCacheTooSmallError(
                f"the KV cache holds {num_blocks} blocks x {block_size} = {num_blocks * block_size} tokens, "
                f"fewer than max_model_len={self.max_model_len}; raise --kv-cache-memory / "
                "--gpu-memory-utilization or lower --max-model-len"
            )
        self.num_blocks = num_blocks
        self.executor.initialize_cache(num_blocks)
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len)
        self.feature_mirror = FeatureMirror(config.cache.encoder_cache_memory)
        """Features received from the front end, by content hash: a repeated item is sent once."""
        self.async_scheduling = resolve_async_scheduling(config)
        # placeholders stand for sampled tokens in flight; the pooling runner samples none
        self.scheduler.async_scheduling = self.async_scheduling and self.source.pooler is None
        self._in_flight: SchedulerOutput | None = None
        """The step the worker holds (async scheduling): its output comes back with the next call."""
        sched = config.scheduler
        logger.info(
            "engine limits: max_num_batched_tokens=%d, max_num_seqs=%d, max_model_len=%d, "
            "async_scheduling=%s, KV cache %d blocks of %d tokens (%d tokens)",
            sched.max_num_batched_tokens, sched.max_num_seqs, self.max_model_len, self.async_scheduling,
            num_blocks, block_size, num_blocks * block_size,
        )  # fmt: skip
        if self._grammar_processes_started is not None:  # ready before the engine is (a failed start
            # is logged and tried again by the first compile)
            if self.executor.worker_on_gpu_in_process:
                self.structured.pin_masks()
            self._grammar_processes_started.result()
        pooler = self.source.pooler
        if pooler is not None:
            logger.info(
                "pooling runner (embeddings only): %s pooling, normalize=%s, matryoshka dimensions=%s",
                pooler.pooling_type, pooler.normalize, pooler.matryoshka_dimensions or pooler.is_matryoshka,
            )  # fmt: skip

    def add_request(self, core_request: EngineCoreRequest) -> None:
        # first, so that the front end's mirror and ours see the same items even if this request is refused
        mm_items = self.feature_mirror.resolve(core_request.mm_items)
        num_prompt = len(core_request.prompt_token_ids)
        pooling = core_request.pooling_params is not None
        if pooling != (self.source.pooler is not None):
            raise ValueError(
                "this model serves embeddings only (--runner pooling)"
                if self.source.pooler is not None
                else "this model serves generation only; embeddings need --runner pooling"
            )
        longest = longest_prompt(self.max_model_len, pooling, core_request.sampling_params.max_tokens)
        if not 0 < num_prompt <= longest:
            raise ValueError(f"prompt has {num_prompt} tokens; it must have 1 to {longest}")
        request = Request(core_request, self.config.cache.block_size, mm_items)
        constraint = core_request.sampling_params.structured_outputs
        if constraint is None:
            self.scheduler.add_request(request)
            return
        if self.structured is None:
            self.structured = self._new_structured_manager(pin_memory=self.executor.worker_on_gpu_in_process)
        # compiled in a thread while the scheduler prefills the prompt, all but its last token
        request.awaiting_grammar = True
        self._awaiting_grammar[request.request_id] = (
            request,
            self.structured.submit(constraint),
            time.perf_counter(),
        )
        self.scheduler.add_request(request)

    def _new_structured_manager(
        self, num_processes: int = 0, pin_memory: bool = False
    ) -> StructuredOutputManager:
        from fastdeploy.engine.input_processor import eos_ids_of
        from fastdeploy.engine.ipc import ChildProcess
        from fastdeploy.model_executor.model_loader import load_tokenizer
        from fastdeploy.structured_output.manager import StructuredOutputManager

        source, model = self.source, self.config.model
        return StructuredOutputManager(
            lambda: load_tokenizer(model, source),
            source.arch.vocab_size,
            eos_ids_of(source.arch.eos_token_ids, None),
            pin_memory=pin_memory,
            max_rows=self.config.scheduler.max_num_seqs,
            start_process=ChildProcess,
            num_processes=num_processes,
        )

    def _set_compiled_grammars(self) -> None:
        """Give the requests whose grammar is compiled their matcher (or fail them)."""
        for req_id, (request, future, came) in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[req_id]
            if self.scheduler.requests.get(req_id) is not request:
                continue  # finished meanwhile (a failed step aborted it): no matcher to make
            error = future.exception()
            if error is None and not self.structured.is_usable(future):  # its grammar process was
                # started again since (a crash): compiled again there
                again = self.structured.submit(request.sampling_params.structured_outputs)
                self._awaiting_grammar[req_id] = (request, again, came)
                continue
            self.grammar_ready_waits.add(time.perf_counter() - came)
            if error is not None:
                message = f"the structured-output grammar could not be compiled: {error}"
                for output in self.scheduler.abort_requests([req_id]):
                    output.error = message
                    self._grammar_failures.append(output)
                continue
            grammar = self.structured.new_request_grammar(future.result(), sorted(request.eos_token_ids))
            self.scheduler.set_grammar(request, grammar)

    def _start_grammar_bitmask(self, req_ids: list[str]) -> PendingBitmask:
        """Start the bitmask rows of the given requests (those still running with a grammar) in the
        structured-output manager's threads; the engine loop's part counts in :attr:`grammar_wait_s`."""
        start = time.perf_counter()
        requests = [self.scheduler.requests.get(r) for r in req_ids]
        kept = [(r, q.grammar) for r, q in zip(req_ids, requests) if q is not None and q.grammar is not None]
        pending = self.structured.start_bitmask([r for r, _ in kept], [g for _, g in kept])
        self.grammar_wait_s += time.perf_counter() - start
        return pending

    def _grammar_bitmask(self, pending: PendingBitmask) -> GrammarBitmask:
        """Wait for a started bitmask (the wait counts in :attr:`grammar_wait_s`)."""
        start = time.perf_counter()
        bitmask = pending.result()
        self.grammar_wait_s += time.perf_counter() - start
        return bitmask

    def _sample_pending(self) -> None:
        """Sample the step in flight under its bitmask, once the manager's threads have made it."""
        pending, self._pending_bitmask = self._pending_bitmask, None
        if pending is not None:
            self.executor.sample_tokens(self._grammar_bitmask(pending))

    def abort_requests(self, request_ids: list[str]) -> EngineCoreOutputs:
        for req_id in request_ids:
            self._awaiting_grammar.pop(req_id, None)  # (its compile goes on, for the cache)
        return EngineCoreOutputs(outputs=self.scheduler.abort_requests(request_ids))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (the next prompts are computed in full); only while no request
        runs or waits. Whether it was reset."""
        if self.has_unfinished_requests():
            return False
        return self.scheduler.kv.pool.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or bool(self._grammar_failures)
        )

    def step(self, even_if_idle: bool = False) -> EngineCoreOutputs:
        """Schedule one batch, run it, and return the new tokens and a stats snapshot.

        With async scheduling the batch is launched and the previous batch's tokens
        come back instead, so the scheduler works on step N+1 while step N runs. Requests
        with a grammar get the bitmask of their next token: computed at scheduling time, or,
        with async scheduling, once step N's tokens have advanced their matchers (the worker
        runs step N+1's forward meanwhile and samples it when the bitmask arrives).
        ``even_if_idle``: run the step with nothing scheduled too (the workers then run a dummy
        forward: expert parallelism over data-parallel replicas needs every replica's forward).
        """
        if self._awaiting_grammar:
            self._set_compiled_grammars()
        failures, self._grammar_failures = self._grammar_failures, []
        if not self.scheduler.has_unfinished_requests() and self._in_flight is None and not even_if_idle:
            return EngineCoreOutputs(outputs=failures, stats=self.scheduler.make_stats())
        scheduler_output = self.scheduler.schedule()
        idle = not scheduler_output.total_num_scheduled_tokens and self._in_flight is None
        if idle and self._awaiting_grammar and not even_if_idle:
            # only prompts that wait for their grammar: nothing to run before a compile ends (in
            # lockstep with other replicas, their steps go on meanwhile)
            wait([f for _, f, _ in self._awaiting_grammar.values()], self.GRAMMAR_WAIT_S, FIRST_COMPLETED)
        outputs: list[EngineCoreOutput] = []
        try:
            if self.async_scheduling:
                self._sample_pending()  # the step in flight samples before this one is launched
                runner_output = self.executor.execute_model_overlap(scheduler_output)
                if runner_output is not None:
                    self.scheduler.accept_grammar_tokens(runner_output)
                if scheduler_output.structured_req_ids:
                    # made while the previous step's outputs are booked and handed out and the
                    # next step is scheduled
                    self._pending_bitmask = self._start_grammar_bitmask(scheduler_output.structured_req_ids)
                if runner_output is not None:
                    outputs = self.scheduler.update_from_output(runner_output)
            else:
                if scheduler_output.structured_req_ids:
                    pending = self._start_grammar_bitmask(scheduler_output.structured_req_ids)
                    scheduler_output.grammar = self._grammar_bitmask(pending)
                runner_output = self.executor.execute_model(scheduler_output)
                self.scheduler.accept_grammar_tokens(runner_output)
                outputs = self.scheduler.update_from_output(runner_output)
        except WorkerStepError as exc:
            # the steps' requests fail; everyone else carries on
            logger.error("engine step failed: %s", exc)
            failed = list(scheduler_output.num_scheduled_tokens)
            if self._in_flight is not None:
                failed += list(self._in_flight.num_scheduled_tokens)
            self._in_flight = None
            self._pending_bitmask = None
            aborted = self.scheduler.abort_requests(list(dict.fromkeys(failed)))
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else "engine step failed"
            for output in aborted:
                output.error = message
            aborted_ids = {o.request_id for o in aborted}
            kept = [o for o in outputs if o.request_id not in aborted_ids]
            return EngineCoreOutputs(outputs=failures + kept + aborted, stats=self.scheduler.make_stats())
        if self.async_scheduling:
            self._in_flight = scheduler_output if scheduler_output.total_num_scheduled_tokens else None
        return EngineCoreOutputs(outputs=failures + outputs, stats=self.scheduler.make_stats())

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.shutdown()
        self.executor.shutdown()
