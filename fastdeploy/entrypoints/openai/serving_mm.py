"""Chat requests with precomputed image / video features: parts → placeholders → placed items.

The chat handler calls :meth:`MultimodalChatInputs.split` before rendering the
chat template (each feature part becomes ``<|vision_start|><|image_pad|><|vision_end|>``)
and :meth:`MultimodalChatInputs.place` after tokenizing (features fetched in
parallel off the event loop, checked, and one placeholder token per feature
row). Every problem with an item is a 400 naming its URL or index.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastdeploy import envs
from fastdeploy.core.mm_item import MMItem
from fastdeploy.engine.protocol import EngineClient
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol import ChatMessage
from fastdeploy.multimodal.encoder_cache import EncoderCacheManager
from fastdeploy.multimodal.fetch import MIB
from fastdeploy.multimodal.inputs import FeatureItem, MultimodalInputError
from fastdeploy.multimodal.prompt import MultimodalPromptBuilder
from fastdeploy.multimodal.url_policy import MediaUrlPolicy

PLACE_THREADS = 16
"""Requests whose features are fetched at once (each fetches its URLs with its own threads)."""


class MultimodalChatInputs:
    """The API server's feature-part handling for one engine (its fetch cache lives here)."""

    def __init__(self, engine: EngineClient):
        self.engine = engine
        self._builder: MultimodalPromptBuilder | None = None
        self._fetch_threads: ThreadPoolExecutor | None = None

    @property
    def builder(self) -> MultimodalPromptBuilder:
        """Created on first use, with a fetch cache of ``--encoder-cache-memory`` GiB."""
        if self._builder is None:
            if self.engine.arch is None:
                raise BadRequestError("this server cannot take image or video inputs", param="messages")
            metrics = getattr(self.engine, "metrics", None)
            self._builder = MultimodalPromptBuilder(
                self.engine.arch,
                allowed_local_media_path=self.engine.config.model.allowed_local_media_path,
                cache=EncoderCacheManager.from_gib(self.engine.config.cache.encoder_cache_memory),
                observe_latency=None if metrics is None else metrics.on_feature_fetch,
                max_inline_bytes=int(envs.FD_FEATURE_MAX_MB * MIB),
                url_policy=MediaUrlPolicy.from_config(
                    self.engine.config.model.allowed_media_domains,
                    self.engine.config.model.allow_private_media_urls,
                ),
                limit_per_prompt=self.engine.config.model.limit_mm_per_prompt,
            )
        return self._builder

    def _executor(self) -> ThreadPoolExecutor:
        """The threads that fetch requests' features: their own, so that slow downloads never hold
        the event loop's default threads (the Responses store, tokenization fallbacks)."""
        if self._fetch_threads is None:
            self._fetch_threads = ThreadPoolExecutor(PLACE_THREADS, thread_name_prefix="fd-mm-place")
        return self._fetch_threads

    async def split(
        self, messages: list[ChatMessage], run_tokenizer: Any
    ) -> tuple[list[dict[str, Any]] | None, list[FeatureItem]]:
        """Template-ready messages with placeholder text, and the items; ``(None, [])`` without feature parts.

        ``run_tokenizer(fn, *args)`` runs ``fn`` on the tokenizer thread (it
        looks up the vision tokens' text and decodes inline ``image_embeds``).
        """
        if not any(isinstance(m.content, list) for m in messages):
            return None, []
        conversation = [m.to_template_dict() for m in messages]
        try:
            return await run_tokenizer(self.builder.split_chat, conversation, self.engine.tokenizer)
        except MultimodalInputError as exc:
            raise BadRequestError(str(exc), param=exc.param or "messages") from None

    async def place(self, token_ids: list[int], items: list[FeatureItem]) -> tuple[list[int], list[MMItem]]:
        """Fetch and check the items (in a fetch thread) and expand their placeholders. A request
        cancelled meanwhile (its client gone) stops its downloads."""
        if not items:
            return token_ids, []
        cancel = threading.Event()
        builder = self.builder
        work = asyncio.get_running_loop().run_in_executor(
            self._executor(), builder.place, token_ids, items, cancel
        )
        try:
            return await work
        except MultimodalInputError as exc:
            raise BadRequestError(str(exc), param=exc.param or "messages") from None
        except asyncio.CancelledError:
            cancel.set()
            raise
