"""A worker: one device, one model runner. Used in-process (offline) or in a worker process."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from fastdeploy import envs
from fastdeploy.config import EngineConfig
from fastdeploy.core.step_io import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from fastdeploy.distributed import init_tensor_parallel
from fastdeploy.distributed.multinode import node_layout, world_store
from fastdeploy.model_executor.model_loader import ModelSource
from fastdeploy.ops import cpu_ops
from fastdeploy.platforms import configure_threads, kv_cache_budget_bytes, resolve_device
from fastdeploy.worker.model_runner import ModelRunner
from fastdeploy.worker.step_profiler import StepProfiler

logger = logging.getLogger(__name__)


def worker_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of tensor-parallel rank ``rank``: on CUDA, GPU ``dp_rank * tp_size + rank``
    (unless ``--device`` names one GPU, for a single worker); over several hosts, that world
    rank's index on its node."""
    device = resolve_device(config)
    if device.type != "cuda" or device.index is not None:
        return device
    parallel = config.parallel
    world_rank = parallel.data_parallel_rank * parallel.tensor_parallel_size + rank
    layout = node_layout(parallel)
    return torch.device("cuda", world_rank if layout is None else layout.local_index(world_rank))


class Worker:
    """Sets up the device, loads the model, sizes and allocates the KV cache, runs steps."""

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        max_model_len: int,
        rank: int = 0,
        init_method: str | None = None,
    ):
        """Rank ``rank`` of the tensor-parallel group that meets at ``init_method`` (one rank: None; with
        expert parallelism over data-parallel replicas, the world of every replica's workers; over
        several hosts, node 0's store instead)."""
        self.config = config
        self.rank = rank
        self.device = worker_device(config, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        configure_threads(config, self.device)
        parallel = config.parallel
        layout = node_layout(parallel)  # several hosts: every worker meets in node 0's store
        init_tensor_parallel(
            parallel.tensor_parallel_size,
            rank,
            init_method or "",
            self.device,
            expert_parallel=parallel.enable_expert_parallel,
            dp_size=parallel.data_parallel_size,
            dp_rank=parallel.data_parallel_rank,
            store=None if layout is None else world_store(layout, envs.FD_ENGINE_READY_TIMEOUT_S),
        )
        torch.manual_seed(config.model.seed)
        self.runner = ModelRunner(config, source, self.device, max_model_len)
        self.profiler = StepProfiler.from_env(f"dp{parallel.data_parallel_rank}-rank{rank}", self.device)
        """A torch profile of a window of steps (``FD_TORCH_PROFILER_DIR``), or None."""
        cpu_ops.preload_cpu_ops(self.device, self.runner.dtype)  # compile (or wait) before reporting ready

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        """KV cache blocks that fit the memory budget (or ``num_gpu_blocks_override``)."""
        override = self.config.cache.num_gpu_blocks_override
        if override:
            return override
        peak = 0
        if self.device.type == "cuda":  # weights + the activations of the largest step
            torch.cuda.reset_peak_memory_stats(self.device)
            self.runner.profile_run()
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.empty_cache()
        budget = kv_cache_budget_bytes(self.config, self.device, peak)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            logger.info(
                "GPU memory: %.1f GiB total, %.1f GiB free, peak of weights + profile run %.2f GiB, "
                "reserved %.2f GiB: KV cache budget %.2f GiB",
                total / 2**30,
                free / 2**30,
                peak / 2**30,
                torch.cuda.memory_reserved(self.device) / 2**30,
                budget / 2**30,
            )
        return max(budget // self.runner.kv_cache_bytes_per_block(), 0)

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._step(self.runner.execute_model, scheduler_output)

    def execute_model_overlap(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self._step(self.runner.execute_model_overlap, scheduler_output)

    def _step(self, run: Callable[[SchedulerOutput], Any], scheduler_output: SchedulerOutput) -> Any:
        """``run(scheduler_output)``, inside the step profiler's window when there is one."""
        if self.profiler is None:
            return run(scheduler_output)
        self.profiler.step_begin(scheduler_output.total_num_scheduled_tokens)
        try:
            return run(scheduler_output)
        finally:
            self.profiler.step_end()

    def sample_tokens(self, grammar: GrammarBitmask) -> None:
        self.runner.sample_tokens(grammar)
