"""Synchronous engine for offline use: front end and engine core in one process."""

from __future__ import annotations

import functools
import time
from typing import Any

from fastdeploy.config import EngineConfig
from fastdeploy.core.mm_item import MMItem
from fastdeploy.core.outputs import RequestOutput
from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.core.request import SchedulerStats
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.core import EngineCore
from fastdeploy.engine.executor import InProcExecutor
from fastdeploy.engine.input_processor import InputProcessor, eos_ids_of
from fastdeploy.engine.ipc import new_ipc_dir, remove_ipc_dir
from fastdeploy.engine.multiproc_executor import MultiprocExecutor
from fastdeploy.engine.output_processor import OutputProcessor, RequestState
from fastdeploy.engine.parallel_layout import ParallelLayoutError, check_parallel_layout
from fastdeploy.model_executor.model_loader import load_generation_defaults, load_tokenizer, resolve_model
from fastdeploy.multimodal.encoder_cache import EncoderCacheManager
from fastdeploy.multimodal.prompt import MultimodalPromptBuilder
from fastdeploy.multimodal.url_policy import MediaUrlPolicy


class LLMEngine:
    """Adds requests and steps the engine core until they finish."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.source = resolve_model(config.model)
        check_parallel_layout(config, self.source.arch)
        if config.parallel.data_parallel_size > 1:
            raise ParallelLayoutError(
                "data_parallel_size > 1 runs replicas behind `fastdeploy serve`; the offline LLM runs one "
                "(use tensor_parallel_size to spread it over devices)"
            )
        if config.parallel.node_rank > 0:
            raise ParallelLayoutError(
                f"node_rank {config.parallel.node_rank}: the offline LLM runs node 0 of a multi-host launch; "
                "the other nodes run `fastdeploy serve --headless`"
            )
        self.tokenizer = load_tokenizer(config.model, self.source)
        self.generation_defaults = load_generation_defaults(config.model, self.source)
        """Sampling defaults of ``LLM.generate`` / ``chat`` calls without sampling params."""
        self._ipc_dir: str | None = None
        executor_cls: Any = InProcExecutor
        if (
            config.parallel.tensor_parallel_size > 1 or config.parallel.nnodes > 1
        ):  # a worker process per rank
            self._ipc_dir = new_ipc_dir()
            executor_cls = functools.partial(MultiprocExecutor, ipc_dir=self._ipc_dir)
        try:
            self.core = EngineCore(config, self.source, executor_cls)
        except BaseException:
            remove_ipc_dir(self._ipc_dir)
            raise
        self.max_model_len = self.core.max_model_len
        self.eos_token_ids = eos_ids_of(self.source.arch.eos_token_ids, self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.max_model_len,
            self.eos_token_ids,
            self.source.arch.vocab_size,
            max_logprobs=config.model.max_logprobs,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.mm_builder = MultimodalPromptBuilder(
            self.source.arch,
            allowed_local_media_path=config.model.allowed_local_media_path,
            cache=EncoderCacheManager.from_gib(config.cache.encoder_cache_memory),
            url_policy=MediaUrlPolicy.from_config(
                config.model.allowed_media_domains, config.model.allow_private_media_urls
            ),
            limit_per_prompt=config.model.limit_mm_per_prompt,
        )
        """Fetches and places the image / video features of prompts (``LLM.generate`` / ``LLM.chat``)."""
        self.stats = SchedulerStats()
        """Scheduler gauges of the last step and counters (prefix cache, preemptions) since start."""

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        prompt_text: str | None = None,
        mm_items: list[MMItem] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """Queue a prompt; ``mm_items`` are its placed multimodal items (see ``MultimodalPromptBuilder``);
        ``pooling_params`` makes it an embedding request (pooling runner)."""
        if (pooling_params is not None) != (self.source.pooler is not None):
            raise ValueError(
                "this model serves embeddings only (runner='pooling'): use LLM.embed"
                if self.source.pooler is not None
                else "this model serves generation; embeddings need an embedding model (runner='pooling')"
            )
        if isinstance(prompt, str):
            prompt_text, prompt_ids = prompt, self.input_processor.tokenize(prompt)
        else:
            prompt_ids = list(prompt)
        arrival = time.time()
        core_requests = self.input_processor.make_core_requests(
            request_id, prompt_ids, params, arrival, mm_items=mm_items, pooling_params=pooling_params
        )
        state = RequestState(request_id, prompt_text, prompt_ids, params, self.tokenizer, arrival)
        self.output_processor.add_request(state)
        for core_request in core_requests:
            self.core.add_request(core_request)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort_request(request_id))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (only while no request runs); whether it was reset."""
        return self.core.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step; returns cumulative outputs of the requests that progressed
        (``final_only``: of the requests that finished)."""
        core_outputs = self.core.step()
        if core_outputs.stats is not None:
            self.stats.accumulate(core_outputs.stats)
        outputs, to_abort, _ = self.output_processor.process(
            core_outputs.outputs, delta=False, final_only=final_only
        )
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        self.core.shutdown()
        remove_ipc_dir(self._ipc_dir)
