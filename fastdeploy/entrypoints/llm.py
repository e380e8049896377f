"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from fastdeploy.config import EngineConfig
from fastdeploy.core.mm_item import MMItem
from fastdeploy.core.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.core import resolve_scheduler_limits
from fastdeploy.engine.llm_engine import LLMEngine
from fastdeploy.multimodal.prompt import items_from_mm_data
from fastdeploy.platforms.backend import activate
from fastdeploy.platforms.gc_heap import freeze_startup_heap, unfreeze_heap

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Batch generation without a server.

    Keyword arguments are the engine's config fields (``max_num_seqs=8``,
    ``enable_prefix_caching=False``, ``dtype="float32"``, ...). With no
    ``model``, the embedded SmolLM2-135M-Instruct is used. ``backend="paddle"``
    needs Paddle bound before torch was imported (``FD_BACKEND=paddle``, docs/paddle.md).
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        activate(self.config.device.backend)  # paddle: only if chosen before torch was imported
        self.config = resolve_scheduler_limits(self.config, offline=True)  # (throughput-first defaults)
        self.engine = LLMEngine(self.config)
        self._counter = itertools.count()
        # (an in-process engine core and worker: the serving processes do the same when ready)
        freeze_startup_heap("offline engine")

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without sampling params: the model's
        generation_config.json defaults (``generation_config="auto"``, as vLLM's
        ``LLM.get_default_sampling_params``; ``max_new_tokens`` as ``max_tokens``), else
        ``SamplingParams()``."""
        defaults = dict(self.engine.generation_defaults)
        if "max_new_tokens" in defaults:
            defaults["max_tokens"] = defaults.pop("max_new_tokens")
        return SamplingParams(**defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order.

        A prompt is text, a list of token ids, or ``{"prompt_token_ids": [...]}``
        / ``{"prompt": "..."}``. Without a tokenizer (``skip_tokenizer_init``) prompts
        must be token ids and the outputs' text is empty.

        Vision-language models (Qwen2-VL) take precomputed features as in vLLM:
        ``{"prompt_token_ids": [...], "multi_modal_data": {"image": [{"image_embeds":
        tensor, "image_grid_thw": [t, h, w]}, ...], "video": [...]}}``, each item
        marked in the prompt by one ``image_token_id`` (``video_token_id``) that is
        expanded to one token per feature row (see docs/multimodal.md). Raises
        ``MultimodalInputError`` for an unusable item.
        """
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        placed = [self._place_mm(prompt) for prompt in prompt_list]  # every item checked before any runs
        request_ids = []
        for (prompt, mm_items), params in zip(placed, params_list):
            request_id = str(next(self._counter))
            self.engine.add_request(request_id, prompt, params, mm_items=mm_items or None)
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """The pooled vector of every prompt (text, token ids, or ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}``), in prompt order; an embedding model only (pooling runner).

        ``pooling_params`` overrides the model's pooling (``--pooler-config`` / its
        sentence-transformers config) for these prompts.
        """
        pooler = self.engine.source.pooler
        if pooler is None:
            raise ValueError(
                "this model serves generation; embed needs an embedding model (runner='pooling')"
            )
        params = pooling_params or pooler.params()
        request_ids, prompt_ids = [], []
        for prompt in self._as_prompt_list(prompts):
            if isinstance(prompt, dict):
                prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
            ids = self.engine.input_processor.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = str(next(self._counter))
            self.engine.add_request(request_id, ids, SamplingParams(), pooling_params=params)
            request_ids.append(request_id)
            prompt_ids.append(ids)
        return [
            EmbeddingRequestOutput(out.request_id, ids, EmbeddingOutput(out.embedding))
            for out, ids in zip(self._run(request_ids, use_tqdm), prompt_ids)
        ]

    def _place_mm(self, prompt: PromptType) -> tuple[str | list[int], list[MMItem]]:
        """The prompt (text or ids) and its placed multimodal items (fetched, placeholders expanded)."""
        if not isinstance(prompt, dict):
            return prompt, []
        text_or_ids = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
        items = items_from_mm_data(prompt.get("multi_modal_data") or {})
        if not items:
            return text_or_ids, []
        ids = (
            self.engine.input_processor.tokenize(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
        )
        return self.engine.mm_builder.place(ids, items)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.

        Message contents may hold the feature parts of the chat API
        (``image_feature_url``, ``video_feature_url``, ``image_embeds``) for
        vision-language models.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError(
                "chat needs a tokenizer (for the chat template); none is loaded "
                "(skip_tokenizer_init, or a model folder without one)"
            )
        prompts = []
        for conversation in conversations:
            conversation, items = self.engine.mm_builder.split_chat(conversation, tokenizer)
            text = tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            mm_data = {m: [item for item in items if item.modality == m] for m in ("image", "video")}
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": mm_data})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts")
        try:
            while pending:
                for output in self.engine.step(final_only=True):
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        if progress:
                            progress.update(1)
        except BaseException:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        finally:
            if progress:
                progress.close()
        return [finished[r] for r in request_ids]

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):
            return [prompts]
        return prompts

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix, so the next prompts are computed in full (between
        benchmark runs, say), as vLLM's ``LLM.reset_prefix_cache``; whether it was reset."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()
        unfreeze_heap()  # what the engine held is collectable again (no leak reports at exit)
