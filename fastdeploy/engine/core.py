"""The engine core: scheduler + executor, advanced one step at a time."""

from __future__ import annotations

import logging

from fastdeploy.config import EngineConfig
from fastdeploy.core.request import EngineCoreOutputs, EngineCoreRequest, Request
from fastdeploy.core.step_io import SchedulerOutput
from fastdeploy.engine.feature_mirror import FeatureMirror
from fastdeploy.model_executor.model_loader import ModelSource


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
    """``--async-scheduling``, or by default on for a GPU and off for a CPU (and off when expert
    parallelism spans data-parallel replicas)."""
    if config.scheduler.async_scheduling is not None:
        return config.scheduler.async_scheduling
    if config.parallel.expert_parallel_spans_replicas:
        return False  # the replicas' steps run in lockstep, one at a time
    from fastdeploy.platforms import resolve_device

    return resolve_device(config).type == "cuda"


class KVCacheTooSmallError(RuntimeError):
    """The KV cache memory cannot hold even one sequence of max_model_len tokens."""


class EngineCore:
    """Schedules, executes and updates; the same loop serves offline and online use."""

    def __init__(self, config: EngineConfig, source: ModelSource, executor_cls):
        self.config = config
        self.max_model_len = resolve_max_model_len(config, source)
        self.executor = executor_cls(config, source, self.max_model_len)
        try:
            self._set_up(config)
        except BaseException:  # an error or SIGTERM while sizing the cache: the worker goes too
            self.executor.shutdown()
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
        self.scheduler.async_scheduling = self.async_scheduling
        self._in_flight: SchedulerOutput | None = None
        """The step the worker holds (async scheduling): its output comes back with the next call."""
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens)", num_blocks, block_size, num_blocks * block_size
        )

    def add_request(self, core_request: EngineCoreRequest) -> None:
        # first, so that the front end's mirror and ours see the same items even if this request is refused
        mm_items = self.feature_mirror.resolve(core_request.mm_items)
        num_prompt = len(core_request.prompt_token_ids)
        if not 0 < num_prompt < self.max_model_len:
            raise ValueError(f"prompt has {num_prompt} tokens; it must have 1 to {self.max_model_len - 1}")
        self.scheduler.add_request(Request(core_request, self.config.cache.block_size, mm_items))

    def abort_requests(self, request_ids: list[str]) -> EngineCoreOutputs:
        return EngineCoreOutputs(outputs=self.scheduler.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> EngineCoreOutputs:
        """Schedule one batch, run it, and return the new tokens and a stats snapshot.

        With async scheduling the batch is launched and the previous batch's tokens
        come back instead, so the scheduler works on step N+1 while step N runs.
        """
        if not self.has_unfinished_requests():
            return EngineCoreOutputs(stats=self.scheduler.make_stats())
        scheduler_output = self.scheduler.schedule()
        try:
            if self.async_scheduling:
                runner_output = self.executor.execute_model_overlap(scheduler_output)
            else:
                runner_output = self.executor.execute_model(scheduler_output)
        except WorkerStepError as exc:
            # the steps' requests fail; everyone else carries on
            logger.error("engine step failed: %s", exc)
            failed = list(scheduler_output.num_scheduled_tokens)
            if self._in_flight is not None:
                failed += list(self._in_flight.num_scheduled_tokens)
            self._in_flight = None
            outputs = self.scheduler.abort_requests(list(dict.fromkeys(failed)))
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else "engine step failed"
            for output in outputs:
                output.error = message
            return EngineCoreOutputs(outputs=outputs, stats=self.scheduler.make_stats())
        if self.async_scheduling:
            self._in_flight = scheduler_output if scheduler_output.total_num_scheduled_tokens else None
        outputs = self.scheduler.update_from_output(runner_output) if runner_output is not None else []
        return EngineCoreOutputs(outputs=outputs, stats=self.scheduler.make_stats())

    def shutdown(self) -> None:
        self.executor.shutdown()
