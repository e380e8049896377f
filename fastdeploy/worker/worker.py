"""A worker: one device, one model runner. Used in-process (offline) or in a worker process."""

from __future__ import annotations

import logging

import torch

from fastdeploy.config import EngineConfig
from fastdeploy.model_executor.model_loader import ModelSource
from fastdeploy.platforms import configure_threads, kv_cache_budget_bytes, resolve_device
from fastdeploy.scheduler.output import ModelRunnerOutput, SchedulerOutput
from fastdeploy.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    """Sets up the device, loads the model, sizes and allocates the KV cache, runs steps."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        self.config = config
        self.device = resolve_device(config)
        configure_threads(config, self.device)
        torch.manual_seed(config.model.seed)
        self.runner = ModelRunner(config, source, self.device, max_model_len)

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        """KV cache blocks that fit the memory budget (or ``num_gpu_blocks_override``)."""
        override = self.config.cache.num_gpu_blocks_override
        if override:
            return override
        budget = kv_cache_budget_bytes(self.config, self.device)
        return max(budget // self.runner.kv_cache_bytes_per_block(), 0)

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
