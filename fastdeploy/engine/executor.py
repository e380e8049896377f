"""Executors run scheduler steps on workers: in this process, or in worker processes."""

from __future__ import annotations

from fastdeploy.config import EngineConfig
from fastdeploy.core.step_io import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from fastdeploy.model_executor.model_loader import ModelSource
from fastdeploy.worker.worker import Worker


class InProcExecutor:
    """Runs the single worker in the engine core's own process (offline ``LLM``)."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        self.worker = Worker(config, source, max_model_len)
        self.worker.load_model()

    @property
    def worker_on_gpu_in_process(self) -> bool:
        """The worker shares this process and runs on a GPU: host buffers handed to it (a grammar
        mask) can be pinned memory that it copies to the device as they are."""
        return self.worker.runner.device.type == "cuda"

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_overlap(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch this step; return the previous step's output (None if there was none)."""
        return self.worker.execute_model_overlap(scheduler_output)

    def sample_tokens(self, grammar: GrammarBitmask) -> None:
        """Sample the step just launched with ``execute_model_overlap``, under ``grammar``."""
        self.worker.sample_tokens(grammar)

    def check_health(self) -> None:
        """Raises if a worker is dead (never, in-process)."""

    def shutdown(self) -> None:
        pass
